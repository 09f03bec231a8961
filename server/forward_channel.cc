#include "server/forward_channel.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/thread_name.h"
#include "moeserve/v1/forward_channel.h"
#include "moeserve/v1/forward_wire.h"
#include "server/buffer_pool.h"
#include "server/convert.h"

namespace moeserve {

namespace ch = v1channel;
using ch::CpuRelax;
using ch::FutexWake;

namespace {

using Clock = std::chrono::steady_clock;

uint32_t LoadU32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
uint64_t LoadU64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
void StoreU32(uint8_t* p, uint32_t v) { std::memcpy(p, &v, sizeof(v)); }
void StoreU64(uint8_t* p, uint64_t v) { std::memcpy(p, &v, sizeof(v)); }

// How long the poller parks on the doorbell before it looks again (a missed wake costs this).
constexpr absl::Duration kParkTimeout = absl::Milliseconds(5);

}  // namespace

absl::StatusOr<std::shared_ptr<ForwardChannel>> ForwardChannel::Open(const std::string& name,
                                                                     const std::string& key,
                                                                     int64_t byte_size) {
  if (name.empty() || name.size() > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("name: got '", name, "', expected 1 to 256 characters"));
  }
  const int64_t min_bytes =
      static_cast<int64_t>(ch::ForwardChannelBytes(1, ch::kForwardChannelMinSlotBytes));
  if (byte_size < min_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("byte_size: got ", byte_size, ", expected at least ", min_bytes,
                     " (the header and one slot of ", ch::kForwardChannelMinSlotBytes, " bytes)"));
  }
  absl::StatusOr<std::unique_ptr<MemoryRegion>> region =
      OpenSystemSharedMemory(key, 0, byte_size, /*pinner=*/nullptr);
  if (!region.ok()) return region.status();
  if (!(*region)->writable()) {
    return absl::PermissionDeniedError(
        absl::StrCat("key: the server may not write shared-memory object ", key,
                     "; a forward channel is answered in place"));
  }
  auto channel = std::shared_ptr<ForwardChannel>(new ForwardChannel());
  channel->name_ = name;
  channel->key_ = key;
  channel->base_ = static_cast<uint8_t*>((*region)->mapped_data());
  channel->region_ = std::move(*region);
  const uint8_t* h = channel->base_;
  const uint32_t magic = LoadU32(h + ch::kMagicOffset);
  const uint32_t version = LoadU32(h + ch::kVersionOffset);
  const uint32_t num_slots = LoadU32(h + ch::kNumSlotsOffset);
  const uint64_t slot_bytes = LoadU64(h + ch::kSlotBytesOffset);
  if (magic != ch::kForwardChannelMagic) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header: magic is 0x", absl::Hex(magic), ", expected 0x",
        absl::Hex(ch::kForwardChannelMagic), " (write the header before registering)"));
  }
  if (version != ch::kForwardChannelVersion) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header: version ", version, ", this server speaks version ", ch::kForwardChannelVersion));
  }
  if (num_slots < 1 || num_slots > ch::kForwardChannelMaxSlots) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header: num_slots ", num_slots, ", expected 1 to ", ch::kForwardChannelMaxSlots));
  }
  if (slot_bytes % 64 != 0 || slot_bytes < ch::kForwardChannelMinSlotBytes ||
      slot_bytes > ch::kForwardChannelMaxSlotBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("header: slot_bytes ", slot_bytes, ", expected a multiple of 64 in [",
                     ch::kForwardChannelMinSlotBytes, ", ", ch::kForwardChannelMaxSlotBytes, "]"));
  }
  const uint64_t need = ch::ForwardChannelBytes(num_slots, slot_bytes);
  if (need > static_cast<uint64_t>(byte_size)) {
    return absl::InvalidArgumentError(absl::StrCat("header: ", num_slots, " slots of ", slot_bytes,
                                                   " bytes need ", need,
                                                   " bytes, but byte_size is ", byte_size));
  }
  channel->num_slots_ = static_cast<int>(num_slots);
  channel->slot_bytes_ = static_cast<int64_t>(slot_bytes);
  return channel;
}

ForwardChannel::~ForwardChannel() {
  if (started_ && !closed_) Close(/*force=*/true).IgnoreError();
}

uint8_t* ForwardChannel::slot(int i) const {
  return base_ + ch::kForwardChannelSlotsOffset + static_cast<uint64_t>(i) * slot_bytes_;
}

std::atomic<uint32_t>* ForwardChannel::word(uint64_t offset) const {
  return ch::ChannelWord(base_ + offset);
}

int64_t ForwardChannel::payload_bytes() const {
  return slot_bytes_ - static_cast<int64_t>(ch::kForwardChannelSlotHeaderBytes);
}

ForwardChannelStats ForwardChannel::stats() const {
  ForwardChannelStats s;
  s.calls = calls_.load();
  s.refused = refused_.load();
  s.sleeps = sleeps_.load();
  std::lock_guard<std::mutex> lock(mu_);
  s.in_flight = in_flight_;
  return s;
}

