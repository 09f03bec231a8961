// The forward channel's server side (server/forward_channel.h) against the layout in
// proto/moeserve/v1/forward_channel.h, driven by a raw client written here from the layout (not
// by the C++ client library): header checks, answers and errors in the right slot with the
// right sequence, requests that do not fit, answers that do not fit, calls in flight across
// slots, the futex path (no spinning), unregistering while a call runs, and detaching.
#include "server/forward_channel.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "moeserve/v1/forward_channel.h"
#include "tests/testing/shm_util.h"

namespace moeserve {
namespace {

namespace ch = v1channel;
using ::moeserve::testing::ShmObject;
using ::testing::HasSubstr;

std::atomic<uint32_t>* Word(std::byte* p) { return reinterpret_cast<std::atomic<uint32_t>*>(p); }

// A client of the raw layout over one shm object.
class RawChannel {
 public:
  RawChannel(int num_slots, uint64_t slot_bytes)
      : slot_bytes_(slot_bytes), shm_(ch::ForwardChannelBytes(num_slots, slot_bytes)) {
    if (!shm_.ok()) return;
    Put<uint32_t>(ch::kMagicOffset, ch::kForwardChannelMagic);
    Put<uint32_t>(ch::kVersionOffset, ch::kForwardChannelVersion);
    Put<uint32_t>(ch::kNumSlotsOffset, static_cast<uint32_t>(num_slots));
    Put<uint64_t>(ch::kSlotBytesOffset, slot_bytes);
  }
  bool ok() const { return shm_.ok(); }
  const std::string& key() const { return shm_.key(); }
  int64_t bytes() const { return static_cast<int64_t>(shm_.size()); }
  template <typename T>
  void Put(uint64_t offset, T v) {
    std::memcpy(shm_.data() + offset, &v, sizeof(v));
  }
  template <typename T>
  T Get(uint64_t offset) const {
    T v;
    std::memcpy(&v, shm_.data() + offset, sizeof(v));
    return v;
  }
  uint64_t slot(int i) const { return ch::kForwardChannelSlotsOffset + i * slot_bytes_; }
  uint32_t state(int i) const { return Word(shm_.data() + slot(i))->load(); }
  bool attached() const { return Word(shm_.data() + ch::kServerAttachedOffset)->load() == 1; }

  // Publishes `request` in slot i as the protocol says (declared size may differ: `declared`).
  void Submit(int i, const std::string& request, uint64_t sequence, int64_t declared = -1) {
    std::memcpy(shm_.data() + slot(i) + ch::kForwardChannelSlotHeaderBytes, request.data(),
                std::min<uint64_t>(request.size(), slot_bytes_ - 64));
    Put<uint32_t>(slot(i) + ch::kSlotRequestBytesOffset,
                  static_cast<uint32_t>(declared >= 0 ? declared : request.size()));
    Put<uint64_t>(slot(i) + ch::kSlotSequenceOffset, sequence);
    Put<uint64_t>(slot(i) + ch::kSlotTimeoutUsOffset, 0);
    Word(shm_.data() + slot(i))->store(ch::kSlotRequest, std::memory_order_release);
    std::atomic<uint32_t>* bell = Word(shm_.data() + ch::kDoorbellOffset);
    bell->fetch_add(1);
    if (Word(shm_.data() + ch::kServerSleepingOffset)->load() != 0) {
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(bell), FUTEX_WAKE, INT_MAX, nullptr, nullptr,
              0);
    }
  }

  struct Answer {
    bool arrived = false;
    int32_t code = -1;
    std::string payload;
    uint64_t sequence = 0;
  };
  // Waits (sleeping on the slot's futex, as a client that stopped polling) up to `timeout`.
  Answer Wait(int i, std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
    Answer a;
    std::atomic<uint32_t>* st = Word(shm_.data() + slot(i));
    std::atomic<uint32_t>* waiting = Word(shm_.data() + slot(i) + ch::kSlotClientWaitingOffset);
    const auto give_up = std::chrono::steady_clock::now() + timeout;
    waiting->store(1);
    uint32_t s;
    while ((s = st->load()) != ch::kSlotAnswer && std::chrono::steady_clock::now() < give_up) {
      struct timespec ts {
        0, 2000000
      };
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(st), FUTEX_WAIT, s, &ts, nullptr, 0);
    }
    waiting->store(0);
    if (st->load() != ch::kSlotAnswer) return a;
    a.arrived = true;
    a.code = Get<int32_t>(slot(i) + ch::kSlotStatusCodeOffset);
    const uint32_t n = Get<uint32_t>(slot(i) + ch::kSlotAnswerBytesOffset);
    EXPECT_LE(n, slot_bytes_ - 64);
    a.payload.assign(reinterpret_cast<const char*>(shm_.data() + slot(i) + 64),
                     std::min<uint64_t>(n, slot_bytes_ - 64));
    a.sequence = Get<uint64_t>(slot(i) + ch::kSlotAnswerSequenceOffset);
    return a;
  }

