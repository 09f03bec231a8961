#include "clients/cpp/forward_channel_client.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "moeserve/v1/forward_channel.h"

namespace moeserve::client {

namespace ch = v1channel;
using ch::CpuRelax;
using ch::FutexWait;
using ch::FutexWake;

namespace {

using Clock = std::chrono::steady_clock;

std::atomic<uint32_t>* Word(uint8_t* p) { return ch::ChannelWord(p); }

template <typename T>
T Load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
template <typename T>
void Store(uint8_t* p, T v) {
  std::memcpy(p, &v, sizeof(v));
}

std::atomic<int> channel_counter{0};

}  // namespace

absl::StatusOr<std::unique_ptr<ForwardChannelClient>> ForwardChannelClient::Create(
    MoeClient* client, const ForwardChannelOptions& options) {
  if (client == nullptr) return absl::InvalidArgumentError("ForwardChannelClient: no MoeClient");
  if (options.num_slots < 1 || options.num_slots > static_cast<int>(ch::kForwardChannelMaxSlots) ||
      options.slot_bytes % 64 != 0 ||
      options.slot_bytes < static_cast<int64_t>(ch::kForwardChannelMinSlotBytes) ||
      options.slot_bytes > static_cast<int64_t>(ch::kForwardChannelMaxSlotBytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("ForwardChannelClient: num_slots ", options.num_slots, " (expected 1 to ",
                     ch::kForwardChannelMaxSlots, ") and slot_bytes ", options.slot_bytes,
                     " (expected a multiple of 64 in [", ch::kForwardChannelMinSlotBytes, ", ",
                     ch::kForwardChannelMaxSlotBytes, "])"));
  }
  auto channel = std::unique_ptr<ForwardChannelClient>(new ForwardChannelClient());
  channel->client_ = client;
  channel->name_ = options.name.empty()
                       ? absl::StrCat("moeserve-ch-", getpid(), "-", channel_counter.fetch_add(1))
                       : options.name;
  channel->key_ = "/" + channel->name_;
  channel->num_slots_ = options.num_slots;
  channel->slot_bytes_ = options.slot_bytes;
  channel->spin_ = options.spin;
  channel->map_bytes_ = ch::ForwardChannelBytes(options.num_slots, options.slot_bytes);
  const int fd = shm_open(channel->key_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    return absl::FailedPreconditionError(absl::StrCat("ForwardChannelClient: shm_open(",
                                                      channel->key_, "): ", std::strerror(errno)));
  }
  void* map = MAP_FAILED;
  if (ftruncate(fd, static_cast<off_t>(channel->map_bytes_)) == 0) {
    map = mmap(nullptr, channel->map_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  const int err = errno;
  close(fd);
  if (map == MAP_FAILED) {
    shm_unlink(channel->key_.c_str());
    return absl::ResourceExhaustedError(absl::StrCat("ForwardChannelClient: ", channel->map_bytes_,
                                                     " bytes for ", channel->key_, ": ",
                                                     std::strerror(err)));
  }
  channel->base_ = static_cast<uint8_t*>(map);
  uint8_t* h = channel->base_;
  Store<uint32_t>(h + ch::kMagicOffset, ch::kForwardChannelMagic);
  Store<uint32_t>(h + ch::kVersionOffset, ch::kForwardChannelVersion);
  Store<uint32_t>(h + ch::kNumSlotsOffset, static_cast<uint32_t>(options.num_slots));
  Store<uint64_t>(h + ch::kSlotBytesOffset, static_cast<uint64_t>(options.slot_bytes));
  for (int i = options.num_slots - 1; i >= 0; --i) channel->free_.push_back(i);
  channel->abandoned_.assign(options.num_slots, false);
  absl::StatusOr<v1::RegisterForwardChannelResponse> registered = client->RegisterForwardChannel(
      channel->name_, channel->key_, static_cast<int64_t>(channel->map_bytes_));
  if (!registered.ok()) return registered.status();  // the destructor unmaps and unlinks
  channel->registered_ = true;
  return channel;
}

ForwardChannelClient::~ForwardChannelClient() {
  // Where the server refused to let go (a call of ours it still runs) or could not be reached,
  // our mapping and the name go anyway (the server's own mapping keeps the memory).
  if (!Close().ok()) Unmap();
}

void ForwardChannelClient::Unmap() {
  if (base_ == nullptr) return;
  munmap(base_, map_bytes_);
  base_ = nullptr;
  shm_unlink(key_.c_str());
}

absl::Status ForwardChannelClient::Close() {
  if (registered_) {
    absl::Status s = client_->UnregisterForwardChannel(name_);
    if (!s.ok() && s.code() != absl::StatusCode::kNotFound) return s;
    registered_ = false;
  }
  Unmap();
  return absl::OkStatus();
}

uint8_t* ForwardChannelClient::slot(int i) const {
  return base_ + ch::kForwardChannelSlotsOffset + static_cast<uint64_t>(i) * slot_bytes_;
}

absl::StatusOr<int> ForwardChannelClient::AcquireSlot(Clock::time_point give_up) {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    // Slots given up on come back once the server has answered them.
    for (int i = 0; i < num_slots_; ++i) {
      if (abandoned_[i] && Word(slot(i))->load() == ch::kSlotAnswer) {
        abandoned_[i] = false;
        free_.push_back(i);
      }
    }
    if (!free_.empty()) break;
    // Every slot is in flight or given up on: a detached server answers none of them again.
    if (Word(base_ + ch::kServerAttachedOffset)->load() == 0) {
      return absl::UnavailableError(
          absl::StrCat("ForwardChannelClient: the server stopped serving channel '", name_, "'"));
    }
    if (Clock::now() > give_up) {
      return absl::DeadlineExceededError(absl::StrCat(
          "ForwardChannelClient: no free slot within the deadline on channel '", name_, "' (",
          num_slots_, " slots, each in flight or given up on and not yet answered)"));
    }
    cv_.wait_for(lock, std::chrono::milliseconds(1));
  }
  const int i = free_.back();
  free_.pop_back();
  return i;
}

void ForwardChannelClient::ReleaseSlot(int i) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(i);
  }
  cv_.notify_one();
}

