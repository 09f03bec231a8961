// Multi-process (multi-node) serving, the gRPC side: which process this is (flags and the
// Kubernetes LeaderWorkerSet environment), the leader's bootstrap service that hands the NCCL
// unique id to the followers, and a follower's process (health only + the follower loop).
// Core stays free of gRPC: it gets the id as bytes (EngineOptions::collective_id).
//
// LeaderWorkerSet mapping (a flag that is set wins over the environment):
//   --world_size     <- LWS_GROUP_SIZE * --ranks  (LWS counts pods; each pod runs --ranks GPUs)
//   --node_rank      <- LWS_WORKER_INDEX          (0 on the leader pod)
//   --leader_address <- LWS_LEADER_ADDRESS ":" --leader_port  (LWS gives a host name)
// Multi-process mode is on when world_size > --ranks; it needs --ranks > 0 (GPUs per process)
// and a leader address.
//
// Security (docs/security.md): the bootstrap service hands out the NCCL unique id, with which a
// process can join the group. It listens only where asked (--bootstrap_listen, else the leader
// address itself), only while the group forms, and can require mutual TLS (--internal_tls_*)
// and a shared bearer token (--bootstrap_token_file). Refusals never reveal the leader's
// options or the id.
//
// Health: the leader serves the public API and the standard health service as a single
// process does. A follower serves only health: "" and kInternalServiceName SERVING while its
// follower loop runs (NOT_SERVING once it ended), kMoeServiceName always NOT_SERVING (it does
// not serve the public API).
#ifndef MOESERVE_SERVER_INTERNAL_BOOTSTRAP_H_
#define MOESERVE_SERVER_INTERNAL_BOOTSTRAP_H_

#include <grpcpp/grpcpp.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/engine.h"
#include "server/security.h"
#include "server/tls.h"

namespace moeserve {

inline constexpr char kInternalServiceName[] = "moeserve.v1.InternalService";
inline constexpr int kDefaultLeaderPort = 50052;

struct MultiProcessFlags {
  int world_size = 0;                    // --world_size; 0: unset
  int node_rank = -1;                    // --node_rank; -1: unset
  std::string leader_address;            // --leader_address (host:port); empty: unset
  int leader_port = kDefaultLeaderPort;  // with LWS_LEADER_ADDRESS, which has no port
  int local_ranks = 0;                   // --ranks (ranks in this process)
};

struct MultiProcessConfig {
  bool enabled = false;  // false: a single process hosts every rank
  int world_size = 0;
  int node_rank = 0;
  int local_ranks = 0;
  std::string leader_address;
  bool leader() const { return node_rank == 0; }
};

// Environment lookup (tests pass a map); nullopt when the variable is not set.
using EnvLookup = std::function<std::optional<std::string>(const char* name)>;
EnvLookup ProcessEnvironment();

// INVALID_ARGUMENT naming the flag or variable when the values do not fit together.
absl::StatusOr<MultiProcessConfig> ResolveMultiProcess(const MultiProcessFlags& flags,
                                                       const EnvLookup& env);

// What must be equal on every process of a group (model, weights, engine layout).
std::string EngineFingerprint(const EngineOptions& options);

// Who may take part in the bootstrap. Default: anyone who reaches the address.
struct InternalSecurity {
  // Mutual TLS between the processes: cert + key + ca, the same flags on every process (the
  // leader requires a client certificate signed by ca; a follower verifies the leader's).
  TlsFiles tls;
  // Follower: the name the leader's certificate must carry (empty: the leader address's host).
  std::string tls_server_name;
  // Leader: GetBootstrap needs "authorization: Bearer <token>"; follower: sends the first.
  std::shared_ptr<const BearerTokens> token;
};

// The leader's InternalService: answers GetBootstrap with the id while the group forms.
class BootstrapServer {
 public:
  // Listens on `address` (host:port; port 0: a free port).
  static absl::StatusOr<std::unique_ptr<BootstrapServer>> Start(
      const std::string& address, const MultiProcessConfig& config, std::string collective_id,
      std::string fingerprint, const InternalSecurity& security = {});
  ~BootstrapServer();
  int port() const { return port_; }
  void Shutdown();

 private:
  class Impl;
  BootstrapServer() = default;
  std::unique_ptr<Impl> impl_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

// Follower: asks the leader for the collective id, retrying (the leader may not be up yet)
// until `timeout`: DEADLINE_EXCEEDED naming the address when it never answers; the leader's
// refusal (FAILED_PRECONDITION / INVALID_ARGUMENT: another group, other options) at once.
// UNAUTHENTICATED (no or a wrong token) is a refusal too; a TLS handshake that fails is
// retried like an absent leader.
absl::StatusOr<std::string> FetchCollectiveId(const MultiProcessConfig& config,
                                              const std::string& fingerprint,
                                              absl::Duration timeout,
                                              const InternalSecurity& security = {});

struct BootstrapOptions {
  // Where the leader's bootstrap service listens (host:port); empty: the leader address itself,
  // whose host must then be an address of this machine.
  std::string listen;
  InternalSecurity security;
};

// Where the leader's bootstrap service listens: bootstrap.listen, else the leader address.
std::string BootstrapListenAddress(const MultiProcessConfig& config,
                                   const BootstrapOptions& bootstrap);

// Sets options' world_size / node_rank / collective_id. Leader: creates the id and starts the
// bootstrap service on `bootstrap.listen`, returned to be shut down once the engine exists.
// Follower: fetches the id (returns null). INVALID_ARGUMENT for unusable TLS files.
absl::StatusOr<std::unique_ptr<BootstrapServer>> PrepareMultiProcess(
    const MultiProcessConfig& config, EngineOptions* options, absl::Duration timeout,
    const BootstrapOptions& bootstrap = {});

// A follower process: the health-only gRPC server and the follower loop on its own thread.
class FollowerProcess {
 public:
  // Bind() then Run(engine, on_exit).
  static absl::StatusOr<std::unique_ptr<FollowerProcess>> Start(
      Engine* engine, const std::vector<std::string>& listen, std::function<void()> on_exit,
      std::shared_ptr<grpc::ServerCredentials> credentials = nullptr);
  // Binds the health-only server on `listen`, every service NOT_SERVING (the weights are not
  // loaded yet). `credentials` (null: insecure) secure the health server as the leader's public
  // API is secured. UNAVAILABLE naming the address when one cannot be bound.
  static absl::StatusOr<std::unique_ptr<FollowerProcess>> Bind(
      const std::vector<std::string>& listen,
      std::shared_ptr<grpc::ServerCredentials> credentials = nullptr);
  // Starts the follower loop on `engine` (must outlive this); health SERVING while it runs.
  // `on_exit` runs on the loop's thread when the loop ends (e.g. to wake main). Once.
  void Run(Engine* engine, std::function<void()> on_exit);
  ~FollowerProcess();
  const std::vector<std::string>& bound_addresses() const { return bound_; }
  // Aborts the loop if still running, waits for it, stops the server; the loop's result.
  absl::Status Stop();

 private:
  FollowerProcess() = default;
  Engine* engine_ = nullptr;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<grpc::Service> service_;
  std::vector<std::string> bound_;
  std::thread loop_;
  absl::Status result_;
  bool stopped_ = false;
};

}  // namespace moeserve

#endif  // MOESERVE_SERVER_INTERNAL_BOOTSTRAP_H_
