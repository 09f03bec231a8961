#include "core/comm/in_process_communicator.h"

#include <chrono>
#include <cstring>
#include <functional>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace moeserve {

absl::Status AllGatherCounts(Communicator& comm, absl::Span<const int64_t> mine,
                             std::vector<int64_t>* out) {
  out->assign(mine.size() * comm.world_size(), 0);
  return comm.AllGather(mine.data(), static_cast<int64_t>(mine.size() * sizeof(int64_t)),
                        out->data());
}

absl::Status CheckGatheredCounts(absl::Span<const int64_t> all, int world_size, int64_t max_rows,
                                 absl::string_view who) {
  if (world_size <= 0 || all.size() % static_cast<size_t>(world_size) != 0) {
    return absl::InternalError(
        absl::StrCat(who, ": ", all.size(), " gathered counts for ", world_size, " ranks"));
  }
  const size_t per_rank = all.size() / static_cast<size_t>(world_size);
  for (size_t i = 0; i < all.size(); ++i) {
    if (all[i] < 0 || all[i] > max_rows) {
      return absl::DataLossError(absl::StrCat(who, ": rank ", i / per_rank, " announced ", all[i],
                                              " in its count ", i % per_rank, ", expected 0 to ",
                                              max_rows));
    }
  }
  return absl::OkStatus();
}

namespace {

absl::string_view OpName(int op) {
  switch (op) {
    case 1:
      return "AllToAllV";
    case 2:
      return "AllGather";
    case 3:
      return "Barrier";
  }
  return "none";
}

}  // namespace

// One rank's endpoint.
class InProcessCommunicator final : public Communicator {
 public:
  InProcessCommunicator(std::shared_ptr<InProcessCommGroup> group, int rank)
      : group_(std::move(group)), rank_(rank) {}

  int rank() const override { return rank_; }
  int world_size() const override { return group_->world_size_; }

  absl::Status AllToAllV(const void* send, absl::Span<const int64_t> send_counts,
                         absl::Span<const int64_t> send_displs, void* recv,
                         absl::Span<const int64_t> recv_counts,
                         absl::Span<const int64_t> recv_displs) override {
    const size_t n = static_cast<size_t>(world_size());
    if (send_counts.size() != n || send_displs.size() != n || recv_counts.size() != n ||
        recv_displs.size() != n) {
      return Fail(absl::InternalError(
          absl::StrCat("AllToAllV on rank ", rank_,
                       ": count/displacement spans must have world_size=", n, " entries")));
    }
    InProcessCommGroup::Slot& slot = Post(InProcessCommGroup::Op::kAllToAllV);
    slot.send = static_cast<const std::byte*>(send);
    slot.send_counts = send_counts.data();
    slot.send_displs = send_displs.data();
    return Exchange(slot, "AllToAllV (post)", "AllToAllV (copied)", [&]() -> absl::Status {
      auto* out = static_cast<std::byte*>(recv);
      for (size_t p = 0; p < n; ++p) {
        const InProcessCommGroup::Slot& peer = group_->slots_[p];
        const int64_t bytes = peer.send_counts[rank_];
        if (bytes != recv_counts[p]) {
          return Fail(absl::InternalError(absl::StrCat("AllToAllV: rank ", p, " sends ", bytes,
                                                       " bytes to rank ", rank_, ", which expects ",
                                                       recv_counts[p])));
        }
        if (bytes > 0) {
          std::memcpy(out + recv_displs[p], peer.send + peer.send_displs[rank_], bytes);
        }
      }
      return absl::OkStatus();
    });
  }

  absl::Status AllGather(const void* send, int64_t bytes, void* recv) override {
    InProcessCommGroup::Slot& slot = Post(InProcessCommGroup::Op::kAllGather);
    slot.send = static_cast<const std::byte*>(send);
    slot.bytes = bytes;
    return Exchange(slot, "AllGather (post)", "AllGather (copied)", [&]() -> absl::Status {
      auto* out = static_cast<std::byte*>(recv);
      for (int p = 0; p < world_size(); ++p) {
        const InProcessCommGroup::Slot& peer = group_->slots_[p];
        if (peer.bytes != bytes) {
          return Fail(
              absl::InternalError(absl::StrCat("AllGather: rank ", p, " contributes ", peer.bytes,
                                               " bytes, rank ", rank_, " expects ", bytes)));
        }
        if (bytes > 0) std::memcpy(out + p * bytes, peer.send, bytes);
      }
      return absl::OkStatus();
    });
  }

  absl::Status Barrier() override {
    InProcessCommGroup::Slot& slot = Post(InProcessCommGroup::Op::kBarrier);
    return Exchange(slot, "Barrier", "Barrier (checked)", [] { return absl::OkStatus(); });
  }

  void Abort(const absl::Status& cause) override { group_->Abort(cause); }

