#include "server/tls.h"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace moeserve {
namespace {

constexpr size_t kMaxSmallFileBytes = 1 << 20;

// The oldest error on this thread's OpenSSL queue (and clears it); `fallback` when empty.
std::string OpenSslError(absl::string_view fallback) {
  const unsigned long code = ERR_get_error();
  ERR_clear_error();
  if (code == 0) return std::string(fallback);
  char buf[256];
  ERR_error_string_n(code, buf, sizeof(buf));
  return buf;
}

struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct PkeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
struct SslCtxFree {
  void operator()(SSL_CTX* c) const { SSL_CTX_free(c); }
};

std::unique_ptr<BIO, BioFree> MemBio(const std::string& data) {
  return std::unique_ptr<BIO, BioFree>(BIO_new_mem_buf(data.data(), static_cast<int>(data.size())));
}

// Every certificate in `pem`, in order.
std::vector<std::unique_ptr<X509, X509Free>> ReadCertificates(const std::string& pem) {
  std::vector<std::unique_ptr<X509, X509Free>> out;
  auto bio = MemBio(pem);
  while (X509* x = PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr)) out.emplace_back(x);
  ERR_clear_error();  // the read that ended the loop leaves "no start line"
  return out;
}

// stat() signature of the files: changes when any of them is replaced or rewritten.
std::string FilesSignature(const TlsFiles& files) {
  std::string sig;
  for (const std::string* path : {&files.cert_file, &files.key_file, &files.ca_file}) {
    struct stat st = {};
    if (path->empty() || ::stat(path->c_str(), &st) != 0) {
      absl::StrAppend(&sig, "-;");
      continue;
    }
    absl::StrAppend(&sig, st.st_ino, ":", st.st_size, ":", st.st_mtim.tv_sec, ".",
                    st.st_mtim.tv_nsec, ";");
  }
  return sig;
}

// ---- a socket BIO that sends with MSG_NOSIGNAL (a peer that hung up must not raise SIGPIPE,
// whatever the process's signal disposition) ----

int SocketOf(BIO* bio) { return static_cast<int>(reinterpret_cast<intptr_t>(BIO_get_data(bio))); }

int SocketWrite(BIO* bio, const char* data, int size) {
  BIO_clear_retry_flags(bio);
  for (;;) {
    const ssize_t n = ::send(SocketOf(bio), data, static_cast<size_t>(size), MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    return n < 0 ? -1 : static_cast<int>(n);
  }
}

int SocketRead(BIO* bio, char* data, int size) {
  BIO_clear_retry_flags(bio);
  for (;;) {
    const ssize_t n = ::recv(SocketOf(bio), data, static_cast<size_t>(size), 0);
    if (n < 0 && errno == EINTR) continue;
    return n < 0 ? -1 : static_cast<int>(n);
  }
}

// The same for non-blocking sockets: EAGAIN becomes OpenSSL's retry (SSL_ERROR_WANT_*).
int SocketWriteNonBlocking(BIO* bio, const char* data, int size) {
  const int n = SocketWrite(bio, data, size);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) BIO_set_retry_write(bio);
  return n;
}

int SocketReadNonBlocking(BIO* bio, char* data, int size) {
  const int n = SocketRead(bio, data, size);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) BIO_set_retry_read(bio);
  return n;
}

long SocketCtrl(BIO*, int cmd, long, void*) { return cmd == BIO_CTRL_FLUSH ? 1 : 0; }

int SocketCreate(BIO* bio) {
  BIO_set_init(bio, 1);
  return 1;
}

