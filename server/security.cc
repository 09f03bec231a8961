#include "server/security.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/impl/server_builder_option.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace moeserve {
namespace {

constexpr size_t kMinTokenChars = 16;
constexpr int64_t kTokenReloadCheckNs = 1'000'000'000;

std::string Sha256(absl::string_view data) {
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_Digest(data.data(), data.size(), out, &len, EVP_sha256(), nullptr);
  return std::string(reinterpret_cast<const char*>(out), len);
}

std::string StatSignature(const std::string& path) {
  struct stat st = {};
  if (::stat(path.c_str(), &st) != 0) return "-";
  return absl::StrCat(st.st_ino, ":", st.st_size, ":", st.st_mtim.tv_sec, ".", st.st_mtim.tv_nsec);
}

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Leaves exactly one reflection plugin (enabled) or none. Linking gRPC's reflection library
// registers its plugin for every server of the process at static initialization, so "off"
// must remove it, and "on" must not add a second one.
class ReflectionOption final : public grpc::ServerBuilderOption {
 public:
  explicit ReflectionOption(bool enabled) : enabled_(enabled) {}
  void UpdateArguments(grpc::ChannelArguments*) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    auto reflection = std::make_unique<grpc::reflection::ProtoServerReflectionPlugin>();
    const std::string name = reflection->name();
    plugins->erase(std::remove_if(plugins->begin(), plugins->end(),
                                  [&](const auto& p) { return p->name() == name; }),
                   plugins->end());
    if (enabled_) plugins->push_back(std::move(reflection));
  }

 private:
  const bool enabled_;
};

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsFiles& files, absl::string_view flag_prefix, int refresh_s) {
  if (!files.enabled()) return grpc::InsecureServerCredentials();
  if (absl::Status s = CheckTlsFiles(files, flag_prefix, TlsRole::kServer); !s.ok()) return s;
  const unsigned refresh = static_cast<unsigned>(std::max(1, refresh_s));
  auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      files.key_file, files.cert_file, files.ca_file, refresh);
  grpc::experimental::TlsServerCredentialsOptions options(provider);
  options.watch_identity_key_cert_pairs();
  if (files.ca_file.empty()) {
    options.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  } else {
    options.watch_root_certs();
    options.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  }
  std::shared_ptr<grpc::ServerCredentials> creds =
      grpc::experimental::TlsServerCredentials(options);
  if (creds == nullptr) {
    return absl::InternalError(absl::StrCat(flag_prefix, "cert: gRPC refused the TLS options"));
  }
  return creds;
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const TlsFiles& files, absl::string_view flag_prefix) {
  if (!files.enabled()) return grpc::InsecureChannelCredentials();
  if (absl::Status s = CheckTlsFiles(files, flag_prefix, TlsRole::kClientOptional); !s.ok()) {
    return s;
  }
  grpc::SslCredentialsOptions ssl;
  const auto read = [&](const std::string& path, absl::string_view suffix,
                        std::string* out) -> absl::Status {
    if (path.empty()) return absl::OkStatus();
    absl::StatusOr<std::string> data = ReadSmallFile(path, absl::StrCat(flag_prefix, suffix));
    if (!data.ok()) return data.status();
    *out = std::move(*data);
    return absl::OkStatus();
  };
  if (absl::Status s = read(files.ca_file, "ca", &ssl.pem_root_certs); !s.ok()) return s;
  if (absl::Status s = read(files.cert_file, "cert", &ssl.pem_cert_chain); !s.ok()) return s;
  if (absl::Status s = read(files.key_file, "key", &ssl.pem_private_key); !s.ok()) return s;
  return grpc::SslCredentials(ssl);
}

// ---- bearer tokens ----

absl::StatusOr<BearerTokens::Parsed> BearerTokens::Parse(const std::string& path,
                                                         absl::string_view flag) {
  absl::StatusOr<std::string> text = ReadSmallFile(path, flag);
  if (!text.ok()) return absl::InvalidArgumentError(text.status().message());
  Parsed parsed;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(*text, '\n')) {
    ++line_no;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    bool printable = line.size() >= kMinTokenChars;
    for (char c : line) printable = printable && c > ' ' && c < 0x7f;
    if (!printable) {
      return absl::InvalidArgumentError(absl::StrCat(flag, ": '", path, "' line ", line_no,
                                                     ": a token must be at least ", kMinTokenChars,
                                                     " printable ASCII characters without spaces"));
    }
    if (parsed.first.empty()) parsed.first = std::string(line);
    parsed.digests.push_back(Sha256(line));
  }
  if (parsed.digests.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": '", path, "' holds no token (one per line; '#' starts a comment)"));
  }
  return parsed;
}

