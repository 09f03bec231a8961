#include "server/metrics_http.h"

#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <list>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/thread_name.h"

namespace moeserve {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int kPollMs = 100;  // how soon the loop notices stop_
constexpr size_t kMaxRequestBytes = 16 << 10;

std::string Response(absl::string_view status, absl::string_view type, const std::string& body) {
  return absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: ", type,
                      "\r\nContent-Length: ", body.size(), "\r\nConnection: close\r\n\r\n", body);
}

}  // namespace

struct MetricsHttpServer::Connection {
  int fd = -1;
  std::unique_ptr<NonBlockingConnection> io;  // plain or TLS, over fd
  Clock::time_point deadline;
  bool handshaking = true;  // TLS handshake not done yet (plain: done at the first event)
  bool writing = false;     // the request is in; `out` is being sent
  short events = POLLIN;    // what the last step waits for
  std::string in;
  std::string out;
  size_t sent = 0;
};

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& address, std::function<std::string()> render, const TlsFiles& tls,
    const MetricsHttpOptions& options) {
  if (options.max_connections <= 0 || options.request_timeout.count() <= 0 ||
      options.write_timeout.count() <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics: max_connections (", options.max_connections, "), request_timeout (",
                     options.request_timeout.count(), " ms) and write_timeout (",
                     options.write_timeout.count(), " ms) must be > 0"));
  }
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
    const int fd =
        ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && ::listen(fd, 128) == 0) {
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
  server->options_ = options;
  server->tls_ = std::move(tls_context);
  server->thread_ = std::thread([s = server.get()] {
    SetCurrentThreadName("ms-metrics");
    s->Serve();
  });
  return server;
}

MetricsHttpServer::~MetricsHttpServer() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  if (listen_fd_ >= 0) ::close(listen_fd_);
}

MetricsHttpStats MetricsHttpServer::stats() const {
  MetricsHttpStats s;
  s.accepted = accepted_;
  s.served = served_;
  s.timed_out = timed_out_;
  s.evicted = evicted_;
  s.open_connections = open_;
  return s;
}

namespace {

// The answer to one request (its bytes so far hold the whole header block).
std::string Answer(const std::string& request, const std::function<std::string()>& render) {
  const std::string line = request.substr(0, request.find("\r\n"));
  const bool metrics = absl::StartsWith(line, "GET /metrics ") ||
                       absl::StartsWith(line, "GET /metrics?") || line == "GET /metrics";
  if (metrics) return Response("200 OK", "text/plain; version=0.0.4; charset=utf-8", render());
  if (absl::StartsWith(line, "GET ")) {
    return Response("404 Not Found", "text/plain", "moeserve serves /metrics\n");
  }
  return Response("405 Method Not Allowed", "text/plain", "GET /metrics only\n");
}

}  // namespace

void MetricsHttpServer::Serve() {
  std::list<Connection> conns;  // in accept order: the front has waited longest
  auto close_conn = [&](std::list<Connection>::iterator it) {
    it->io.reset();  // TLS close_notify before the socket goes
    ::close(it->fd);
    --open_;
    return conns.erase(it);
  };
  // Which poll event a step that did not complete waits for; false: close the connection.
  auto wait_for = [](Connection& c, IoResult r) {
    if (r == IoResult::kWantRead) c.events = POLLIN;
    if (r == IoResult::kWantWrite) c.events = POLLOUT;
    return r == IoResult::kWantRead || r == IoResult::kWantWrite;
  };
  std::vector<pollfd> fds;
  std::vector<std::list<Connection>::iterator> polled;
  while (!stop_) {
    // Wake for the nearest deadline, or kPollMs to notice stop_.
    Clock::time_point now = Clock::now();
    Clock::time_point wake = now + std::chrono::milliseconds(kPollMs);
    fds.clear();
    polled.clear();
    fds.push_back({listen_fd_, POLLIN, 0});
    for (auto it = conns.begin(); it != conns.end(); ++it) {
      fds.push_back({it->fd, it->events, 0});
      polled.push_back(it);
      wake = std::min(wake, it->deadline);
    }
    const int timeout_ms = static_cast<int>(std::max<int64_t>(
        0, std::chrono::duration_cast<std::chrono::milliseconds>(wake - now).count() + 1));
    if (::poll(fds.data(), fds.size(), timeout_ms) < 0 && errno != EINTR) continue;
    now = Clock::now();
    for (size_t i = 0; i < polled.size(); ++i) {
      auto it = polled[i];
      const short ev = fds[i + 1].revents;
      if (ev == 0) continue;
      Connection& c = *it;
      if (c.handshaking) {
        const IoResult r = c.io->Handshake();
        if (r != IoResult::kDone) {
          // A failed handshake (not TLS, no or an untrusted client certificate): nothing to say.
          if (!wait_for(c, r)) close_conn(it);
          continue;
        }
        c.handshaking = false;
        c.events = POLLIN;
      }
      if (!c.writing) {
        IoResult r = IoResult::kDone;
        // Read what is there (TLS may hold decrypted bytes that poll does not see).
        while (c.in.find("\r\n\r\n") == std::string::npos && c.in.size() < kMaxRequestBytes) {
          r = c.io->Read(&c.in, kMaxRequestBytes - c.in.size());
          if (r != IoResult::kDone) break;
        }
        if (c.in.find("\r\n\r\n") != std::string::npos) {
          c.out = Answer(c.in, render_);
        } else if (c.in.size() >= kMaxRequestBytes) {
          c.out = Response("431 Request Header Fields Too Large", "text/plain",
                           "request headers over 16 KiB\n");
        } else {
          if (!wait_for(c, r)) close_conn(it);  // closed by the client, or an error
          continue;
        }
        c.writing = true;
        c.events = POLLOUT;
        c.in.clear();
        c.deadline = now + options_.write_timeout;
      }
      // Writing (possibly right after the request completed).
      IoResult r = IoResult::kDone;
      while (c.sent < c.out.size()) {
        size_t n = 0;
        r = c.io->Write(absl::string_view(c.out).substr(c.sent), &n);
        if (r != IoResult::kDone) break;
        c.sent += n;
      }
      if (c.sent == c.out.size()) {
        ++served_;
        close_conn(it);
      } else if (!wait_for(c, r)) {
        close_conn(it);
      }
    }
    // Deadlines.
    for (auto it = conns.begin(); it != conns.end();) {
      if (it->deadline <= now) {
        ++timed_out_;
        it = close_conn(it);
      } else {
        ++it;
      }
    }
    // New connections; at the limit the one waiting longest for its request makes room.
    if (fds[0].revents & POLLIN) {
      while (true) {
        const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) break;  // EAGAIN: none left (or an error: retry on the next wake)
        ++accepted_;
        Connection c;
        c.fd = fd;
        if (tls_ == nullptr) {
          c.io = PlainNonBlockingConnection(fd);
        } else {
          absl::StatusOr<std::unique_ptr<NonBlockingConnection>> io = tls_->AcceptNonBlocking(fd);
          if (!io.ok()) {
            ::close(fd);
            continue;
          }
          c.io = std::move(*io);
        }
        if (static_cast<int>(conns.size()) >= options_.max_connections) {
          auto victim = std::find_if(conns.begin(), conns.end(),
                                     [](const Connection& c) { return !c.writing; });
          if (victim == conns.end()) victim = conns.begin();
          ++evicted_;
          close_conn(victim);
        }
        c.deadline = now + options_.request_timeout;
        conns.push_back(std::move(c));
        ++open_;
      }
    }
  }
  for (auto it = conns.begin(); it != conns.end();) it = close_conn(it);
}

}  // namespace moeserve
