// A minimal HTTP/1.1 endpoint for Prometheus scrapes: GET /metrics answers `render()`.
//
// Why not prometheus-cpp's civetweb exposer: Debian's civetweb runs its workers on 100 KiB
// stacks, and glibc carves every thread's static TLS out of its stack. OpenBLAS (60 KiB of TLS),
// NCCL and the CUDA runtime together leave civetweb too little, and a scrape overflowed the stack
// (SIGSEGV) once the CUDA backend was linked in. This server uses one ordinary thread.
//
// That thread runs a poll loop over non-blocking sockets, so no connection can stall another:
// a client that sends its request slowly (slow loris), sends nothing, or reads the answer
// slowly holds only its own slot. Each connection must deliver its request within
// request_timeout and take its answer within write_timeout, or it is closed; at most
// max_connections are open at once, and when a new one arrives at the limit, the connection
// that has waited longest for its request is dropped to make room (so idle connections cannot
// lock scrapes out). One request per connection (Connection: close).
#ifndef MOESERVE_SERVER_METRICS_HTTP_H_
#define MOESERVE_SERVER_METRICS_HTTP_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "server/tls.h"

namespace moeserve {

struct MetricsHttpOptions {
  int max_connections = 64;
  // From accept to the end of the request's headers.
  std::chrono::milliseconds request_timeout{2000};
  // From the end of the request to the last byte of the answer sent.
  std::chrono::milliseconds write_timeout{10000};
};

// Counters since Start (a snapshot), for tests and logs.
struct MetricsHttpStats {
  int64_t accepted = 0;
  int64_t served = 0;            // answers sent in full (any status)
  int64_t timed_out = 0;         // closed for request_timeout or write_timeout
  int64_t evicted = 0;           // closed to make room at max_connections
  int64_t open_connections = 0;  // now
};

class MetricsHttpServer {
 public:
  // Binds "host:port" (port 0: a free port; host may be a name, an IPv4 address or [IPv6]) and
  // starts serving. `render` is called on the server thread for every GET /metrics; it must be
  // thread-safe. UNAVAILABLE naming the address if it cannot be bound; INVALID_ARGUMENT for
  // non-positive limits. With `tls` set, every connection is HTTPS (TLS 1.2+; with tls.ca_file
  // a client certificate signed by it is required; the files are re-read when they change);
  // INVALID_ARGUMENT naming the --metrics_tls_* flag when they are unusable. The TLS handshake
  // runs in the poll loop too and counts against request_timeout.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const std::string& address, std::function<std::string()> render, const TlsFiles& tls = {},
      const MetricsHttpOptions& options = MetricsHttpOptions());
  // Stops accepting, closes every connection and joins the thread (within about 100 ms).
  ~MetricsHttpServer();

  int port() const { return port_; }
  MetricsHttpStats stats() const;

 private:
  struct Connection;
  MetricsHttpServer() = default;
  void Serve();

  std::function<std::string()> render_;
  MetricsHttpOptions options_;
  std::unique_ptr<TlsServerContext> tls_;  // null: plain HTTP
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> accepted_{0}, served_{0}, timed_out_{0}, evicted_{0}, open_{0};
  std::thread thread_;
};

}  // namespace moeserve

#endif  // MOESERVE_SERVER_METRICS_HTTP_H_
