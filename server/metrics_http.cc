#include "server/metrics_http.h"

#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace moeserve {
namespace {

constexpr int kPollMs = 100;
constexpr size_t kMaxRequestBytes = 16 << 10;

std::string Response(absl::string_view status, absl::string_view type, const std::string& body) {
  return absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: ", type,
                      "\r\nContent-Length: ", body.size(), "\r\nConnection: close\r\n\r\n", body);
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& address, std::function<std::string()> render, const TlsFiles& tls) {
  std::unique_ptr<TlsServerContext> tls_context;
  if (tls.enabled()) {
    absl::StatusOr<std::unique_ptr<TlsServerContext>> created =
        TlsServerContext::Create(tls, "--metrics_tls_");
    if (!created.ok()) return created.status();
    tls_context = std::move(*created);
  }
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics_address: got '", address, "', expected host:port"));
  }
  std::string host = address.substr(0, colon);
  const std::string port = address.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* result = nullptr;
  if (int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &result);
      rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("metrics: cannot resolve '", address, "': ", gai_strerror(rc)));
  }
  auto server = std::unique_ptr<MetricsHttpServer>(new MetricsHttpServer());
  std::string last_error = "no address";
  for (addrinfo* ai = result; ai != nullptr; ai = ai->ai_next) {
    const int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && ::listen(fd, 16) == 0) {
      server->listen_fd_ = fd;
      break;
    }
    last_error = std::strerror(errno);
    ::close(fd);
  }
  freeaddrinfo(result);
  if (server->listen_fd_ < 0) {
    return absl::UnavailableError(
        absl::StrCat("metrics: cannot listen on '", address, "': ", last_error));
  }
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  ::getsockname(server->listen_fd_, reinterpret_cast<sockaddr*>(&bound), &len);
  server->port_ = bound.ss_family == AF_INET6
                      ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                      : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  server->render_ = std::move(render);
  server->tls_ = std::move(tls_context);
  server->thread_ = std::thread([s = server.get()] { s->Serve(); });
  return server;
}

MetricsHttpServer::~MetricsHttpServer() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  if (listen_fd_ >= 0) ::close(listen_fd_);
}

void MetricsHttpServer::Serve() {
  while (!stop_) {
    pollfd p{listen_fd_, POLLIN, 0};
    if (::poll(&p, 1, kPollMs) <= 0) continue;
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    Handle(fd);
    ::close(fd);
  }
}

// One request per connection; a slow or silent client is dropped after 2 s.
void MetricsHttpServer::Handle(int fd) {
  timeval timeout{2, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
  std::unique_ptr<StreamConnection> conn;
  if (tls_ == nullptr) {
    conn = PlainConnection(fd);
  } else {
    absl::StatusOr<std::unique_ptr<StreamConnection>> accepted = tls_->Accept(fd);
    if (!accepted.ok()) return;  // no TLS, no client certificate, untrusted: nothing to answer
    conn = std::move(*accepted);
  }
  std::string request;
  char buf[4096];
  while (request.find("\r\n\r\n") == std::string::npos && request.size() < kMaxRequestBytes) {
    const ssize_t n = conn->Read(buf, sizeof(buf));
    if (n <= 0) return;
    request.append(buf, static_cast<size_t>(n));
  }
  const std::string line = request.substr(0, request.find("\r\n"));
  const bool metrics = absl::StartsWith(line, "GET /metrics ") ||
                       absl::StartsWith(line, "GET /metrics?") || line == "GET /metrics";
  if (metrics) {
    conn->WriteAll(Response("200 OK", "text/plain; version=0.0.4; charset=utf-8", render_()));
  } else if (absl::StartsWith(line, "GET ")) {
    conn->WriteAll(Response("404 Not Found", "text/plain", "moeserve serves /metrics\n"));
  } else {
    conn->WriteAll(Response("405 Method Not Allowed", "text/plain", "GET /metrics only\n"));
  }
}

}  // namespace moeserve
