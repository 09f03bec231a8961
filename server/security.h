// Access control for moeserve's gRPC servers (docs/security.md): TLS / mutual-TLS credentials
// that follow their files (certificates rotate without a restart), the optional bearer token,
// and reflection for one server only.
#ifndef MOESERVE_SERVER_SECURITY_H_
#define MOESERVE_SERVER_SECURITY_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/tls.h"

namespace moeserve {

// How often gRPC's certificate provider re-reads the TLS files.
inline constexpr int kDefaultTlsRefreshSeconds = 60;

// Server credentials for `files` (flags named `flag_prefix` + cert/key/client_ca in errors):
// insecure when TLS is off; otherwise TLS 1.2+ whose certificate (and client CAs) gRPC re-reads
// every `refresh_s` seconds. With files.ca_file, clients must present a certificate signed by
// one of those CAs (mutual TLS). The files are checked first (CheckTlsFiles): INVALID_ARGUMENT.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsFiles& files, absl::string_view flag_prefix,
    int refresh_s = kDefaultTlsRefreshSeconds);

// Client credentials for this process's own calls (a follower asking its leader, once at
// start-up, so the files are read once): insecure when TLS is off; otherwise the server is
// verified against files.ca_file (and its host name, or GRPC_SSL_TARGET_NAME_OVERRIDE_ARG) and,
// with cert/key, this process presents its certificate. INVALID_ARGUMENT naming the flag.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const TlsFiles& files, absl::string_view flag_prefix);

// The metadata key and scheme of the bearer token: "authorization: Bearer <token>".
inline constexpr char kAuthorizationKey[] = "authorization";

// Accepted bearer tokens, read from a file: one token per line (printable ASCII, no spaces, at
// least 16 characters); blank lines and lines starting with '#' are skipped. Several lines let
// tokens rotate: add the new one, move the clients, remove the old one. The file is re-read
// when it changes (checked at most once a second); an edit that does not parse is logged and
// the previous tokens stay. Tokens are kept as SHA-256 digests and compared in constant time.
// Thread-safe.
class BearerTokens {
 public:
  // INVALID_ARGUMENT naming `flag`, the file and the line; never echoes a token.
  static absl::StatusOr<std::shared_ptr<BearerTokens>> FromFile(const std::string& path,
                                                                absl::string_view flag);

  // OK when the call's metadata has "authorization: Bearer <t>" with t an accepted token;
  // otherwise UNAUTHENTICATED naming `what` (e.g. "Forward") and saying what was wrong.
  absl::Status Check(const std::multimap<grpc::string_ref, grpc::string_ref>& metadata,
                     absl::string_view what) const;

  // The first token of the file: what this process sends when it is the caller.
  std::string first() const;

 private:
  struct Parsed {
    std::vector<std::string> digests;  // SHA-256 of each token
    std::string first;
  };
  BearerTokens() = default;
  static absl::StatusOr<Parsed> Parse(const std::string& path, absl::string_view flag);
  std::shared_ptr<const Parsed> Current() const;

  std::string path_;
  std::string flag_;
  mutable std::mutex mu_;
  mutable std::shared_ptr<const Parsed> parsed_;  // guarded by mu_
  mutable std::string signature_;                 // guarded by mu_: the file's stat
  mutable std::atomic<int64_t> next_check_ns_{0};
};

// The "authorization" metadata value that carries `token`.
std::string BearerHeader(absl::string_view token);

// Serves grpc.reflection.v1alpha.ServerReflection on this builder's server, or not, whatever
// other servers of the process do (gRPC's own switch,
// grpc::reflection::InitProtoReflectionServerBuilderPlugin, is process-wide, and linking its
// library flips it on). Every ServerBuilder of moeserve calls this.
void SetReflection(grpc::ServerBuilder* builder, bool enabled);

// True for addresses only this host can reach: unix sockets, localhost, 127.0.0.0/8, [::1].
bool IsLocalAddress(absl::string_view address);

}  // namespace moeserve

#endif  // MOESERVE_SERVER_SECURITY_H_