absl::StatusOr<std::shared_ptr<BearerTokens>> BearerTokens::FromFile(const std::string& path,
                                                                     absl::string_view flag) {
  auto tokens = std::shared_ptr<BearerTokens>(new BearerTokens());
  tokens->path_ = path;
  tokens->flag_ = std::string(flag);
  tokens->signature_ = StatSignature(path);
  absl::StatusOr<Parsed> parsed = Parse(path, flag);
  if (!parsed.ok()) return parsed.status();
  tokens->parsed_ = std::make_shared<const Parsed>(std::move(*parsed));
  tokens->next_check_ns_ = NowNs() + kTokenReloadCheckNs;
  return tokens;
}

std::shared_ptr<const BearerTokens::Parsed> BearerTokens::Current() const {
  const int64_t now = NowNs();
  std::lock_guard<std::mutex> lock(mu_);
  if (now < next_check_ns_.load(std::memory_order_relaxed)) return parsed_;
  next_check_ns_.store(now + kTokenReloadCheckNs, std::memory_order_relaxed);
  const std::string signature = StatSignature(path_);
  if (signature == signature_) return parsed_;
  absl::StatusOr<Parsed> parsed = Parse(path_, flag_);
  if (!parsed.ok()) {
    std::fprintf(stderr, "moeserve: %s: reload failed, keeping the previous tokens: %s\n",
                 flag_.c_str(), std::string(parsed.status().message()).c_str());
    return parsed_;  // signature_ unchanged: retried at the next check
  }
  signature_ = signature;
  parsed_ = std::make_shared<const Parsed>(std::move(*parsed));
  return parsed_;
}

std::string BearerTokens::first() const { return Current()->first; }

absl::Status BearerTokens::Check(const std::multimap<grpc::string_ref, grpc::string_ref>& metadata,
                                 absl::string_view what) const {
  const auto it = metadata.find(kAuthorizationKey);
  if (it == metadata.end()) {
    return absl::UnauthenticatedError(absl::StrCat(
        what,
        ": this server requires a bearer token: send the metadata 'authorization: Bearer "
        "<token>' with a token from the server's ",
        flag_));
  }
  absl::string_view value(it->second.data(), it->second.size());
  constexpr absl::string_view kScheme = "bearer ";
  if (value.size() <= kScheme.size() ||
      !absl::EqualsIgnoreCase(value.substr(0, kScheme.size()), kScheme)) {
    return absl::UnauthenticatedError(
        absl::StrCat(what, ": the 'authorization' metadata is not 'Bearer <token>'"));
  }
  const std::string digest = Sha256(absl::StripAsciiWhitespace(value.substr(kScheme.size())));
  std::shared_ptr<const Parsed> parsed = Current();
  int match = 0;
  for (const std::string& d : parsed->digests) {  // every token, no early exit
    match |= d.size() == digest.size() && CRYPTO_memcmp(d.data(), digest.data(), d.size()) == 0;
  }
  if (!match) {
    return absl::UnauthenticatedError(absl::StrCat(what, ": the bearer token is not accepted"));
  }
  return absl::OkStatus();
}

std::string BearerHeader(absl::string_view token) { return absl::StrCat("Bearer ", token); }

void SetReflection(grpc::ServerBuilder* builder, bool enabled) {
  builder->SetOption(std::make_unique<ReflectionOption>(enabled));
}

bool IsLocalAddress(absl::string_view address) {
  if (absl::StartsWith(address, "unix:") || absl::StartsWith(address, "unix-abstract:")) {
    return true;
  }
  absl::string_view host = address;
  if (const size_t colon = host.rfind(':'); colon != absl::string_view::npos) {
    host = host.substr(0, colon);
  }
  host = absl::StripPrefix(absl::StripSuffix(host, "]"), "[");
  return host == "localhost" || absl::StartsWith(host, "127.") || host == "::1";
}

}  // namespace moeserve
