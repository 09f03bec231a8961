#include "core/comm/nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace moeserve {
namespace {

ncclComm_t AsComm(void* c) { return static_cast<ncclComm_t>(c); }
cudaStream_t AsStream(void* s) { return static_cast<cudaStream_t>(s); }

absl::Status NcclError(const char* what, ncclResult_t res, ncclComm_t comm) {
  return absl::InternalError(absl::StrCat(what, ": ", ncclGetErrorString(res), " (",
                                          comm ? ncclGetLastError(comm) : "", ")"));
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// NcclCommGroup.

std::string NcclCommGroup::Version() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return "NCCL (unknown version)";
  // NCCL_VERSION(X,Y,Z) = X*10000 + Y*100 + Z for 2.9+.
  return absl::StrCat("NCCL ", v / 10000, ".", (v / 100) % 100, ".", v % 100);
}

absl::StatusOr<std::shared_ptr<NcclCommGroup>> NcclCommGroup::Create(std::vector<int> devices,
                                                                     std::vector<void*> streams,
                                                                     absl::Duration timeout) {
  const int n = static_cast<int>(devices.size());
  return CreateLocalWithId(std::move(devices), std::move(streams), timeout, n, 0, "", timeout);
}

absl::StatusOr<std::string> NcclCommGroup::NewUniqueId() {
  ncclUniqueId id;
  if (ncclResult_t res = ncclGetUniqueId(&id); res != ncclSuccess) {
    return NcclError("ncclGetUniqueId", res, nullptr);
  }
  return std::string(id.internal, sizeof(id.internal));
}

absl::StatusOr<std::shared_ptr<NcclCommGroup>> NcclCommGroup::CreateMultiProcess(
    std::vector<int> devices, std::vector<void*> streams, int world_size, int first_rank,
    const std::string& unique_id, absl::Duration timeout, absl::Duration formation_timeout) {
  if (unique_id.size() != sizeof(ncclUniqueId::internal)) {
    return absl::InvalidArgumentError(absl::StrCat("NcclCommGroup: unique id of ", unique_id.size(),
                                                   " bytes, expected ",
                                                   sizeof(ncclUniqueId::internal)));
  }
  if (first_rank < 0 || first_rank + static_cast<int>(devices.size()) > world_size) {
    return absl::InvalidArgumentError(absl::StrCat("NcclCommGroup: local ranks [", first_rank, ", ",
                                                   first_rank + devices.size(),
                                                   ") outside the world of ", world_size));
  }
  return CreateLocalWithId(std::move(devices), std::move(streams), timeout, world_size, first_rank,
                           unique_id, formation_timeout);
}

absl::StatusOr<std::shared_ptr<NcclCommGroup>> NcclCommGroup::CreateLocalWithId(
    std::vector<int> devices, std::vector<void*> streams, absl::Duration timeout, int world,
    int first_rank, const std::string& unique_id, absl::Duration formation_timeout) {
  if (devices.empty() || devices.size() != streams.size()) {
    return absl::InvalidArgumentError(absl::StrCat("NcclCommGroup: ", devices.size(),
                                                   " devices and ", streams.size(), " streams"));
  }
  std::shared_ptr<NcclCommGroup> g(new NcclCommGroup());
  g->devices_ = std::move(devices);
  g->streams_ = std::move(streams);
  g->timeout_ = timeout;
  g->world_ = world;
  g->first_rank_ = first_rank;
  g->unique_id_ = unique_id;
  g->multi_process_ = !unique_id.empty();
  const int n = g->local_size();
  g->comm_aborted_ = std::make_unique<std::atomic<bool>[]>(n);
  for (int r = 0; r < n; ++r) {
    g->endpoints_.push_back(
        std::unique_ptr<NcclCommunicator>(new NcclCommunicator(g.get(), first_rank + r, r)));
    MOESERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(g->devices_[r]));
    MOESERVE_CUDA_RETURN_IF_ERROR(cudaMalloc(&g->endpoints_[r]->scratch_, sizeof(int)));
  }
  MOESERVE_RETURN_IF_ERROR(g->Init(formation_timeout));
  return g;
}

