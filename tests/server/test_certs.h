// Real X.509 certificates made at test time with OpenSSL (EC P-256): a CA, server and client
// certificates it signs (valid, expired, from another CA), written to a temp directory; and a
// small HTTPS client for the metrics endpoint.
#ifndef MOESERVE_TESTS_SERVER_TEST_CERTS_H_
#define MOESERVE_TESTS_SERVER_TEST_CERTS_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace moeserve::testing {

// A certificate and its private key, PEM.
struct CertKey {
  std::string cert;
  std::string key;
};

inline std::string BioString(BIO* bio) {
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio, &data);
  return std::string(data, static_cast<size_t>(n));
}

inline EVP_PKEY* NewEcKey() { return EVP_PKEY_Q_keygen(nullptr, nullptr, "EC", "P-256"); }

inline void AddExt(X509* cert, X509* issuer, int nid, const char* value) {
  X509V3_CTX ctx;
  X509V3_set_ctx(&ctx, issuer, cert, nullptr, nullptr, 0);
  X509_EXTENSION* ext = X509V3_EXT_nconf_nid(nullptr, &ctx, nid, value);
  ASSERT_NE(ext, nullptr) << "extension " << value;
  X509_add_ext(cert, ext, -1);
  X509_EXTENSION_free(ext);
}

// A self-signed CA that issues leaf certificates.
class TestCa {
 public:
  explicit TestCa(const std::string& name) : key_(NewEcKey()), cert_(X509_new()) {
    Fill(cert_, key_, name, -3600, 30 * 86400);
    X509_set_issuer_name(cert_, X509_get_subject_name(cert_));
    AddExt(cert_, cert_, NID_basic_constraints, "critical,CA:TRUE");
    AddExt(cert_, cert_, NID_key_usage, "critical,keyCertSign,cRLSign");
    AddExt(cert_, cert_, NID_subject_key_identifier, "hash");
    X509_sign(cert_, key_, EVP_sha256());
  }
  ~TestCa() {
    X509_free(cert_);
    EVP_PKEY_free(key_);
  }
  TestCa(const TestCa&) = delete;
  TestCa& operator=(const TestCa&) = delete;

  std::string cert_pem() const {
    BIO* bio = BIO_new(BIO_s_mem());
    PEM_write_bio_X509(bio, cert_);
    std::string out = BioString(bio);
    BIO_free(bio);
    return out;
  }

  // A leaf for `cn` with SANs DNS:localhost and IP:127.0.0.1, usable by servers and clients,
  // valid from now + not_before_s to now + not_after_s (negative: in the past).
  CertKey Issue(const std::string& cn, long not_before_s = -3600,
                long not_after_s = 7 * 86400) const {
    EVP_PKEY* key = NewEcKey();
    X509* cert = X509_new();
    Fill(cert, key, cn, not_before_s, not_after_s);
    X509_set_issuer_name(cert, X509_get_subject_name(cert_));
    AddExt(cert, cert_, NID_basic_constraints, "critical,CA:FALSE");
    AddExt(cert, cert_, NID_key_usage, "critical,digitalSignature,keyEncipherment");
    AddExt(cert, cert_, NID_ext_key_usage, "serverAuth,clientAuth");
    AddExt(cert, cert_, NID_subject_alt_name, "DNS:localhost,IP:127.0.0.1");
    AddExt(cert, cert_, NID_authority_key_identifier, "keyid");
    X509_sign(cert, key_, EVP_sha256());
    CertKey out;
    BIO* bio = BIO_new(BIO_s_mem());
    PEM_write_bio_X509(bio, cert);
    out.cert = BioString(bio);
    BIO_free(bio);
    bio = BIO_new(BIO_s_mem());
    PEM_write_bio_PrivateKey(bio, key, nullptr, nullptr, 0, nullptr, nullptr);
    out.key = BioString(bio);
    BIO_free(bio);
    X509_free(cert);
    EVP_PKEY_free(key);
    return out;
  }

