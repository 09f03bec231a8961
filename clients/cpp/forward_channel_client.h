// The client side of the forward channel (proto/moeserve/v1/forward_channel.h): Forward calls
// through a POSIX shared-memory object that the server polls, for a frontend on the server's
// host. A call costs two cache-line handoffs instead of a gRPC round trip; with tensors in
// registered regions (MoeClient::RegisterSystemSharedMemory / RegisterCudaSharedMemory) the
// channel carries only the few hundred bytes of the request and answer headers.
//
//   auto client = MoeClient::Create("unix:/tmp/moe.sock");
//   auto channel = ForwardChannelClient::Create(client->get(), {});   // registers it
//   auto result = (*channel)->Forward(*MoeClient::EncodeForwardRequest(args));
//
// Thread-safety: Forward may be called from several threads at once (each call takes a free
// slot; with every slot busy a caller waits for one). The server must run with
// --enable_shared_memory, and the MoeClient must reach it over a unix socket or loopback.
#ifndef MOESERVE_CLIENTS_CPP_FORWARD_CHANNEL_CLIENT_H_
#define MOESERVE_CLIENTS_CPP_FORWARD_CHANNEL_CLIENT_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "clients/cpp/moeserve_client.h"

namespace moeserve::client {

struct ForwardChannelOptions {
  // Calls in flight at once.
  int num_slots = 4;
  // Bytes per slot (64 of header, then the request / answer): a request or answer with inline
  // tensors must fit; with regions a few KiB suffice.
  int64_t slot_bytes = int64_t{1} << 20;
  // How long a caller polls its slot before it sleeps on it (a futex wait).
  absl::Duration spin = absl::Milliseconds(5);
  // Registered name (and the shm key "/<name>"); empty: "moeserve-ch-<pid>-<n>".
  std::string name;
};

class ForwardChannelClient {
 public:
  // Creates the shared-memory object, writes its header and registers it with the server
  // through `client` (which must outlive this). FAILED_PRECONDITION / PERMISSION_DENIED as the
  // server refuses (shared memory off, not the same host).
  static absl::StatusOr<std::unique_ptr<ForwardChannelClient>> Create(
      MoeClient* client, const ForwardChannelOptions& options = {});
  // Close(); where the server refuses to unregister, still unmaps and unlinks this side.
  ~ForwardChannelClient();
  ForwardChannelClient(const ForwardChannelClient&) = delete;
  ForwardChannelClient& operator=(const ForwardChannelClient&) = delete;

  // One call: `request` is a serialized ForwardRequest (MoeClient::EncodeForwardRequest or
  // BuildForwardRequest + serialization). Blocks until the answer, the client's deadline
  // (MoeClientOptions::deadline; DEADLINE_EXCEEDED) or the server detaching (UNAVAILABLE). The
  // call's own failure comes back with the server's code and message, as over gRPC.
  absl::StatusOr<ForwardResult> Forward(const grpc::ByteBuffer& request, bool copy_output = true);
  absl::StatusOr<ForwardResult> Forward(const v1::ForwardRequest& request, bool copy_output = true);

  // Unregisters (FAILED_PRECONDITION while a call runs: then nothing changes), unmaps and
  // unlinks. Idempotent.
  absl::Status Close();

  const std::string& name() const { return name_; }
  int num_slots() const { return num_slots_; }
  int64_t slot_bytes() const { return slot_bytes_; }
  // Calls that went to sleep on their slot instead of finding the answer while polling.
  int64_t sleeps() const { return sleeps_; }

 private:
  ForwardChannelClient() = default;
  uint8_t* slot(int i) const;
  void Unmap();  // unmaps and unlinks this side's object (idempotent)
  using Clock = std::chrono::steady_clock;
  // A free slot, or UNAVAILABLE once the server detached / DEADLINE_EXCEEDED after `give_up`
  // while every slot is in flight or given up on.
  absl::StatusOr<int> AcquireSlot(Clock::time_point give_up);
  void ReleaseSlot(int i);

  MoeClient* client_ = nullptr;
  std::string name_, key_;
  uint8_t* base_ = nullptr;
  size_t map_bytes_ = 0;
  int num_slots_ = 0;
  int64_t slot_bytes_ = 0;
  absl::Duration spin_;
  bool registered_ = false;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<int> free_;        // slots no call uses
  std::vector<bool> abandoned_;  // gave up on (deadline): reusable once answered
  uint64_t next_sequence_ = 1;   // guarded by mu_
  std::atomic<int64_t> sleeps_{0};
};

}  // namespace moeserve::client

#endif  // MOESERVE_CLIENTS_CPP_FORWARD_CHANNEL_CLIENT_H_
