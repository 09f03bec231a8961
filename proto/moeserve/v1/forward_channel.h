// The forward channel: moeserve.v1 Forward calls through POSIX shared memory instead of a
// socket, for a frontend on the server's host (issue 11: a gRPC unary call alone costs more than
// a decode step's transfers may). The messages are the wire format's own: a slot carries a
// serialized ForwardRequest in, and a serialized ForwardResponse (or an error) out. Tensors may
// be inline (small M) or, as usual, in registered shared-memory regions (RegionRef), so a call
// moves no tensor bytes through the channel at all.
//
// The frontend creates the shared-memory object, writes the header, and registers it with
// RegisterForwardChannel (gRPC, once); the server maps it and serves its slots with a polling
// thread until UnregisterForwardChannel. Everything here is the byte layout and protocol both
// sides follow; it has no dependencies so that clients in any language can mirror it (the
// Python client does, in moeserve_client/channel.py).
//
// Layout (little-endian; all offsets in bytes from the start of the object):
//
//   0     u32 magic            kForwardChannelMagic
//   4     u32 version          kForwardChannelVersion
//   8     u32 num_slots        [1, kForwardChannelMaxSlots]
//   12    u32 reserved (0)
//   16    u64 slot_bytes       a multiple of 64 in [kForwardChannelMinSlotBytes,
//                              kForwardChannelMaxSlotBytes]: slot header + payload
//   24-63 reserved (0)
//   64    u32 doorbell         client adds 1 after publishing a request (futex word)
//   128   u32 server_sleeping  1 while the server waits on the doorbell (futex), else 0
//   192   u32 server_attached  1 while the server serves the channel; 0 before and after
//   256   slot 0, then slot i at kForwardChannelSlotsOffset + i * slot_bytes
//
// A slot (header of kForwardChannelSlotHeaderBytes, then the payload):
//
//   +0    u32 state            futex word: kSlotFree, kSlotRequest, kSlotTaken, kSlotAnswer
//   +4    u32 client_waiting   1 while the client waits on `state` (futex), else 0
//   +8    u32 request_bytes    client: bytes of the serialized ForwardRequest in the payload
//   +12   u32 answer_bytes     server: bytes of the answer in the payload
//   +16   i32 status_code      server: 0 and the payload holds a serialized ForwardResponse, or
//                              a gRPC status code and the payload holds its message (UTF-8)
//   +20   u32 reserved
//   +24   u64 timeout_us       client: the call's deadline from when the server takes it; 0: none
//   +32   u64 sequence         client: any number, echoed in answer_sequence
//   +40   u64 answer_sequence  server
//   +48-63 reserved
//   +64   payload (slot_bytes - 64 bytes): the request, overwritten by the answer
//
// Protocol. A slot belongs to the client in kSlotFree and kSlotAnswer, to the server in
// kSlotRequest and kSlotTaken.
//   Client call: write the payload, request_bytes, timeout_us and sequence; store state =
//     kSlotRequest (release); add 1 to doorbell (atomic); if server_sleeping, FUTEX_WAKE the
//     doorbell. Then wait until state == kSlotAnswer: spin, or set client_waiting = 1 and
//     FUTEX_WAIT on state (with a timeout, checking server_attached). Read the answer; the slot
//     is the client's again (it may leave it in kSlotAnswer or store kSlotFree).
//   Server: takes a kSlotRequest slot by compare-and-swap to kSlotTaken and copies the request out
//     before parsing it (the client cannot change what is parsed); answers by writing the
//     payload, answer_bytes, status_code and answer_sequence, storing state = kSlotAnswer
//     (sequentially consistent) and, if client_waiting, FUTEX_WAKE on state. A request that does
//     not fit the payload, fails to parse or is refused is answered with a status code, never
//     dropped; an answer larger than the payload is RESOURCE_EXHAUSTED (name an output region).
//   The futex words are shared (not FUTEX_PRIVATE), so waits and wakes work across processes;
//   every wait has a timeout, so a missed wake costs latency, never a hang.
//   A client that gives up on a call must not reuse its slot until it reaches kSlotAnswer (the
//   server may still write it). The server never reads the header again after registration:
//   changing num_slots or slot_bytes later has no effect on it.
#ifndef MOESERVE_PROTO_MOESERVE_V1_FORWARD_CHANNEL_H_
#define MOESERVE_PROTO_MOESERVE_V1_FORWARD_CHANNEL_H_

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <climits>
#include <cstdint>
#include <ctime>

namespace moeserve::v1channel {

inline constexpr uint32_t kForwardChannelMagic = 0x4346534Du;  // "MSFC" in byte order
inline constexpr uint32_t kForwardChannelVersion = 1;
inline constexpr uint32_t kForwardChannelMaxSlots = 256;
inline constexpr uint64_t kForwardChannelMinSlotBytes = 1024;
inline constexpr uint64_t kForwardChannelMaxSlotBytes = uint64_t{1} << 30;

// Header fields.
inline constexpr uint64_t kMagicOffset = 0;
inline constexpr uint64_t kVersionOffset = 4;
inline constexpr uint64_t kNumSlotsOffset = 8;
inline constexpr uint64_t kSlotBytesOffset = 16;
inline constexpr uint64_t kDoorbellOffset = 64;
inline constexpr uint64_t kServerSleepingOffset = 128;
inline constexpr uint64_t kServerAttachedOffset = 192;
inline constexpr uint64_t kForwardChannelSlotsOffset = 256;

// Slot fields, from the slot's start.
inline constexpr uint64_t kSlotStateOffset = 0;
inline constexpr uint64_t kSlotClientWaitingOffset = 4;
inline constexpr uint64_t kSlotRequestBytesOffset = 8;
inline constexpr uint64_t kSlotAnswerBytesOffset = 12;
inline constexpr uint64_t kSlotStatusCodeOffset = 16;
inline constexpr uint64_t kSlotTimeoutUsOffset = 24;
inline constexpr uint64_t kSlotSequenceOffset = 32;
inline constexpr uint64_t kSlotAnswerSequenceOffset = 40;
inline constexpr uint64_t kForwardChannelSlotHeaderBytes = 64;

// Slot states.
inline constexpr uint32_t kSlotFree = 0;
inline constexpr uint32_t kSlotRequest = 1;
inline constexpr uint32_t kSlotTaken = 2;
inline constexpr uint32_t kSlotAnswer = 3;

// The protocol's futex and spin primitives, for both sides. Shared (not FUTEX_PRIVATE): the
// other side is another process. A word of the mapping viewed as an atomic (lock-free, so
// address-free across processes).
static_assert(std::atomic<uint32_t>::is_always_lock_free, "futex words must be plain words");
inline std::atomic<uint32_t>* ChannelWord(void* p) {
  return reinterpret_cast<std::atomic<uint32_t>*>(p);
}
// Sleeps while *word == expected, at most timeout_ns (returns early on a wake or a change).
inline void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_ns) {
  struct timespec ts;
  ts.tv_sec = static_cast<time_t>(timeout_ns / 1000000000);
  ts.tv_nsec = static_cast<long>(timeout_ns % 1000000000);
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}
inline void FutexWake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}
inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Bytes of a channel object with `num_slots` slots of `slot_bytes` each.
constexpr uint64_t ForwardChannelBytes(uint64_t num_slots, uint64_t slot_bytes) {
  return kForwardChannelSlotsOffset + num_slots * slot_bytes;
}

}  // namespace moeserve::v1channel

#endif  // MOESERVE_PROTO_MOESERVE_V1_FORWARD_CHANNEL_H_