BIO_METHOD* SocketMethod(bool non_blocking = false) {
  static BIO_METHOD* method = [] {
    BIO_METHOD* m = BIO_meth_new(BIO_get_new_index() | BIO_TYPE_SOURCE_SINK, "moeserve socket");
    BIO_meth_set_write(m, SocketWrite);
    BIO_meth_set_read(m, SocketRead);
    BIO_meth_set_ctrl(m, SocketCtrl);
    BIO_meth_set_create(m, SocketCreate);
    return m;
  }();
  static BIO_METHOD* non_blocking_method = [] {
    BIO_METHOD* m =
        BIO_meth_new(BIO_get_new_index() | BIO_TYPE_SOURCE_SINK, "moeserve non-blocking socket");
    BIO_meth_set_write(m, SocketWriteNonBlocking);
    BIO_meth_set_read(m, SocketReadNonBlocking);
    BIO_meth_set_ctrl(m, SocketCtrl);
    BIO_meth_set_create(m, SocketCreate);
    return m;
  }();
  return non_blocking ? non_blocking_method : method;
}

class PlainStream final : public StreamConnection {
 public:
  explicit PlainStream(int fd) : fd_(fd) {}
  ssize_t Read(char* buf, size_t size) override {
    for (;;) {
      const ssize_t n = ::recv(fd_, buf, size, 0);
      if (n < 0 && errno == EINTR) continue;
      return n;
    }
  }
  bool WriteAll(absl::string_view data) override {
    size_t sent = 0;
    while (sent < data.size()) {
      const ssize_t n = ::send(fd_, data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      sent += static_cast<size_t>(n);
    }
    return true;
  }

 private:
  const int fd_;
};

class TlsStream final : public StreamConnection {
 public:
  explicit TlsStream(SSL* ssl) : ssl_(ssl) {}
  ~TlsStream() override {
    SSL_shutdown(ssl_);  // close_notify, without waiting for the peer's
    SSL_free(ssl_);
    ERR_clear_error();
  }
  ssize_t Read(char* buf, size_t size) override {
    const int n = SSL_read(ssl_, buf, static_cast<int>(std::min<size_t>(size, INT_MAX)));
    if (n > 0) return n;
    const int err = SSL_get_error(ssl_, n);
    ERR_clear_error();
    return err == SSL_ERROR_ZERO_RETURN ? 0 : -1;
  }
  bool WriteAll(absl::string_view data) override {
    size_t sent = 0;
    while (sent < data.size()) {
      const int chunk = static_cast<int>(std::min<size_t>(data.size() - sent, INT_MAX));
      const int n = SSL_write(ssl_, data.data() + sent, chunk);
      if (n <= 0) {
        ERR_clear_error();
        return false;
      }
      sent += static_cast<size_t>(n);
    }
    return true;
  }

 private:
  SSL* const ssl_;
};

class PlainNonBlocking final : public NonBlockingConnection {
 public:
  explicit PlainNonBlocking(int fd) : fd_(fd) {}
  IoResult Handshake() override { return IoResult::kDone; }
  IoResult Read(std::string* out, size_t max) override {
    char buf[4096];
    for (;;) {
      const ssize_t n = ::recv(fd_, buf, std::min(sizeof(buf), max), 0);
      if (n < 0 && errno == EINTR) continue;
      if (n > 0) {
        out->append(buf, static_cast<size_t>(n));
        return IoResult::kDone;
      }
      if (n == 0) return IoResult::kClosed;
      return errno == EAGAIN || errno == EWOULDBLOCK ? IoResult::kWantRead : IoResult::kError;
    }
  }
  IoResult Write(absl::string_view data, size_t* written) override {
    *written = 0;
    for (;;) {
      const ssize_t n = ::send(fd_, data.data(), data.size(), MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n > 0) {
        *written = static_cast<size_t>(n);
        return IoResult::kDone;
      }
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return IoResult::kWantWrite;
      return IoResult::kError;
    }
  }

