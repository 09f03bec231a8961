// TLS on OpenSSL for moeserve's own sockets (the metrics endpoint), and the start-up check of
// certificate files that every TLS endpoint runs (gRPC's listeners then use gRPC's TLS, see
// server/security.h, which reads the same files).
#ifndef MOESERVE_SERVER_TLS_H_
#define MOESERVE_SERVER_TLS_H_

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace moeserve {

// The PEM files of one TLS endpoint. All empty: TLS off.
struct TlsFiles {
  std::string cert_file;  // certificate chain, leaf first
  std::string key_file;   // the leaf's private key
  // Server: CAs that sign client certificates; when set, a client certificate is required and
  // verified (mutual TLS). Client: the roots that verify the server's certificate.
  std::string ca_file;

  bool enabled() const { return !cert_file.empty() || !key_file.empty() || !ca_file.empty(); }
};

// What CheckTlsFiles requires.
enum class TlsRole {
  kServer,         // cert + key; ca optional (mutual TLS when given)
  kMutual,         // cert + key + ca (the multi-process group: both ends authenticate)
  kClientOptional  // any subset: ca alone (server auth) or cert + key too (mutual TLS)
};

// Reads and checks the files before anything listens: they exist and parse as PEM, the key
// belongs to the certificate, the certificate has not expired, the CA file holds at least one
// certificate. INVALID_ARGUMENT naming the flag (`flag_prefix` + "cert" / "key" / "client_ca"
// or "ca", e.g. "--tls_cert") and what is wrong; never echoes key material.
absl::Status CheckTlsFiles(const TlsFiles& files, absl::string_view flag_prefix, TlsRole role);

// The whole content of a small file (certificates, keys, tokens); NOT_FOUND naming `what`.
absl::StatusOr<std::string> ReadSmallFile(const std::string& path, absl::string_view what);

// A byte stream over an accepted socket, plain or TLS. Blocking; timeouts come from the
// socket's SO_RCVTIMEO / SO_SNDTIMEO. Does not own (close) the socket. One thread at a time.
class StreamConnection {
 public:
  virtual ~StreamConnection() = default;
  // Up to `size` bytes: > 0 read, 0 the peer closed, < 0 error or timeout.
  virtual ssize_t Read(char* buf, size_t size) = 0;
  // All of `data`; false on error or timeout. Never raises SIGPIPE.
  virtual bool WriteAll(absl::string_view data) = 0;
};

std::unique_ptr<StreamConnection> PlainConnection(int fd);

// What one step of non-blocking I/O came to.
enum class IoResult {
  kDone,       // the step completed (bytes moved, or the handshake finished)
  kWantRead,   // poll for POLLIN, then repeat the step
  kWantWrite,  // poll for POLLOUT, then repeat the step
  kClosed,     // the peer closed the connection
  kError,      // a socket error, or a failed handshake (untrusted or missing certificate, ...)
};

// A byte stream over an accepted O_NONBLOCK socket, plain or TLS, for a poll loop: every call
// returns at once. Does not own (close) the socket. One thread at a time.
class NonBlockingConnection {
 public:
  virtual ~NonBlockingConnection() = default;
  // Advances the TLS handshake (plain: kDone at once). Repeat until kDone before Read/Write.
  virtual IoResult Handshake() = 0;
  // Appends up to `max` bytes to `*out` (kDone when at least one was read).
  virtual IoResult Read(std::string* out, size_t max) = 0;
  // Sends a prefix of `data` (kDone with *written > 0). After kWantRead / kWantWrite, repeat
  // with the same data (TLS requires it).
  virtual IoResult Write(absl::string_view data, size_t* written) = 0;
};

std::unique_ptr<NonBlockingConnection> PlainNonBlockingConnection(int fd);

// Server-side TLS for accepted sockets. The files are re-read when their modification time
// changes (checked at most once per `reload_check`), so certificates rotate without a restart;
// a rotation that does not load is logged and the previous certificate stays in use.
// Thread-safe.
class TlsServerContext {
 public:
  static absl::StatusOr<std::unique_ptr<TlsServerContext>> Create(
      const TlsFiles& files, absl::string_view flag_prefix,
      std::chrono::milliseconds reload_check = std::chrono::seconds(1));
  ~TlsServerContext();

  // The TLS handshake on `fd` (TLS 1.2 or newer). UNAUTHENTICATED when the peer fails it (no
  // client certificate where one is required, an untrusted or expired one, not TLS at all),
  // UNAVAILABLE on a socket error or timeout.
  absl::StatusOr<std::unique_ptr<StreamConnection>> Accept(int fd);
  // The same over a non-blocking socket: the handshake runs in NonBlockingConnection::Handshake.
  // (The certificate in use when this is called serves the connection.)
  absl::StatusOr<std::unique_ptr<NonBlockingConnection>> AcceptNonBlocking(int fd);

 private:
  struct Loaded;
  TlsServerContext() = default;
  std::shared_ptr<Loaded> Current();

  TlsFiles files_;
  std::string flag_prefix_;
  std::chrono::milliseconds reload_check_{1000};
  std::mutex mu_;
  std::shared_ptr<Loaded> loaded_;                    // guarded by mu_
  std::chrono::steady_clock::time_point next_check_;  // guarded by mu_
};

}  // namespace moeserve

#endif  // MOESERVE_SERVER_TLS_H_
