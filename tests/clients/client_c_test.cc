// The C interface (clients/cpp/moeserve_client_c.h) refuses bad arguments with a code and a
// message, never a crash: NULL handles and pointers, bad dtype codes and shapes, byte ranges of
// negative size, a second wait. A target with nothing listening answers UNAVAILABLE within the
// deadline. (Calls against a real server: tests/python/native_client_test.py.)
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "clients/cpp/moeserve_client_c.h"

namespace {

constexpr int kInvalidArgument = 3;
constexpr int kUnavailable = 14;
constexpr int kFailedPrecondition = 9;

struct Err {
  char text[512] = "unchanged";
  std::string str() const { return text; }
};

class ClientCTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Err err;
    // Nothing listens on port 1: calls fail fast with UNAVAILABLE.
    MoeserveClientOptions options{};
    options.timeout_s = 5.0;
    client_ = moeserve_client_create("127.0.0.1:1", &options, err.text, sizeof err.text);
    ASSERT_NE(client_, nullptr) << err.str();
    EXPECT_EQ(err.str(), "");
  }
  void TearDown() override { moeserve_client_destroy(client_); }

  MoeserveForwardArgs Args() {
    MoeserveForwardArgs a{};
    a.hidden_dtype = 3;  // FP32
    a.num_tokens = 2;
    a.hidden = 4;
    a.hidden_states = hidden_.data();
    a.ids_dtype = 4;  // INT32
    a.topk = 2;
    a.topk_ids = ids_.data();
    a.topk_weights = weights_.data();
    return a;
  }

  // Where Args()'s answer goes: [2, 4] FP32 into out_.
  MoeserveResult Result() {
    MoeserveResult r{};
    r.out = out_.data();
    r.out_bytes = static_cast<int64_t>(out_.size() * sizeof(float));
    r.expect_dtype = 3;
    r.expect_num_tokens = 2;
    r.expect_hidden = 4;
    return r;
  }

  MoeserveClient* client_ = nullptr;
  std::vector<float> out_ = std::vector<float>(8);
  std::vector<float> hidden_ = std::vector<float>(8, 0.5f);
  std::vector<int32_t> ids_ = {0, 1, 1, 0};
  std::vector<float> weights_ = {0.5f, 0.5f, 0.25f, 0.75f};
};

TEST_F(ClientCTest, AbiVersion) {
  EXPECT_EQ(moeserve_client_abi_version(), MOESERVE_CLIENT_C_ABI_VERSION);
}

TEST(ClientCCreate, RefusesBadArguments) {
  Err err;
  EXPECT_EQ(moeserve_client_create(nullptr, nullptr, err.text, sizeof err.text), nullptr);
  EXPECT_EQ(err.str(), "target is NULL");
  EXPECT_EQ(moeserve_client_create("", nullptr, err.text, sizeof err.text), nullptr);
  EXPECT_NE(err.str().find("target is empty"), std::string::npos) << err.str();
  const struct {
    const char* name;
    void (*edit)(MoeserveClientOptions*);
    const char* message;
  } cases[] = {
      {"timeout", [](MoeserveClientOptions* o) { o->timeout_s = -1; }, "timeout_s -1"},
      {"spin", [](MoeserveClientOptions* o) { o->spin_us = -2; }, "spin_us -2"},
      {"size", [](MoeserveClientOptions* o) { o->max_message_bytes = -3; }, "max_message_bytes -3"},
      {"huge", [](MoeserveClientOptions* o) { o->max_message_bytes = int64_t{1} << 40; },
       "max_message_bytes is 1099511627776"},
      {"cert alone", [](MoeserveClientOptions* o) { o->tls_cert_file = "/nonexistent.pem"; },
       "tls_cert_file and tls_key_file go together"},
      {"unreadable ca", [](MoeserveClientOptions* o) { o->tls_ca_file = "/nonexistent/ca.pem"; },
       "cannot read '/nonexistent/ca.pem'"},
  };
  for (const auto& c : cases) {
    MoeserveClientOptions o{};
    c.edit(&o);
    EXPECT_EQ(moeserve_client_create("h:1", &o, err.text, sizeof err.text), nullptr) << c.name;
    EXPECT_NE(err.str().find(c.message), std::string::npos) << c.name << ": " << err.str();
  }
  // Defaults (NULL options, zeros) and every option set are accepted.
  MoeserveClient* client = moeserve_client_create("h:1", nullptr, err.text, sizeof err.text);
  EXPECT_NE(client, nullptr) << err.str();
  moeserve_client_destroy(client);
  MoeserveClientOptions all{};
  all.max_message_bytes = 1 << 20;
  all.timeout_s = 2;
  all.spin_us = 100;
  all.auth_token = "a-token-of-at-least-16-chars";
  all.use_tls = 1;
  all.tls_server_name = "moeserve.example";
  all.wait_for_ready = 1;
  client = moeserve_client_create("h:1", &all, err.text, sizeof err.text);
  EXPECT_NE(client, nullptr) << err.str();
  moeserve_client_destroy(client);
  // No error buffer: still refused, nothing written.
  EXPECT_EQ(moeserve_client_create(nullptr, nullptr, nullptr, 0), nullptr);
  moeserve_client_destroy(nullptr);  // a no-op
}