 private:
  uint64_t slot_bytes_;
  ShmObject shm_;
};

std::string Flatten(const grpc::ByteBuffer& b) {
  std::vector<grpc::Slice> slices;
  std::string out;
  if (!b.Dump(&slices).ok()) return out;
  for (const grpc::Slice& s : slices)
    out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

grpc::ByteBuffer Buffer(const std::string& s) {
  grpc::Slice slice(s);
  return grpc::ByteBuffer(&slice, 1);
}

// The fake call: answers "echo:<request>" at once; "fail..." with INVALID_ARGUMENT; "big:N" with
// N bytes; "hold..." only when Release() is called (from another thread).
class FakeCalls {
 public:
  ChannelCallFn Fn() {
    return [this](grpc::ByteBuffer request, absl::Time, int64_t max_answer_bytes,
                  ChannelAnswerFn answer) {
      max_answer_bytes_ = max_answer_bytes;
      const std::string r = Flatten(request);
      ++calls_;
      if (r.rfind("fail", 0) == 0) {
        answer(absl::InvalidArgumentError("refused: " + r), {});
      } else if (r.rfind("big:", 0) == 0) {
        answer(absl::OkStatus(), Buffer(std::string(std::stoul(r.substr(4)), 'x')));
      } else if (r.rfind("hold", 0) == 0) {
        std::lock_guard<std::mutex> lock(mu_);
        held_.emplace_back(r, std::move(answer));
      } else {
        answer(absl::OkStatus(), Buffer("echo:" + r));
      }
    };
  }
  // Answers the held calls in reverse order (out of order across slots).
  void Release() {
    std::vector<std::pair<std::string, ChannelAnswerFn>> held;
    {
      std::lock_guard<std::mutex> lock(mu_);
      held.swap(held_);
    }
    std::reverse(held.begin(), held.end());
    for (auto& [r, answer] : held) answer(absl::OkStatus(), Buffer("done:" + r));
  }
  size_t held() {
    std::lock_guard<std::mutex> lock(mu_);
    return held_.size();
  }
  std::atomic<int> calls_{0};
  std::atomic<int64_t> max_answer_bytes_{0};

 private:
  std::mutex mu_;
  std::vector<std::pair<std::string, ChannelAnswerFn>> held_;
};

bool WaitFor(const std::function<bool()>& cond) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!cond()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

TEST(ForwardChannelTest, RefusesBadHeadersAndKeys) {
  ForwardChannelRegistry registry(4, absl::ZeroDuration());
  FakeCalls fake;
  auto expect = [&](RawChannel& raw, absl::StatusCode code, const std::string& part,
                    int64_t bytes = -1) {
    auto got = registry.Register("c", raw.key(), bytes >= 0 ? bytes : raw.bytes(), fake.Fn());
    EXPECT_EQ(got.status().code(), code) << got.status();
    EXPECT_THAT(std::string(got.status().message()), HasSubstr(part));
  };
  {
    RawChannel raw(2, 4096);
    ASSERT_TRUE(raw.ok());
    raw.Put<uint32_t>(ch::kMagicOffset, 0x12345678);
    expect(raw, absl::StatusCode::kInvalidArgument, "magic");
  }
  {
    RawChannel raw(2, 4096);
    raw.Put<uint32_t>(ch::kVersionOffset, 99);
    expect(raw, absl::StatusCode::kInvalidArgument, "version 99");
  }
  {
    RawChannel raw(2, 4096);
    raw.Put<uint32_t>(ch::kNumSlotsOffset, 0);
    expect(raw, absl::StatusCode::kInvalidArgument, "num_slots 0");
  }
  {
    RawChannel raw(2, 4096);
    raw.Put<uint64_t>(ch::kSlotBytesOffset, 4000);
    expect(raw, absl::StatusCode::kInvalidArgument, "slot_bytes 4000");
  }
  {
    // Geometry beyond the registered bytes: slots that would lie outside the mapping.
    RawChannel raw(2, 4096);
    raw.Put<uint32_t>(ch::kNumSlotsOffset, 200);
    expect(raw, absl::StatusCode::kInvalidArgument, "200 slots of 4096 bytes need");
    RawChannel small(2, 4096);
    expect(small, absl::StatusCode::kInvalidArgument, "exceeds", small.bytes() + 1);
    expect(small, absl::StatusCode::kInvalidArgument, "byte_size: got 100", 100);
  }
  auto missing = registry.Register("c", "/moeserve_no_such_channel", 1 << 20, fake.Fn());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound) << missing.status();
  auto bad_key = registry.Register("c", "no-slash", 1 << 20, fake.Fn());
  EXPECT_EQ(bad_key.status().code(), absl::StatusCode::kInvalidArgument) << bad_key.status();
  RawChannel raw(1, 1024);
  auto no_name = registry.Register("", raw.key(), raw.bytes(), fake.Fn());
  EXPECT_EQ(no_name.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.size(), 0);
  EXPECT_EQ(fake.calls_.load(), 0);
}