void ForwardChannel::Start(ChannelCallFn call, absl::Duration spin) {
  call_ = std::move(call);
  spin_ = spin;
  started_ = true;
  word(ch::kServerSleepingOffset)->store(0);
  word(ch::kServerAttachedOffset)->store(1);
  poller_ = std::thread([this] {
    SetCurrentThreadName("ms-channel");
    Poll();
  });
}

absl::Status ForwardChannel::Close(bool force) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!force && in_flight_ > 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("forward channel '", name_, "' has ", in_flight_,
                       " call(s) in flight; unregister it once they are answered"));
    }
    closing_ = true;
    closed_ = true;
  }
  stop_.store(true);
  std::atomic<uint32_t>* bell = word(ch::kDoorbellOffset);
  bell->fetch_add(1);
  FutexWake(bell);
  if (poller_.joinable()) {
    if (poller_.get_id() == std::this_thread::get_id()) {
      poller_.detach();  // cannot happen through the registry; never join oneself
    } else {
      poller_.join();
    }
  }
  word(ch::kServerAttachedOffset)->store(0);
  // A client waiting on a slot sees the detach at its next timeout; wake them now.
  for (int i = 0; i < num_slots_; ++i) FutexWake(ch::ChannelWord(slot(i) + ch::kSlotStateOffset));
  return absl::OkStatus();
}

bool ForwardChannel::AnyRequest() const {
  for (int i = 0; i < num_slots_; ++i) {
    if (ch::ChannelWord(slot(i))->load(std::memory_order_acquire) == ch::kSlotRequest) return true;
  }
  return false;
}

void ForwardChannel::Poll() {
  std::atomic<uint32_t>* bell = word(ch::kDoorbellOffset);
  std::atomic<uint32_t>* sleeping = word(ch::kServerSleepingOffset);
  const auto spin = absl::ToChronoNanoseconds(spin_);
  Clock::time_point last = Clock::now();
  while (!stop_.load(std::memory_order_relaxed)) {
    bool took = false;
    for (int i = 0; i < num_slots_; ++i) {
      std::atomic<uint32_t>* state = ch::ChannelWord(slot(i));
      if (state->load(std::memory_order_acquire) != ch::kSlotRequest) continue;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (closing_) return;
        uint32_t expected = ch::kSlotRequest;
        if (!state->compare_exchange_strong(expected, ch::kSlotTaken, std::memory_order_acq_rel)) {
          continue;
        }
        ++in_flight_;
      }
      calls_.fetch_add(1, std::memory_order_relaxed);
      Take(i);
      took = true;
    }
    if (took) {
      last = Clock::now();
      continue;
    }
    if (Clock::now() - last < spin) {
      CpuRelax();
      continue;
    }
    // Park. Announce it first, then look once more: a client that published before it could see
    // the announcement did not ring (the doorbell's atomic add orders its side).
    const uint32_t rung = bell->load();
    sleeping->store(1);
    if (!AnyRequest() && !stop_.load()) {
      sleeps_.fetch_add(1, std::memory_order_relaxed);
      ch::FutexWait(bell, rung, absl::ToInt64Nanoseconds(kParkTimeout));
    }
    sleeping->store(0);
    last = Clock::now();
  }
}

void ForwardChannel::Take(int i) {
  uint8_t* s = slot(i);
  const uint32_t request_bytes = LoadU32(s + ch::kSlotRequestBytesOffset);
  const uint64_t timeout_us = LoadU64(s + ch::kSlotTimeoutUsOffset);
  const uint64_t sequence = LoadU64(s + ch::kSlotSequenceOffset);
  if (static_cast<int64_t>(request_bytes) > payload_bytes()) {
    Answer(i, sequence,
           absl::InvalidArgumentError(absl::StrCat(
               "forward channel '", name_, "' slot ", i, ": request_bytes ", request_bytes,
               " exceeds the slot's payload of ", payload_bytes(), " bytes")),
           grpc::ByteBuffer());
    return;
  }
  // Copied out before parsing (the client cannot change the bytes under the decoder), into a
  // recycled buffer, on a few threads when large.
  grpc::Slice bytes;
  if (request_bytes > 0) {
    std::unique_ptr<PooledBuffer> copy = PooledBuffer::Acquire(request_bytes);
    auto* dst = static_cast<uint8_t*>(copy->data());
    GatherPieces({absl::Span<const uint8_t>(s + ch::kForwardChannelSlotHeaderBytes, request_bytes)},
                 request_bytes, dst);
    bytes = v1wire::SliceOwning(dst, request_bytes, std::move(copy));
  }
  grpc::ByteBuffer request(&bytes, 1);
  // Timeouts beyond a day are treated as none (and cannot overflow absl::Time).
  const absl::Time deadline =
      timeout_us == 0 || timeout_us > uint64_t{86400} * 1000000
          ? absl::InfiniteFuture()
          : absl::Now() + absl::Microseconds(static_cast<int64_t>(timeout_us));
  std::shared_ptr<ForwardChannel> self = shared_from_this();
  // (A grpc::ByteBuffer copy shares its slices: passing it costs no bytes.)
  call_(request, deadline, payload_bytes(),
        [self, i, sequence](const absl::Status& status, const grpc::ByteBuffer& answer) {
          self->Answer(i, sequence, status, answer);
        });
}