absl::Status NcclCommGroup::Init(absl::Duration wait) {
  const int n = local_size();
  ncclUniqueId id;
  if (multi_process_) {
    std::memcpy(id.internal, unique_id_.data(), sizeof(id.internal));
  } else if (ncclResult_t res = ncclGetUniqueId(&id); res != ncclSuccess) {
    return NcclError("ncclGetUniqueId", res, nullptr);
  }
  comms_.assign(n, nullptr);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // every call returns; we bound the waits ourselves
  ncclResult_t res = ncclGroupStart();
  for (int r = 0; r < n && (res == ncclSuccess || res == ncclInProgress); ++r) {
    MOESERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(devices_[r]));
    ncclComm_t c = nullptr;
    res = ncclCommInitRankConfig(&c, world_, id, first_rank_ + r, &config);
    comms_[r] = c;
  }
  const ncclResult_t end = ncclGroupEnd();
  if (res == ncclSuccess || res == ncclInProgress) res = end;
  for (int r = 0; r < n; ++r) comm_aborted_[r].store(comms_[r] == nullptr);
  if (res != ncclSuccess && res != ncclInProgress) {
    AbortAll();
    return NcclError("ncclCommInitRankConfig", res, nullptr);
  }
  const absl::Time deadline = absl::Now() + wait;
  int polls = 0;
  for (int r = 0; r < n; ++r) {
    while (true) {
      ncclResult_t st = ncclInProgress;
      ncclCommGetAsyncError(AsComm(comms_[r]), &st);
      if (st == ncclSuccess) break;
      if (st != ncclInProgress) {
        absl::Status s =
            NcclError(absl::StrCat("NCCL init of rank ", r).c_str(), st, AsComm(comms_[r]));
        AbortAll();
        return s;
      }
      if (absl::Now() > deadline) {
        AbortAll();
        return absl::DeadlineExceededError(absl::StrCat("NCCL communicator init of rank ", r,
                                                        " did not finish within ",
                                                        absl::FormatDuration(wait)));
      }
      // Yield at first (a local group forms in milliseconds), then sleep: a process that loaded
      // its weights first may wait minutes for its peers and should not hold a core meanwhile.
      if (++polls < 1000) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
  }
  return absl::OkStatus();
}

NcclCommGroup::~NcclCommGroup() {
  // Abort rather than destroy: ncclCommDestroy of several communicators from one thread may wait
  // on each other; abort frees the resources without coordination.
  AbortAll();
  for (size_t r = 0; r < endpoints_.size(); ++r) {
    cudaSetDevice(devices_[r]);
    endpoints_[r].reset();
  }
}

NcclCommunicator::~NcclCommunicator() {
  if (scratch_ != nullptr) cudaFree(scratch_);
}

std::shared_ptr<NcclCommunicator> NcclCommGroup::communicator(int rank) {
  return std::shared_ptr<NcclCommunicator>(shared_from_this(), endpoints_[rank].get());
}

void NcclCommGroup::Fail(const absl::Status& cause) {
  std::lock_guard<std::mutex> lock(mu_);
  if (failure_.ok()) failure_ = cause;
  failed_.store(true, std::memory_order_release);
}

void NcclCommGroup::Abort(const absl::Status& cause) {
  Fail(cause.ok() ? absl::AbortedError("aborted") : cause);
}

void NcclCommGroup::AbortAll() {
  for (int r = 0; r < local_size(); ++r) {
    if (r < static_cast<int>(comms_.size()) && comms_[r] != nullptr &&
        !comm_aborted_[r].exchange(true)) {
      cudaSetDevice(devices_[r]);
      ncclCommAbort(AsComm(comms_[r]));
    }
  }
}

absl::Status NcclCommGroup::status() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failure_;
}