 private:
  static void Fill(X509* cert, EVP_PKEY* key, const std::string& cn, long not_before_s,
                   long not_after_s) {
    static std::atomic<long> serial{std::random_device()() & 0xffffff};
    X509_set_version(cert, 2);
    ASN1_INTEGER_set(X509_get_serialNumber(cert), ++serial);
    X509_gmtime_adj(X509_getm_notBefore(cert), not_before_s);
    X509_gmtime_adj(X509_getm_notAfter(cert), not_after_s);
    X509_set_pubkey(cert, key);
    X509_NAME_add_entry_by_txt(X509_get_subject_name(cert), "CN", MBSTRING_ASC,
                               reinterpret_cast<const unsigned char*>(cn.c_str()), -1, -1, 0);
  }

  EVP_PKEY* key_;
  X509* cert_;
};

// A fresh directory under the test temp dir.
inline std::string MakeTempDir(const std::string& stem) {
  std::string pattern = ::testing::TempDir() + "/" + stem + ".XXXXXX";
  char* dir = mkdtemp(pattern.data());
  EXPECT_NE(dir, nullptr);
  return pattern;
}

// Writes `data` to dir/name (replacing it atomically, as a secret rotation would) and returns
// the path.
inline std::string WriteFile(const std::string& dir, const std::string& name,
                             const std::string& data) {
  const std::string path = dir + "/" + name;
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f << data;
  }
  EXPECT_EQ(std::rename(tmp.c_str(), path.c_str()), 0);
  return path;
}

// GET /metrics over TLS from 127.0.0.1:port, trusting `ca_pem`, presenting `client` if set.
// Returns the HTTP answer; empty when the TLS handshake (or the connection) fails.
inline std::string HttpsGetMetrics(int port, const std::string& ca_pem,
                                   const CertKey* client = nullptr) {
  SSL_CTX* ctx = SSL_CTX_new(TLS_client_method());
  X509_STORE* store = SSL_CTX_get_cert_store(ctx);
  BIO* bio = BIO_new_mem_buf(ca_pem.data(), static_cast<int>(ca_pem.size()));
  while (X509* x = PEM_read_bio_X509(bio, nullptr, nullptr, nullptr)) {
    X509_STORE_add_cert(store, x);
    X509_free(x);
  }
  BIO_free(bio);
  ERR_clear_error();
  SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER, nullptr);
  if (client != nullptr) {
    BIO* cb = BIO_new_mem_buf(client->cert.data(), static_cast<int>(client->cert.size()));
    X509* cert = PEM_read_bio_X509(cb, nullptr, nullptr, nullptr);
    BIO_free(cb);
    BIO* kb = BIO_new_mem_buf(client->key.data(), static_cast<int>(client->key.size()));
    EVP_PKEY* key = PEM_read_bio_PrivateKey(kb, nullptr, nullptr, nullptr);
    BIO_free(kb);
    SSL_CTX_use_certificate(ctx, cert);
    SSL_CTX_use_PrivateKey(ctx, key);
    X509_free(cert);
    EVP_PKEY_free(key);
  }
  std::string response;
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  timeval timeout{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    SSL* ssl = SSL_new(ctx);
    SSL_set_fd(ssl, fd);
    SSL_set1_host(ssl, "localhost");
    if (SSL_connect(ssl) == 1) {
      const std::string req = "GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n";
      SSL_write(ssl, req.data(), static_cast<int>(req.size()));
      char buf[4096];
      int n;
      while ((n = SSL_read(ssl, buf, sizeof(buf))) > 0) response.append(buf, n);
    }
    SSL_free(ssl);
  }
  ::close(fd);
  SSL_CTX_free(ctx);
  ERR_clear_error();
  return response;
}

}  // namespace moeserve::testing

#endif  // MOESERVE_TESTS_SERVER_TEST_CERTS_H_