 private:
  const int fd_;
};

class TlsNonBlocking final : public NonBlockingConnection {
 public:
  explicit TlsNonBlocking(SSL* ssl) : ssl_(ssl) {}
  ~TlsNonBlocking() override {
    if (handshake_done_) SSL_shutdown(ssl_);  // close_notify, best effort
    SSL_free(ssl_);
    ERR_clear_error();
  }
  IoResult Handshake() override {
    if (handshake_done_) return IoResult::kDone;
    const int rc = SSL_accept(ssl_);
    if (rc == 1) {
      handshake_done_ = true;
      return IoResult::kDone;
    }
    return Failed(rc);
  }
  IoResult Read(std::string* out, size_t max) override {
    char buf[4096];
    const int n = SSL_read(ssl_, buf, static_cast<int>(std::min(sizeof(buf), max)));
    if (n > 0) {
      out->append(buf, static_cast<size_t>(n));
      return IoResult::kDone;
    }
    return Failed(n);
  }
  IoResult Write(absl::string_view data, size_t* written) override {
    *written = 0;
    const int n =
        SSL_write(ssl_, data.data(), static_cast<int>(std::min<size_t>(data.size(), INT_MAX)));
    if (n > 0) {
      *written = static_cast<size_t>(n);
      return IoResult::kDone;
    }
    return Failed(n);
  }

 private:
  IoResult Failed(int rc) {
    const int err = SSL_get_error(ssl_, rc);
    ERR_clear_error();
    switch (err) {
      case SSL_ERROR_WANT_READ:
        return IoResult::kWantRead;
      case SSL_ERROR_WANT_WRITE:
        return IoResult::kWantWrite;
      case SSL_ERROR_ZERO_RETURN:
        return IoResult::kClosed;
      default:
        return IoResult::kError;
    }
  }

  SSL* const ssl_;
  bool handshake_done_ = false;
};

}  // namespace

std::unique_ptr<NonBlockingConnection> PlainNonBlockingConnection(int fd) {
  return std::make_unique<PlainNonBlocking>(fd);
}

absl::StatusOr<std::string> ReadSmallFile(const std::string& path, absl::string_view what) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return absl::NotFoundError(absl::StrCat(what, ": cannot read '", path, "'"));
  std::string data;
  char buf[4096];
  while (f.read(buf, sizeof(buf)) || f.gcount() > 0) {
    data.append(buf, static_cast<size_t>(f.gcount()));
    if (data.size() > kMaxSmallFileBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": '", path, "' is larger than ", kMaxSmallFileBytes, " bytes"));
    }
  }
  return data;
}

absl::Status CheckTlsFiles(const TlsFiles& files, absl::string_view flag_prefix, TlsRole role) {
  const std::string cert_flag = absl::StrCat(flag_prefix, "cert");
  const std::string key_flag = absl::StrCat(flag_prefix, "key");
  const std::string ca_flag =
      absl::StrCat(flag_prefix, role == TlsRole::kServer ? "client_ca" : "ca");
  if (!files.enabled()) return absl::OkStatus();
  if (files.cert_file.empty() != files.key_file.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(cert_flag, " and ", key_flag, " go together: give both or neither"));
  }
  if (role != TlsRole::kClientOptional && files.cert_file.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(ca_flag, " needs ", cert_flag, " and ", key_flag,
                                                   " (this end's own certificate)"));
  }
  if (role == TlsRole::kMutual && files.ca_file.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        cert_flag, " needs ", ca_flag, " too: both ends of the group verify each other"));
  }
  ERR_clear_error();
  if (!files.cert_file.empty()) {
    absl::StatusOr<std::string> cert_pem = ReadSmallFile(files.cert_file, cert_flag);
    if (!cert_pem.ok()) return absl::InvalidArgumentError(cert_pem.status().message());
    auto chain = ReadCertificates(*cert_pem);
    if (chain.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(cert_flag, ": '", files.cert_file, "' holds no PEM certificate"));
    }
    if (X509_cmp_current_time(X509_get0_notAfter(chain[0].get())) < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(cert_flag, ": the certificate in '", files.cert_file, "' has expired"));
    }
    absl::StatusOr<std::string> key_pem = ReadSmallFile(files.key_file, key_flag);
    if (!key_pem.ok()) return absl::InvalidArgumentError(key_pem.status().message());
    auto bio = MemBio(*key_pem);
    std::unique_ptr<EVP_PKEY, PkeyFree> key(
        PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, nullptr));
    if (key == nullptr) {
      ERR_clear_error();
      return absl::InvalidArgumentError(
          absl::StrCat(key_flag, ": '", files.key_file, "' holds no unencrypted PEM private key"));
    }
    if (X509_check_private_key(chain[0].get(), key.get()) != 1) {
      ERR_clear_error();
      return absl::InvalidArgumentError(absl::StrCat(key_flag, ": the key in '", files.key_file,
                                                     "' does not belong to the certificate in '",
                                                     files.cert_file, "' (", cert_flag, ")"));
    }
  }
  if (!files.ca_file.empty()) {
    absl::StatusOr<std::string> ca_pem = ReadSmallFile(files.ca_file, ca_flag);
    if (!ca_pem.ok()) return absl::InvalidArgumentError(ca_pem.status().message());
    if (ReadCertificates(*ca_pem).empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(ca_flag, ": '", files.ca_file, "' holds no PEM certificate"));
    }
  }
  return absl::OkStatus();
}