absl::Status NcclCommGroup::Reinit() {
  if (multi_process_) {
    return absl::FailedPreconditionError(
        "a multi-process NCCL group cannot be rebuilt from one process; restart the group");
  }
  AbortAll();
  for (int r = 0; r < local_size(); ++r) {
    // Let aborted NCCL kernels drain before new communicators use the streams.
    cudaSetDevice(devices_[r]);
    cudaStreamSynchronize(AsStream(streams_[r]));
    cudaGetLastError();
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    failure_ = absl::OkStatus();
  }
  MOESERVE_RETURN_IF_ERROR(Init(timeout_));
  failed_.store(false, std::memory_order_release);
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// NcclCommunicator.

int NcclCommunicator::world_size() const { return group_->world_size(); }
int NcclCommunicator::device() const { return group_->devices_[local_]; }
void* NcclCommunicator::stream() const { return group_->streams_[local_]; }

void NcclCommunicator::Abort(const absl::Status& cause) { group_->Abort(cause); }

absl::Status NcclCommunicator::Check(const char* what) {
  if (!group_->healthy()) {
    // Abort our own communicator so NCCL kernels waiting on a dead peer exit.
    if (!group_->comm_aborted_[local_].exchange(true))
      ncclCommAbort(AsComm(group_->comms_[local_]));
    const absl::Status cause = group_->status();
    return absl::AbortedError(absl::StrCat(what, " on rank ", rank_,
                                           ": the NCCL group was "
                                           "aborted: ",
                                           cause.message()));
  }
  return absl::OkStatus();
}

absl::Status NcclCommunicator::WaitEnqueued(const char* what) {
  ncclComm_t comm = AsComm(group_->comms_[local_]);
  const absl::Time deadline = absl::Now() + group_->timeout_;
  for (uint64_t spin = 0;; ++spin) {
    ncclResult_t st = ncclInProgress;
    ncclCommGetAsyncError(comm, &st);
    if (st == ncclSuccess) return absl::OkStatus();
    if (st != ncclInProgress) {
      absl::Status s = NcclError(absl::StrCat(what, " on rank ", rank_).c_str(), st, comm);
      group_->Fail(s);
      return s;
    }
    MOESERVE_RETURN_IF_ERROR(Check(what));
    if (absl::Now() > deadline) {
      absl::Status s = absl::DeadlineExceededError(
          absl::StrCat(what, " on rank ", rank_, ": not enqueued within ",
                       absl::FormatDuration(group_->timeout_), "; NCCL group aborted"));
      group_->Fail(s);
      if (!group_->comm_aborted_[local_].exchange(true)) ncclCommAbort(comm);
      return s;
    }
    if (spin > 4096) std::this_thread::yield();  // spin first: enqueueing takes microseconds
  }
}

absl::Status NcclCommunicator::AllToAllVGroup(absl::Span<const AllToAllVTransfer> transfers) {
  MOESERVE_RETURN_IF_ERROR(Check("AllToAllV"));
  MOESERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(device()));
  ncclComm_t comm = AsComm(group_->comms_[local_]);
  cudaStream_t stream = AsStream(this->stream());
  const int world = world_size();
  // Own share first (a device copy, no NCCL).
  for (const AllToAllVTransfer& t : transfers) {
    if (t.send_counts[rank_] != t.recv_counts[rank_]) {
      return absl::InternalError(absl::StrCat("AllToAllV on rank ", rank_, ": sends ",
                                              t.send_counts[rank_], " bytes to itself, expects ",
                                              t.recv_counts[rank_]));
    }
    if (t.send_counts[rank_] > 0) {
      MOESERVE_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(static_cast<char*>(t.recv) + t.recv_displs[rank_],
                          static_cast<const char*>(t.send) + t.send_displs[rank_],
                          t.send_counts[rank_], cudaMemcpyDeviceToDevice, stream));
    }
  }
  bool any = false;
  for (const AllToAllVTransfer& t : transfers) {
    for (int p = 0; p < world; ++p)
      any = any || (p != rank_ && (t.send_counts[p] > 0 || t.recv_counts[p] > 0));
  }
  if (!any) return absl::OkStatus();
  MOESERVE_NCCL_RETURN_IF_ERROR(ncclGroupStart(), comm);
  // A failed enqueue still closes the group (left open, this thread's later collectives would
  // be deferred into it) and fails the group, as a failed ncclGroupEnd does.
  ncclResult_t enqueued = ncclSuccess;
  const auto fine = [](ncclResult_t r) { return r == ncclSuccess || r == ncclInProgress; };
  for (const AllToAllVTransfer& t : transfers) {
    for (int p = 0; p < world && fine(enqueued); ++p) {
      if (p == rank_) continue;
      if (t.send_counts[p] > 0) {
        enqueued = ncclSend(static_cast<const char*>(t.send) + t.send_displs[p], t.send_counts[p],
                            ncclUint8, p, comm, stream);
      }
      if (fine(enqueued) && t.recv_counts[p] > 0) {
        enqueued = ncclRecv(static_cast<char*>(t.recv) + t.recv_displs[p], t.recv_counts[p],
                            ncclUint8, p, comm, stream);
      }
    }
  }
  if (!fine(enqueued)) {
    ncclGroupEnd();
    absl::Status s =
        NcclError(absl::StrCat("AllToAllV enqueue on rank ", rank_).c_str(), enqueued, comm);
    group_->Fail(s);
    return s;
  }
  const ncclResult_t res = ncclGroupEnd();
  if (res != ncclSuccess && res != ncclInProgress) {
    absl::Status s = NcclError(absl::StrCat("AllToAllV on rank ", rank_).c_str(), res, comm);
    group_->Fail(s);
    return s;
  }
  return res == ncclInProgress ? WaitEnqueued("AllToAllV") : absl::OkStatus();
}

