#include "server/metrics_http.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace moeserve {
namespace {

// Sends `request` raw to 127.0.0.1:port and returns everything the server answers.
std::string Send(int port, const std::string& request) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  EXPECT_EQ(::send(fd, request.data(), request.size(), 0), static_cast<ssize_t>(request.size()));
  std::string out;
  char buf[1024];
  ssize_t n;
  while ((n = ::recv(fd, buf, sizeof(buf), 0)) > 0) out.append(buf, n);
  ::close(fd);
  return out;
}

std::string Get(int port, const std::string& path) {
  return Send(port, absl::StrCat("GET ", path, " HTTP/1.1\r\nHost: x\r\n\r\n"));
}

TEST(MetricsHttpServerTest, ServesMetricsAndRefusesOtherPaths) {
  std::atomic<int> calls{0};
  auto server = MetricsHttpServer::Start(
      "127.0.0.1:0", [&] { return absl::StrCat("moeserve_test_metric ", ++calls, "\n"); });
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  ASSERT_GT(port, 0);
  std::string r = Get(port, "/metrics");
  EXPECT_NE(r.find("HTTP/1.1 200 OK"), std::string::npos) << r;
  EXPECT_NE(r.find("text/plain; version=0.0.4"), std::string::npos);
  EXPECT_NE(r.find("moeserve_test_metric 1"), std::string::npos);
  r = Get(port, "/metrics");
  EXPECT_NE(r.find("moeserve_test_metric 2"), std::string::npos);  // rendered per scrape
  EXPECT_NE(Get(port, "/").find("404"), std::string::npos);
  // Only GET is served.
  EXPECT_NE(Send(port, "POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n").find("405"),
            std::string::npos);
  // The port is taken: a second server fails cleanly, naming the address.
  auto second = MetricsHttpServer::Start(absl::StrCat("127.0.0.1:", port), [] { return ""; });
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(second.status().message().find(absl::StrCat(port)), absl::string_view::npos);
  EXPECT_EQ(MetricsHttpServer::Start("no-port", [] { return ""; }).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace moeserve
