// The server side of the forward channel (proto/moeserve/v1/forward_channel.h): Forward calls
// that a same-host frontend writes into the slots of a POSIX shared-memory object, taken by a
// polling thread and run through the same path as a gRPC Forward (decode, checks, regions,
// batcher), answered into the same slot. It exists because a gRPC unary call costs 0.2-0.4 ms
// on a busy host while a decode step's whole transfer budget per layer is about that.
//
// One thread per channel polls the slots' state words. It spins for `spin` after the last call
// it took (a frontend calls layer after layer, so the next call comes within a millisecond),
// then parks on the doorbell futex; every wait has a timeout, so a missed wake costs latency,
// never a hang. The poller runs the call itself (decoding and admission; the batcher may also
// run a small step inline, so a decode step costs no thread hop at all).
//
// Trust: registering needs an authorized, same-host gRPC call (the service checks it); the slots'
// contents are then the frontend's, and every field is checked before use: a request that does
// not fit its slot, fails to parse or is refused is answered with a status, never dropped. The
// header's geometry is read once, at registration.
#ifndef MOESERVE_SERVER_FORWARD_CHANNEL_H_
#define MOESERVE_SERVER_FORWARD_CHANNEL_H_

#include <grpcpp/support/byte_buffer.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/memory_region.h"

namespace moeserve {

// Runs one call: `request` is a serialized moeserve.v1 ForwardRequest (owned by the callee now),
// `deadline` from the slot's timeout. `answer` must be called exactly once, from any thread, with
// the call's status and, when OK, the serialized ForwardResponse. `max_answer_bytes` is what the
// slot can hold (the callee may refuse larger answers before running).
using ChannelAnswerFn = std::function<void(const absl::Status& status, grpc::ByteBuffer answer)>;
using ChannelCallFn = std::function<void(grpc::ByteBuffer request, absl::Time deadline,
                                         int64_t max_answer_bytes, ChannelAnswerFn answer)>;

struct ForwardChannelStats {
  int64_t calls = 0;      // requests taken
  int64_t in_flight = 0;  // taken and not yet answered
  int64_t refused = 0;    // answered with a non-OK status
  int64_t sleeps = 0;     // times the poller parked on the doorbell
};

// One registered channel: the mapping, its geometry and its polling thread. Created by the
// registry; shared with the calls in flight (the mapping lives until the last answer).
class ForwardChannel : public std::enable_shared_from_this<ForwardChannel> {
 public:
  // Maps `key` (bytes [0, byte_size)) and checks the header (magic, version, slot geometry within
  // byte_size). INVALID_ARGUMENT / NOT_FOUND / PERMISSION_DENIED naming what was wrong. Does not
  // start polling (Start).
  static absl::StatusOr<std::shared_ptr<ForwardChannel>> Open(const std::string& name,
                                                              const std::string& key,
                                                              int64_t byte_size);
  ~ForwardChannel();
  ForwardChannel(const ForwardChannel&) = delete;
  ForwardChannel& operator=(const ForwardChannel&) = delete;

  // Starts the polling thread; marks the channel attached.
  void Start(ChannelCallFn call, absl::Duration spin);
  // Stops taking calls if none is in flight (FAILED_PRECONDITION naming how many are otherwise),
  // joins the poller and marks the channel detached. With `force` it stops regardless (server
  // shutdown; calls in flight still answer into the mapping, which they keep alive).
  absl::Status Close(bool force = false);

  const std::string& name() const { return name_; }
  const std::string& key() const { return key_; }
  int num_slots() const { return num_slots_; }
  int64_t slot_bytes() const { return slot_bytes_; }
  int64_t payload_bytes() const;
  ForwardChannelStats stats() const;

 private:
  ForwardChannel() = default;
  uint8_t* slot(int i) const;
  std::atomic<uint32_t>* word(uint64_t offset) const;
  void Poll();
  // Whether any slot holds a request now.
  bool AnyRequest() const;
  // Takes slot i (its state was kSlotRequest): copies the request out and runs it.
  void Take(int i);
  void Answer(int i, uint64_t sequence, absl::Status status, const grpc::ByteBuffer& answer);

  std::string name_, key_;
  std::unique_ptr<MemoryRegion> region_;  // the mapping
  uint8_t* base_ = nullptr;
  int num_slots_ = 0;
  int64_t slot_bytes_ = 0;
  ChannelCallFn call_;
  absl::Duration spin_;
  std::thread poller_;
  std::atomic<bool> stop_{false};
  mutable std::mutex mu_;  // closing_ and in_flight_ together (Close vs Take)
  bool closing_ = false;
  bool started_ = false;
  bool closed_ = false;
  int64_t in_flight_ = 0;
  std::atomic<int64_t> calls_{0}, refused_{0}, sleeps_{0};
};

// The channels by name. Thread-safe.
class ForwardChannelRegistry {
 public:
  ForwardChannelRegistry(int max_channels, absl::Duration spin);
  // Closes every channel (force).
  ~ForwardChannelRegistry();

  // Opens and starts `name` over `key`; ALREADY_EXISTS for a taken name, RESOURCE_EXHAUSTED past
  // max_channels, the Open errors otherwise.
  absl::StatusOr<std::shared_ptr<ForwardChannel>> Register(const std::string& name,
                                                           const std::string& key,
                                                           int64_t byte_size, ChannelCallFn call);
  // Closes `name` ("" = every channel); NOT_FOUND for an unknown name, FAILED_PRECONDITION while
  // a call of the channel runs (nothing is unregistered then).
  absl::Status Unregister(const std::string& name);
  // Stops every channel's poller now (server shutdown); calls in flight still answer.
  void CloseAll();
  int size() const;
  absl::Duration spin() const { return spin_; }

 private:
  const int max_channels_;
  const absl::Duration spin_;
  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<ForwardChannel>> channels_;
};

}  // namespace moeserve

#endif  // MOESERVE_SERVER_FORWARD_CHANNEL_H_