std::unique_ptr<StreamConnection> PlainConnection(int fd) {
  return std::make_unique<PlainStream>(fd);
}

// ---- TlsServerContext ----

struct TlsServerContext::Loaded {
  std::unique_ptr<SSL_CTX, SslCtxFree> ctx;
  std::string signature;
};

namespace {

absl::StatusOr<std::unique_ptr<SSL_CTX, SslCtxFree>> NewServerCtx(const TlsFiles& files,
                                                                  absl::string_view flag_prefix) {
  ERR_clear_error();
  std::unique_ptr<SSL_CTX, SslCtxFree> ctx(SSL_CTX_new(TLS_server_method()));
  if (ctx == nullptr) return absl::InternalError(OpenSslError("SSL_CTX_new failed"));
  SSL_CTX_set_min_proto_version(ctx.get(), TLS1_2_VERSION);
  SSL_CTX_set_options(ctx.get(), SSL_OP_NO_RENEGOTIATION);
  if (SSL_CTX_use_certificate_chain_file(ctx.get(), files.cert_file.c_str()) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag_prefix, "cert: '", files.cert_file, "': ", OpenSslError("cannot load")));
  }
  if (SSL_CTX_use_PrivateKey_file(ctx.get(), files.key_file.c_str(), SSL_FILETYPE_PEM) != 1 ||
      SSL_CTX_check_private_key(ctx.get()) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag_prefix, "key: '", files.key_file, "': ", OpenSslError("cannot load")));
  }
  if (!files.ca_file.empty()) {
    if (SSL_CTX_load_verify_locations(ctx.get(), files.ca_file.c_str(), nullptr) != 1) {
      return absl::InvalidArgumentError(absl::StrCat(flag_prefix, "client_ca: '", files.ca_file,
                                                     "': ", OpenSslError("cannot load")));
    }
    if (STACK_OF(X509_NAME)* names = SSL_load_client_CA_file(files.ca_file.c_str())) {
      SSL_CTX_set_client_CA_list(ctx.get(), names);  // takes ownership
    }
    SSL_CTX_set_verify(ctx.get(), SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
  }
  ERR_clear_error();
  return ctx;
}

}  // namespace

absl::StatusOr<std::unique_ptr<TlsServerContext>> TlsServerContext::Create(
    const TlsFiles& files, absl::string_view flag_prefix, std::chrono::milliseconds reload_check) {
  if (absl::Status s = CheckTlsFiles(files, flag_prefix, TlsRole::kServer); !s.ok()) return s;
  if (!files.enabled()) {
    return absl::InvalidArgumentError(absl::StrCat(flag_prefix, "cert: no files given"));
  }
  auto c = std::unique_ptr<TlsServerContext>(new TlsServerContext());
  c->files_ = files;
  c->flag_prefix_ = std::string(flag_prefix);
  c->reload_check_ = reload_check;
  auto loaded = std::make_shared<Loaded>();
  loaded->signature = FilesSignature(files);
  auto ctx = NewServerCtx(files, flag_prefix);
  if (!ctx.ok()) return ctx.status();
  loaded->ctx = std::move(*ctx);
  c->loaded_ = std::move(loaded);
  c->next_check_ = std::chrono::steady_clock::now() + reload_check;
  return c;
}