absl::StatusOr<ForwardResult> ForwardChannelClient::Forward(const v1::ForwardRequest& request,
                                                            bool copy_output) {
  std::string bytes;
  if (!request.SerializeToString(&bytes)) {
    return absl::InvalidArgumentError("ForwardChannelClient: could not serialize the request");
  }
  grpc::Slice slice(bytes);
  return Forward(grpc::ByteBuffer(&slice, 1), copy_output);
}

absl::StatusOr<ForwardResult> ForwardChannelClient::Forward(const grpc::ByteBuffer& request,
                                                            bool copy_output) {
  if (base_ == nullptr || !registered_) {
    return absl::FailedPreconditionError("ForwardChannelClient: closed");
  }
  const int64_t payload = slot_bytes_ - static_cast<int64_t>(ch::kForwardChannelSlotHeaderBytes);
  const size_t n = request.Length();
  if (static_cast<int64_t>(n) > payload) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ForwardChannelClient: the request is ", n, " bytes, more than a slot's payload of ",
        payload, "; put the tensors in shared-memory regions or use larger slots"));
  }
  const Clock::time_point start = Clock::now();
  const absl::Duration deadline = client_->options().deadline;
  // An infinite deadline (the flag accepts "inf") would overflow the sum into the past.
  const Clock::time_point give_up =
      deadline >= absl::Hours(24 * 365)
          ? Clock::time_point::max()
          : start + absl::ToChronoNanoseconds(deadline) + std::chrono::seconds(1);
  absl::StatusOr<int> acquired = AcquireSlot(give_up);
  if (!acquired.ok()) return acquired.status();
  const int i = *acquired;
  uint8_t* s = slot(i);
  std::vector<grpc::Slice> slices;
  if (!request.Dump(&slices).ok()) {
    ReleaseSlot(i);
    return absl::InvalidArgumentError("ForwardChannelClient: could not read the request");
  }
  size_t at = 0;
  for (const grpc::Slice& piece : slices) {
    std::memcpy(s + ch::kForwardChannelSlotHeaderBytes + at, piece.begin(), piece.size());
    at += piece.size();
  }
  uint64_t sequence;
  {
    std::lock_guard<std::mutex> lock(mu_);
    sequence = next_sequence_++;
  }
  Store<uint32_t>(s + ch::kSlotRequestBytesOffset, static_cast<uint32_t>(n));
  Store<uint64_t>(s + ch::kSlotTimeoutUsOffset,
                  static_cast<uint64_t>(std::max<int64_t>(0, absl::ToInt64Microseconds(deadline))));
  Store<uint64_t>(s + ch::kSlotSequenceOffset, sequence);
  std::atomic<uint32_t>* state = Word(s + ch::kSlotStateOffset);
  state->store(ch::kSlotRequest, std::memory_order_release);
  std::atomic<uint32_t>* bell = Word(base_ + ch::kDoorbellOffset);
  bell->fetch_add(1);  // a full barrier: the sleeping flag is read after the request is visible
  if (Word(base_ + ch::kServerSleepingOffset)->load() != 0) FutexWake(bell);

  // Wait: poll for spin_, then sleep on the slot's state with short timeouts.
  const auto spin = absl::ToChronoNanoseconds(spin_);
  uint32_t now_state = state->load(std::memory_order_acquire);
  while (now_state != ch::kSlotAnswer && Clock::now() - start < spin) {
    CpuRelax();
    now_state = state->load(std::memory_order_acquire);
  }
  if (now_state != ch::kSlotAnswer) {
    sleeps_.fetch_add(1, std::memory_order_relaxed);
    std::atomic<uint32_t>* waiting = Word(s + ch::kSlotClientWaitingOffset);
    waiting->store(1);
    while ((now_state = state->load()) != ch::kSlotAnswer) {
      absl::Status failed;
      if (Word(base_ + ch::kServerAttachedOffset)->load() == 0) {
        failed = absl::UnavailableError(
            absl::StrCat("ForwardChannelClient: the server stopped serving channel '", name_, "'"));
      } else if (Clock::now() > give_up) {
        failed = absl::DeadlineExceededError(
            absl::StrCat("ForwardChannelClient: no answer within the deadline (",
                         absl::FormatDuration(deadline), ") on channel '", name_, "'"));
      }
      if (!failed.ok()) {
        waiting->store(0);
        std::lock_guard<std::mutex> lock(mu_);
        abandoned_[i] = true;  // the server may still write it
        return failed;
      }
      FutexWait(state, now_state, 1000000);
    }
    waiting->store(0);
  }
  const int32_t code = Load<int32_t>(s + ch::kSlotStatusCodeOffset);
  const uint32_t answer_bytes = Load<uint32_t>(s + ch::kSlotAnswerBytesOffset);
  const uint64_t answered = Load<uint64_t>(s + ch::kSlotAnswerSequenceOffset);
  absl::StatusOr<ForwardResult> result;
  if (answered != sequence || static_cast<int64_t>(answer_bytes) > payload) {
    result = absl::InternalError(absl::StrCat("ForwardChannelClient: slot ", i, " answered call ",
                                              answered, " with ", answer_bytes,
                                              " bytes; expected call ", sequence));
  } else if (code != 0) {
    result = absl::Status(
        static_cast<absl::StatusCode>(code),
        absl::string_view(reinterpret_cast<const char*>(s + ch::kForwardChannelSlotHeaderBytes),
                          answer_bytes));
  } else {
    grpc::Slice answer(s + ch::kForwardChannelSlotHeaderBytes, answer_bytes);
    result = DecodeForwardResult(grpc::ByteBuffer(&answer, 1), copy_output,
                                 absl::FromChrono(Clock::now() - start));
  }
  ReleaseSlot(i);
  return result;
}

}  // namespace moeserve::client