void ForwardChannel::Answer(int i, uint64_t sequence, absl::Status status,
                            const grpc::ByteBuffer& answer) {
  uint8_t* s = slot(i);
  uint8_t* payload = s + ch::kForwardChannelSlotHeaderBytes;
  size_t written = 0;
  if (status.ok()) {
    const size_t n = answer.Length();
    if (static_cast<int64_t>(n) > payload_bytes()) {
      status = absl::ResourceExhaustedError(absl::StrCat(
          "the answer is ", n, " bytes, more than forward channel '", name_, "' slot holds (",
          payload_bytes(), "); name an output_region or register larger slots"));
    } else {
      std::vector<grpc::Slice> slices;
      if (answer.Dump(&slices).ok()) {
        std::vector<absl::Span<const uint8_t>> pieces;
        pieces.reserve(slices.size());
        for (const grpc::Slice& piece : slices) pieces.emplace_back(piece.begin(), piece.size());
        GatherPieces(pieces, n, payload);
        written = n;
      } else {
        status = absl::InternalError("could not read the encoded answer");
      }
    }
  }
  if (!status.ok()) {
    refused_.fetch_add(1, std::memory_order_relaxed);
    const absl::string_view message = status.message();
    written = std::min(message.size(), static_cast<size_t>(payload_bytes()));
    std::memcpy(payload, message.data(), written);
  }
  StoreU32(s + ch::kSlotAnswerBytesOffset, static_cast<uint32_t>(written));
  StoreU32(s + ch::kSlotStatusCodeOffset, static_cast<uint32_t>(status.code()));
  StoreU64(s + ch::kSlotAnswerSequenceOffset, sequence);
  std::atomic<uint32_t>* state = ch::ChannelWord(s + ch::kSlotStateOffset);
  // Under mu_ with the in-flight count: a client that sees the answer and unregisters at once
  // must find the call over (Close checks in_flight_ under mu_), and after Close returns this
  // never touches the mapping again.
  std::lock_guard<std::mutex> lock(mu_);
  state->store(ch::kSlotAnswer);  // sequentially consistent: ordered before the load below
  if (ch::ChannelWord(s + ch::kSlotClientWaitingOffset)->load() != 0) FutexWake(state);
  --in_flight_;
}

ForwardChannelRegistry::ForwardChannelRegistry(int max_channels, absl::Duration spin)
    : max_channels_(std::max(1, max_channels)), spin_(spin) {}

ForwardChannelRegistry::~ForwardChannelRegistry() { CloseAll(); }

void ForwardChannelRegistry::CloseAll() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [name, channel] : channels_) channel->Close(/*force=*/true).IgnoreError();
  channels_.clear();
}

absl::StatusOr<std::shared_ptr<ForwardChannel>> ForwardChannelRegistry::Register(
    const std::string& name, const std::string& key, int64_t byte_size, ChannelCallFn call) {
  std::lock_guard<std::mutex> lock(mu_);
  if (channels_.count(name) != 0) {
    return absl::AlreadyExistsError(
        absl::StrCat("a forward channel named '", name, "' is registered already"));
  }
  if (static_cast<int>(channels_.size()) >= max_channels_) {
    return absl::ResourceExhaustedError(
        absl::StrCat(max_channels_, " forward channels are registered, the most this server ",
                     "serves (--max_forward_channels); unregister one first"));
  }
  absl::StatusOr<std::shared_ptr<ForwardChannel>> channel =
      ForwardChannel::Open(name, key, byte_size);
  if (!channel.ok()) return channel.status();
  (*channel)->Start(std::move(call), spin_);
  channels_[name] = *channel;
  return *channel;
}

absl::Status ForwardChannelRegistry::Unregister(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!name.empty()) {
    auto it = channels_.find(name);
    if (it == channels_.end()) {
      return absl::NotFoundError(absl::StrCat("no forward channel named '", name, "'"));
    }
    absl::Status s = it->second->Close();
    if (!s.ok()) return s;
    channels_.erase(it);
    return absl::OkStatus();
  }
  std::vector<std::string> busy;
  for (auto it = channels_.begin(); it != channels_.end();) {
    if (it->second->Close().ok()) {
      it = channels_.erase(it);
    } else {
      busy.push_back(it->first);
      ++it;
    }
  }
  if (!busy.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("forward channel(s) ", absl::StrJoin(busy, ", "),
                     " have calls in flight and stay registered; the others were unregistered"));
  }
  return absl::OkStatus();
}

int ForwardChannelRegistry::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(channels_.size());
}

}  // namespace moeserve