TlsServerContext::~TlsServerContext() = default;

std::shared_ptr<TlsServerContext::Loaded> TlsServerContext::Current() {
  std::lock_guard<std::mutex> lock(mu_);
  const auto now = std::chrono::steady_clock::now();
  if (now < next_check_) return loaded_;
  next_check_ = now + reload_check_;
  const std::string signature = FilesSignature(files_);
  if (signature == loaded_->signature) return loaded_;
  // Rotated: load the new files; keep serving the old ones if they do not load (e.g. the key
  // was written before the certificate: the next check picks up the pair).
  absl::Status checked = CheckTlsFiles(files_, flag_prefix_, TlsRole::kServer);
  absl::StatusOr<std::unique_ptr<SSL_CTX, SslCtxFree>> ctx =
      checked.ok() ? NewServerCtx(files_, flag_prefix_)
                   : absl::StatusOr<std::unique_ptr<SSL_CTX, SslCtxFree>>(checked);
  if (!ctx.ok()) {
    std::fprintf(stderr, "moeserve: %scert: reload failed, keeping the previous certificate: %s\n",
                 flag_prefix_.c_str(), std::string(ctx.status().message()).c_str());
    return loaded_;
  }
  auto fresh = std::make_shared<Loaded>();
  fresh->ctx = std::move(*ctx);
  fresh->signature = signature;
  loaded_ = std::move(fresh);
  return loaded_;
}

absl::StatusOr<std::unique_ptr<StreamConnection>> TlsServerContext::Accept(int fd) {
  std::shared_ptr<Loaded> loaded = Current();
  ERR_clear_error();
  SSL* ssl = SSL_new(loaded->ctx.get());
  if (ssl == nullptr) return absl::InternalError(OpenSslError("SSL_new failed"));
  BIO* bio = BIO_new(SocketMethod());
  if (bio == nullptr) {
    SSL_free(ssl);
    return absl::InternalError(OpenSslError("BIO_new failed"));
  }
  BIO_set_data(bio, reinterpret_cast<void*>(static_cast<intptr_t>(fd)));
  SSL_set_bio(ssl, bio, bio);  // one reference, owned by ssl
  const int rc = SSL_accept(ssl);
  if (rc == 1) return std::unique_ptr<StreamConnection>(new TlsStream(ssl));
  const int err = SSL_get_error(ssl, rc);
  const long verify = SSL_get_verify_result(ssl);
  std::string why = OpenSslError("the peer closed the connection");
  SSL_free(ssl);
  if (verify != X509_V_OK) {
    why = absl::StrCat("client certificate: ", X509_verify_cert_error_string(verify));
  }
  if (err == SSL_ERROR_SYSCALL) {
    return absl::UnavailableError(absl::StrCat("TLS handshake: ", why));
  }
  return absl::UnauthenticatedError(absl::StrCat("TLS handshake: ", why));
}

absl::StatusOr<std::unique_ptr<NonBlockingConnection>> TlsServerContext::AcceptNonBlocking(int fd) {
  std::shared_ptr<Loaded> loaded = Current();
  ERR_clear_error();
  SSL* ssl = SSL_new(loaded->ctx.get());
  if (ssl == nullptr) return absl::InternalError(OpenSslError("SSL_new failed"));
  BIO* bio = BIO_new(SocketMethod(/*non_blocking=*/true));
  if (bio == nullptr) {
    SSL_free(ssl);
    return absl::InternalError(OpenSslError("BIO_new failed"));
  }
  BIO_set_data(bio, reinterpret_cast<void*>(static_cast<intptr_t>(fd)));
  SSL_set_bio(ssl, bio, bio);  // one reference, owned by ssl
  // A write retried after WANT_* may come from a later offset of the same answer.
  SSL_set_mode(ssl, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
  SSL_set_accept_state(ssl);
  return std::unique_ptr<NonBlockingConnection>(new TlsNonBlocking(ssl));
}

}  // namespace moeserve
