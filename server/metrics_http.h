// A minimal HTTP/1.1 endpoint for Prometheus scrapes: GET /metrics answers `render()`.
//
// Why not prometheus-cpp's civetweb exposer: Debian's civetweb runs its workers on 100 KiB
// stacks, and glibc carves every thread's static TLS out of its stack. OpenBLAS (60 KiB of TLS),
// NCCL and the CUDA runtime together leave civetweb too little, and a scrape overflowed the stack
// (SIGSEGV) once the CUDA backend was linked in. This server uses one ordinary thread.
#ifndef MOESERVE_SERVER_METRICS_HTTP_H_
#define MOESERVE_SERVER_METRICS_HTTP_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "server/tls.h"

namespace moeserve {

class MetricsHttpServer {
 public:
  // Binds "host:port" (port 0: a free port; host may be a name, an IPv4 address or [IPv6]) and
  // starts serving. `render` is called on the server thread for every GET /metrics; it must be
  // thread-safe. UNAVAILABLE naming the address if it cannot be bound. With `tls` set, every
  // connection is HTTPS (TLS 1.2+; with tls.ca_file a client certificate signed by it is
  // required; the files are re-read when they change); INVALID_ARGUMENT naming the
  // --metrics_tls_* flag when they are unusable.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const std::string& address, std::function<std::string()> render, const TlsFiles& tls = {});
  // Stops accepting and joins the thread (within about 100 ms).
  ~MetricsHttpServer();

  int port() const { return port_; }

 private:
  MetricsHttpServer() = default;
  void Serve();
  void Handle(int fd);

  std::function<std::string()> render_;
  std::unique_ptr<TlsServerContext> tls_;  // null: plain HTTP
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace moeserve

#endif  // MOESERVE_SERVER_METRICS_HTTP_H_