absl::Status NcclCommunicator::AllToAllV(const void* send, absl::Span<const int64_t> send_counts,
                                         absl::Span<const int64_t> send_displs, void* recv,
                                         absl::Span<const int64_t> recv_counts,
                                         absl::Span<const int64_t> recv_displs) {
  const size_t w = static_cast<size_t>(world_size());
  if (send_counts.size() != w || send_displs.size() != w || recv_counts.size() != w ||
      recv_displs.size() != w) {
    return absl::InvalidArgumentError("AllToAllV: spans must have world_size entries");
  }
  const AllToAllVTransfer t{send, send_counts.data(), send_displs.data(),
                            recv, recv_counts.data(), recv_displs.data()};
  return AllToAllVGroup(absl::MakeConstSpan(&t, 1));
}

absl::Status NcclCommunicator::AllGather(const void* send, int64_t bytes, void* recv) {
  MOESERVE_RETURN_IF_ERROR(Check("AllGather"));
  MOESERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(device()));
  ncclComm_t comm = AsComm(group_->comms_[local_]);
  const ncclResult_t res =
      ncclAllGather(send, recv, static_cast<size_t>(bytes), ncclUint8, comm, AsStream(stream()));
  if (res != ncclSuccess && res != ncclInProgress) {
    absl::Status s = NcclError(absl::StrCat("AllGather on rank ", rank_).c_str(), res, comm);
    group_->Fail(s);
    return s;
  }
  return res == ncclInProgress ? WaitEnqueued("AllGather") : absl::OkStatus();
}

absl::Status NcclCommunicator::Barrier() {
  MOESERVE_RETURN_IF_ERROR(Check("Barrier"));
  MOESERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(device()));
  ncclComm_t comm = AsComm(group_->comms_[local_]);
  const ncclResult_t res =
      ncclAllReduce(scratch_, scratch_, 1, ncclInt32, ncclSum, comm, AsStream(stream()));
  if (res != ncclSuccess && res != ncclInProgress) {
    absl::Status s = NcclError(absl::StrCat("Barrier on rank ", rank_).c_str(), res, comm);
    group_->Fail(s);
    return s;
  }
  if (res == ncclInProgress) MOESERVE_RETURN_IF_ERROR(WaitEnqueued("Barrier"));
  return Synchronize();
}

absl::Status NcclCommunicator::Broadcast(void* buf, int64_t bytes, int root) {
  MOESERVE_RETURN_IF_ERROR(Check("Broadcast"));
  MOESERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(device()));
  ncclComm_t comm = AsComm(group_->comms_[local_]);
  const ncclResult_t res = ncclBroadcast(buf, buf, static_cast<size_t>(bytes), ncclUint8, root,
                                         comm, AsStream(stream()));
  if (res != ncclSuccess && res != ncclInProgress) {
    absl::Status s = NcclError(absl::StrCat("Broadcast on rank ", rank_).c_str(), res, comm);
    group_->Fail(s);
    return s;
  }
  return res == ncclInProgress ? WaitEnqueued("Broadcast") : absl::OkStatus();
}

absl::Status NcclCommunicator::Synchronize() {
  MOESERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(device()));
  ncclComm_t comm = AsComm(group_->comms_[local_]);
  cudaStream_t stream = AsStream(this->stream());
  const absl::Time deadline = absl::Now() + group_->timeout_;
  for (uint64_t spin = 0;; ++spin) {
    const cudaError_t q = cudaStreamQuery(stream);
    if (q == cudaSuccess) break;
    if (q != cudaErrorNotReady) {
      absl::Status s = absl::InternalError(absl::StrCat("rank ", rank_,
                                                        ": CUDA error on the "
                                                        "stream: ",
                                                        cudaGetErrorString(q)));
      group_->Fail(s);
      return s;
    }
    if ((spin & 63) == 63) {
      if (!group_->comm_aborted_[local_].load()) {
        ncclResult_t st = ncclSuccess;
        ncclCommGetAsyncError(comm, &st);
        if (st != ncclSuccess && st != ncclInProgress) {
          absl::Status s =
              NcclError(absl::StrCat("rank ", rank_, ": NCCL async error").c_str(), st, comm);
          group_->Fail(s);
          if (!group_->comm_aborted_[local_].exchange(true)) ncclCommAbort(comm);
          return s;
        }
      }
      MOESERVE_RETURN_IF_ERROR(Check("Synchronize"));
      if (absl::Now() > deadline) {
        absl::Status s = absl::DeadlineExceededError(absl::StrCat(
            "rank ", rank_, ": collective did not complete within ",
            absl::FormatDuration(group_->timeout_), " (a peer did not join); NCCL group aborted"));
        group_->Fail(s);
        if (!group_->comm_aborted_[local_].exchange(true)) ncclCommAbort(comm);
        return s;
      }
      std::this_thread::yield();
    }
  }
  return Check("Synchronize");
}

}  // namespace moeserve