 private:
  InProcessCommGroup::Slot& Post(InProcessCommGroup::Op op) {
    InProcessCommGroup::Slot& slot = group_->slots_[rank_];
    slot = InProcessCommGroup::Slot();
    slot.op = op;
    slot.seq = ++group_->next_seq_[rank_];
    return slot;
  }

  // The posted `slot`'s collective: the ranks meet (`posted`), check that they are in the same
  // collective and `read` their peers' slots, wait until no rank reads (a rank that fails early
  // must not free or repost what a slower peer still reads), then meet again (`done`).
  absl::Status Exchange(const InProcessCommGroup::Slot& slot, absl::string_view posted,
                        absl::string_view done, const std::function<absl::Status()>& read) {
    MOESERVE_RETURN_IF_ERROR(group_->Arrive(rank_, posted, /*opens_reads=*/true));
    absl::Status s = CheckPeersMatch(slot);
    if (s.ok()) s = read();
    group_->DoneReading();
    MOESERVE_RETURN_IF_ERROR(s);
    return group_->Arrive(rank_, done);
  }

  // Every rank must be in the same collective: same kind, same sequence number.
  absl::Status CheckPeersMatch(const InProcessCommGroup::Slot& mine) {
    for (int p = 0; p < world_size(); ++p) {
      const InProcessCommGroup::Slot& peer = group_->slots_[p];
      if (peer.op != mine.op || peer.seq != mine.seq) {
        return Fail(absl::InternalError(
            absl::StrCat("collective mismatch: rank ", rank_, " is in ",
                         OpName(static_cast<int>(mine.op)), " #", mine.seq, " but rank ", p,
                         " is in ", OpName(static_cast<int>(peer.op)), " #", peer.seq)));
      }
    }
    return absl::OkStatus();
  }

  // Aborts the group with `status` (so peers do not wait for this rank) and returns it.
  absl::Status Fail(absl::Status status) {
    group_->Abort(status);
    return status;
  }

  std::shared_ptr<InProcessCommGroup> group_;
  const int rank_;
};

absl::StatusOr<std::shared_ptr<InProcessCommGroup>> InProcessCommGroup::Create(
    int world_size, absl::Duration timeout) {
  if (world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("InProcessCommGroup: world_size must be >= 1, got ", world_size));
  }
  if (timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("InProcessCommGroup: timeout must be positive");
  }
  return std::shared_ptr<InProcessCommGroup>(new InProcessCommGroup(world_size, timeout));
}

std::unique_ptr<Communicator> InProcessCommGroup::MakeCommunicator(int rank) {
  return std::make_unique<InProcessCommunicator>(shared_from_this(), rank);
}

void InProcessCommGroup::Abort(const absl::Status& cause) {
  std::lock_guard<std::mutex> lock(mu_);
  if (failure_.ok()) {
    failure_ = cause.ok() ? absl::AbortedError("aborted without a cause") : cause;
  }
  cv_.notify_all();
}

absl::Status InProcessCommGroup::status() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failure_;
}

void InProcessCommGroup::Reset() {
  std::lock_guard<std::mutex> lock(mu_);
  failure_ = absl::OkStatus();
  arrived_ = 0;
  readers_ = 0;
  ++generation_;
  for (uint64_t& s : next_seq_) s = 0;
  for (Slot& s : slots_) s = Slot();
}

void InProcessCommGroup::DoneReading() {
  std::unique_lock<std::mutex> lock(mu_);
  if (--readers_ == 0) cv_.notify_all();
  cv_.wait(lock, [this] { return readers_ <= 0; });
}

absl::Status InProcessCommGroup::Arrive(int rank, absl::string_view what, bool opens_reads) {
  auto failed = [&]() -> absl::Status {
    if (failure_.code() == absl::StatusCode::kDeadlineExceeded) return failure_;
    return absl::AbortedError(absl::StrCat(
        "rank ", rank, ": ", what, " aborted because the group failed: ", failure_.ToString()));
  };
  std::unique_lock<std::mutex> lock(mu_);
  if (!failure_.ok()) return failed();
  const uint64_t gen = generation_;
  if (++arrived_ == world_size_) {
    arrived_ = 0;
    if (opens_reads) readers_ = world_size_;
    ++generation_;
    cv_.notify_all();
    return absl::OkStatus();
  }
  const auto deadline = std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(timeout_);
  while (generation_ == gen && failure_.ok()) {
    if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && generation_ == gen &&
        failure_.ok()) {
      failure_ = absl::DeadlineExceededError(
          absl::StrCat("rank ", rank, ": ", what, ": only ", arrived_, " of ", world_size_,
                       " ranks arrived within ", absl::FormatDuration(timeout_)));
      cv_.notify_all();
      return failure_;
    }
  }
  if (generation_ != gen) return absl::OkStatus();
  return failed();
}

}  // namespace moeserve