TEST(ClientCCreate, MessagesAreCutToTheBuffer) {
  char small[8];
  MoeserveClientOptions o{};
  o.timeout_s = -1;
  EXPECT_EQ(moeserve_client_create("h:1", &o, small, sizeof small), nullptr);
  EXPECT_EQ(std::string(small), "timeout");  // 7 characters and the NUL
}

TEST_F(ClientCTest, RefusesBadArgsBeforeSending) {
  Err err;
  MoeserveResult r = Result();
  struct Case {
    const char* name;
    void (*edit)(MoeserveForwardArgs*);
    const char* message;
  };
  const Case cases[] = {
      {"dtype", [](MoeserveForwardArgs* a) { a->hidden_dtype = 7; }, "hidden_dtype is 7"},
      {"shape", [](MoeserveForwardArgs* a) { a->hidden = 0; }, "hidden_states shape [2, 0]"},
      {"tokens", [](MoeserveForwardArgs* a) { a->num_tokens = -1; }, "hidden_states shape [-1"},
      {"null hidden", [](MoeserveForwardArgs* a) { a->hidden_states = nullptr; },
       "hidden_states is NULL"},
      {"ids only", [](MoeserveForwardArgs* a) { a->topk_weights = nullptr; },
       "both topk_ids and topk_weights"},
      {"ids dtype", [](MoeserveForwardArgs* a) { a->ids_dtype = 3; }, "ids_dtype is 3"},
      {"topk", [](MoeserveForwardArgs* a) { a->topk = 0; }, "topk is 0"},
  };
  for (const Case& c : cases) {
    MoeserveForwardArgs a = Args();
    c.edit(&a);
    EXPECT_EQ(moeserve_forward(client_, &a, &r, err.text, sizeof err.text), kInvalidArgument)
        << c.name;
    EXPECT_NE(err.str().find(c.message), std::string::npos) << c.name << ": " << err.str();
    MoeserveCall* call = reinterpret_cast<MoeserveCall*>(1);
    EXPECT_EQ(moeserve_submit(client_, &a, &call, err.text, sizeof err.text), kInvalidArgument)
        << c.name;
    EXPECT_EQ(call, nullptr) << c.name;
  }
  MoeserveForwardArgs a = Args();
  EXPECT_EQ(moeserve_forward(nullptr, &a, &r, err.text, sizeof err.text), kInvalidArgument);
  EXPECT_EQ(err.str(), "client is NULL");
  EXPECT_EQ(moeserve_forward(client_, nullptr, &r, err.text, sizeof err.text), kInvalidArgument);
  EXPECT_EQ(err.str(), "args is NULL");
  EXPECT_EQ(moeserve_submit(client_, &a, nullptr, err.text, sizeof err.text), kInvalidArgument);
  EXPECT_EQ(err.str(), "call is NULL");
  const void* parts[1] = {nullptr};
  const int64_t sizes[1] = {-4};
  EXPECT_EQ(moeserve_forward_parts(client_, 1, parts, sizes, 0, &r, err.text, sizeof err.text),
            kInvalidArgument);
  EXPECT_NE(err.str().find("part 0: -4 bytes"), std::string::npos) << err.str();
  EXPECT_EQ(moeserve_forward_parts(client_, 2, nullptr, nullptr, 0, &r, err.text, sizeof err.text),
            kInvalidArgument);
  EXPECT_EQ(moeserve_call_wait(nullptr, &r, err.text, sizeof err.text), kInvalidArgument);
  EXPECT_EQ(moeserve_call_done(nullptr), 0);
  moeserve_call_free(nullptr);  // a no-op
}

TEST_F(ClientCTest, NoServerIsUnavailableBlockingAndInFlight) {
  Err err;
  MoeserveResult r = Result();
  MoeserveForwardArgs a = Args();
  EXPECT_EQ(moeserve_forward(client_, &a, &r, err.text, sizeof err.text), kUnavailable)
      << err.str();
  MoeserveCall* call = nullptr;
  ASSERT_EQ(moeserve_submit(client_, &a, &call, err.text, sizeof err.text), 0) << err.str();
  ASSERT_NE(call, nullptr);
  EXPECT_EQ(moeserve_call_wait(call, &r, err.text, sizeof err.text), kUnavailable) << err.str();
  EXPECT_EQ(moeserve_call_done(call), 1);
  EXPECT_EQ(moeserve_call_wait(call, &r, err.text, sizeof err.text), kFailedPrecondition);
  EXPECT_EQ(err.str(), "the call's answer was taken already");
  moeserve_call_free(call);
  // Freed without a wait: waits for the (failing) answer, then frees.
  ASSERT_EQ(moeserve_submit(client_, &a, &call, err.text, sizeof err.text), 0) << err.str();
  moeserve_call_free(call);
}

}  // namespace