TEST(ForwardChannelTest, AnswersEachSlotWithItsSequence) {
  for (absl::Duration spin : {absl::Milliseconds(50), absl::ZeroDuration()}) {
    ForwardChannelRegistry registry(4, spin);
    FakeCalls fake;
    RawChannel raw(3, 2048);
    ASSERT_TRUE(raw.ok());
    EXPECT_FALSE(raw.attached());
    auto channel = registry.Register("c", raw.key(), raw.bytes(), fake.Fn());
    ASSERT_TRUE(channel.ok()) << channel.status();
    EXPECT_TRUE(raw.attached());
    EXPECT_EQ((*channel)->num_slots(), 3);
    EXPECT_EQ((*channel)->payload_bytes(), 2048 - 64);
    std::mt19937_64 rng(std::random_device{}());
    for (int round = 0; round < 20; ++round) {
      const int i = static_cast<int>(rng() % 3);
      const uint64_t seq = rng();
      const std::string req = "r" + std::to_string(rng());
      raw.Submit(i, req, seq);
      const RawChannel::Answer a = raw.Wait(i);
      ASSERT_TRUE(a.arrived) << "spin " << spin << " round " << round;
      EXPECT_EQ(a.code, 0);
      EXPECT_EQ(a.payload, "echo:" + req);
      EXPECT_EQ(a.sequence, seq);
      // A client sleeping between calls: the poller has parked (spin 0) and must be woken.
      if (spin == absl::ZeroDuration()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    EXPECT_EQ(fake.max_answer_bytes_.load(), 2048 - 64);
    // An error comes back as its code and message.
    raw.Submit(1, "fail-this", 7);
    const RawChannel::Answer e = raw.Wait(1);
    ASSERT_TRUE(e.arrived);
    EXPECT_EQ(e.code, static_cast<int32_t>(absl::StatusCode::kInvalidArgument));
    EXPECT_EQ(e.payload, "refused: fail-this");
    EXPECT_EQ(e.sequence, 7u);
    if (spin == absl::ZeroDuration()) {
      EXPECT_GT((*channel)->stats().sleeps, 0);
    }
    EXPECT_EQ((*channel)->stats().calls, 21);
    EXPECT_EQ((*channel)->stats().refused, 1);
  }
}

TEST(ForwardChannelTest, RefusesWhatDoesNotFitItsSlot) {
  ForwardChannelRegistry registry(4, absl::Milliseconds(10));
  FakeCalls fake;
  RawChannel raw(2, 1024);
  ASSERT_TRUE(raw.ok());
  ASSERT_TRUE(registry.Register("c", raw.key(), raw.bytes(), fake.Fn()).ok());
  // A declared request size beyond the payload: refused without calling, nothing read past it.
  raw.Submit(0, "echo", 1, /*declared=*/1024 - 64 + 1);
  RawChannel::Answer a = raw.Wait(0);
  ASSERT_TRUE(a.arrived);
  EXPECT_EQ(a.code, static_cast<int32_t>(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(a.payload, HasSubstr("request_bytes 961 exceeds the slot's payload of 960"));
  EXPECT_EQ(fake.calls_.load(), 0);
  raw.Submit(0, "echo", 2, /*declared=*/0xffffffffu);
  a = raw.Wait(0);
  EXPECT_EQ(a.code, static_cast<int32_t>(absl::StatusCode::kInvalidArgument));
  // An answer one byte too large is RESOURCE_EXHAUSTED; one that just fits arrives whole.
  raw.Submit(1, "big:961", 3);
  a = raw.Wait(1);
  EXPECT_EQ(a.code, static_cast<int32_t>(absl::StatusCode::kResourceExhausted));
  EXPECT_THAT(a.payload, HasSubstr("the answer is 961 bytes"));
  raw.Submit(1, "big:960", 4);
  a = raw.Wait(1);
  EXPECT_EQ(a.code, 0);
  EXPECT_EQ(a.payload, std::string(960, 'x'));
  // The poller ignores states it does not own.
  raw.Put<uint32_t>(raw.slot(0), 77);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(raw.state(0), 77u);
}

TEST(ForwardChannelTest, CallsInFlightKeepTheChannelRegistered) {
  ForwardChannelRegistry registry(4, absl::Milliseconds(10));
  FakeCalls fake;
  RawChannel raw(4, 1024);
  ASSERT_TRUE(raw.ok());
  auto channel = registry.Register("c", raw.key(), raw.bytes(), fake.Fn());
  ASSERT_TRUE(channel.ok());
  for (int i = 0; i < 4; ++i) raw.Submit(i, "hold" + std::to_string(i), 100 + i);
  ASSERT_TRUE(WaitFor([&] { return fake.held() == 4; }));
  for (int i = 0; i < 4; ++i) EXPECT_EQ(raw.state(i), ch::kSlotTaken);
  EXPECT_EQ((*channel)->stats().in_flight, 4);
  absl::Status busy = registry.Unregister("c");
  EXPECT_EQ(busy.code(), absl::StatusCode::kFailedPrecondition) << busy;
  EXPECT_THAT(std::string(busy.message()), HasSubstr("4 call(s) in flight"));
  EXPECT_EQ(registry.Unregister("").code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(registry.size(), 1);
  EXPECT_TRUE(raw.attached());
  fake.Release();  // answered out of order
  for (int i = 0; i < 4; ++i) {
    const RawChannel::Answer a = raw.Wait(i);
    ASSERT_TRUE(a.arrived);
    EXPECT_EQ(a.payload, "done:hold" + std::to_string(i));
    EXPECT_EQ(a.sequence, static_cast<uint64_t>(100 + i));
  }
  // An answer the client can see is a call over: unregistering right away succeeds.
  EXPECT_EQ((*channel)->stats().in_flight, 0);
  EXPECT_TRUE(registry.Unregister("c").ok());
  EXPECT_FALSE(raw.attached());
  EXPECT_EQ(registry.Unregister("c").code(), absl::StatusCode::kNotFound);
  // Detached: a request now stays unanswered (the client sees server_attached == 0).
  raw.Submit(0, "late", 1);
  EXPECT_FALSE(raw.Wait(0, std::chrono::milliseconds(50)).arrived);
}

TEST(ForwardChannelTest, RegistryLimitsNamesAndCount) {
  ForwardChannelRegistry registry(2, absl::Milliseconds(1));
  FakeCalls fake;
  RawChannel a(1, 1024), b(1, 1024), c(1, 1024);
  ASSERT_TRUE(registry.Register("a", a.key(), a.bytes(), fake.Fn()).ok());
  EXPECT_EQ(registry.Register("a", b.key(), b.bytes(), fake.Fn()).status().code(),
            absl::StatusCode::kAlreadyExists);
  ASSERT_TRUE(registry.Register("b", b.key(), b.bytes(), fake.Fn()).ok());
  auto third = registry.Register("c", c.key(), c.bytes(), fake.Fn());
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(third.status().message()), HasSubstr("--max_forward_channels"));
  EXPECT_TRUE(registry.Unregister("").ok());
  EXPECT_EQ(registry.size(), 0);
  EXPECT_FALSE(a.attached());
  EXPECT_FALSE(b.attached());
}

}  // namespace
}  // namespace moeserve
