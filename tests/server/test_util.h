// Helpers shared by the server tests: random requests, tensor encoding, metrics scraping.
#ifndef MOESERVE_TESTS_SERVER_TEST_UTIL_H_
#define MOESERVE_TESTS_SERVER_TEST_UTIL_H_

#include <arpa/inet.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "core/dtype.h"
#include "core/engine.h"
#include "core/model_config.h"
#include "core/tensor.h"
#include "kernels/cpu/dtype_convert.h"
#include "moeserve/v1/moeserve.pb.h"
#include "server/server.h"
#include "tests/testing/test_util.h"

namespace moeserve::testing {

// The server tests' model: the tiny preset with 8 experts, top-3, hidden 128, intermediate 96,
// small enough for the reference engine to check every answer.
inline ModelConfig TestModel() {
  ModelOverrides o;
  o.num_experts = 8;
  o.topk = 3;
  o.hidden = 128;
  o.intermediate = 96;
  return ApplyOverrides(ModelPreset("tiny").value(), o).value();
}

// Values -> little-endian bytes of `dtype` (BF16/FP16 rounded to nearest even).
// A server on a free local port without a metrics listener: requests up to
// `inline_request_bytes` decoded on gRPC's thread (ServerOptions), no batch delay (the
// binary's default; the struct's 200 us forbids inline steps).
inline ServerOptions LocalServerOptions(int64_t inline_request_bytes) {
  ServerOptions options;
  options.listen_addresses = {"127.0.0.1:0"};
  options.metrics_address = "";
  options.inline_request_bytes = inline_request_bytes;
  options.batcher.max_batch_delay = absl::ZeroDuration();
  return options;
}

inline std::string EncodeFloats(const std::vector<float>& v, v1::DType dtype) {
  std::string out;
  if (v.empty()) return out;  // (memcpy from an empty vector's null data is undefined)
  if (dtype == v1::DTYPE_FP32) {
    out.resize(v.size() * 4);
    std::memcpy(out.data(), v.data(), out.size());
  } else {
    std::vector<uint16_t> h(v.size());
    if (dtype == v1::DTYPE_BF16) {
      kernels::ConvertFp32ToBf16Ref(v.data(), h.data(), static_cast<int64_t>(v.size()));
    } else {
      kernels::ConvertFp32ToFp16Ref(v.data(), h.data(), static_cast<int64_t>(v.size()));
    }
    out.resize(h.size() * 2);
    std::memcpy(out.data(), h.data(), out.size());
  }
  return out;
}

inline std::vector<float> DecodeFloats(const std::string& bytes, v1::DType dtype) {
  std::vector<float> out;
  if (bytes.size() < 2) return out;
  if (dtype == v1::DTYPE_FP32) {
    out.resize(bytes.size() / 4);
    std::memcpy(out.data(), bytes.data(), out.size() * 4);
  } else {
    std::vector<uint16_t> h(bytes.size() / 2);
    std::memcpy(h.data(), bytes.data(), h.size() * 2);
    out.resize(h.size());
    if (dtype == v1::DTYPE_BF16) {
      kernels::ConvertBf16ToFp32Ref(h.data(), out.data(), static_cast<int64_t>(h.size()));
    } else {
      kernels::ConvertFp16ToFp32Ref(h.data(), out.data(), static_cast<int64_t>(h.size()));
    }
  }
  return out;
}

// The core dtype of a wire dtype (anything else: FP32).
inline DType CoreDType(int d) {
  switch (d) {
    case v1::DTYPE_BF16:
      return DType::kBF16;
    case v1::DTYPE_FP16:
      return DType::kFP16;
    case v1::DTYPE_INT32:
      return DType::kINT32;
    case v1::DTYPE_INT64:
      return DType::kINT64;
    default:
      return DType::kFP32;
  }
}

// `reference`'s answer to `request` (its tensors carrying data), as floats; a failed forward is
// a test failure (and an empty answer).
inline std::vector<float> ReferenceForward(Engine& reference, const v1::ForwardRequest& request) {
  const auto view = [](const v1::Tensor& t) {
    return TensorView(static_cast<const void*>(t.data().data()), CoreDType(t.dtype()),
                      Shape(t.shape().begin(), t.shape().end()));
  };
  ForwardInput in;
  in.layer = request.layer();
  in.hidden_states = view(request.hidden_states());
  in.topk_ids = view(request.topk_ids());
  in.topk_weights = view(request.topk_weights());
  Tensor out = Tensor::Empty(in.hidden_states.dtype(), in.hidden_states.shape());
  const absl::Status s = reference.Forward(in, out.view());
  EXPECT_TRUE(s.ok()) << s;
  if (!s.ok()) return {};
  return DecodeFloats(std::string(out.data<char>(), out.nbytes()), request.hidden_states().dtype());
}

// ||got - want|| / ||want||.
inline double RelativeL2(const std::vector<float>& got, const std::vector<float>& want) {
  return RelativeL2Error(got, want);
}

// A fresh random forward: hidden ~ N(0, 1), ids uniform in [0, num_experts) and distinct per
// token, weights positive and summing to 1 per token.
inline v1::ForwardRequest RandomRequest(std::mt19937_64& rng, int layer, int64_t m, int64_t hidden,
                                        int num_experts, int topk, v1::DType hidden_dtype,
                                        v1::DType ids_dtype) {
  v1::ForwardRequest r;
  r.set_layer(layer);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> x(m * hidden);
  for (float& v : x) v = normal(rng);
  r.mutable_hidden_states()->set_dtype(hidden_dtype);
  r.mutable_hidden_states()->add_shape(m);
  r.mutable_hidden_states()->add_shape(hidden);
  *r.mutable_hidden_states()->mutable_data() = EncodeFloats(x, hidden_dtype);

  std::vector<int64_t> ids(m * topk);
  std::vector<float> w(m * topk);
  std::uniform_real_distribution<float> uniform(0.05f, 1.f);
  std::vector<int> perm(num_experts);
  for (int64_t t = 0; t < m; ++t) {
    for (int e = 0; e < num_experts; ++e) perm[e] = e;
    std::shuffle(perm.begin(), perm.end(), rng);
    float sum = 0;
    for (int k = 0; k < topk; ++k) {
      ids[t * topk + k] = perm[k];
      w[t * topk + k] = uniform(rng);
      sum += w[t * topk + k];
    }
    for (int k = 0; k < topk; ++k) w[t * topk + k] /= sum;
  }
  v1::Tensor* ti = r.mutable_topk_ids();
  ti->set_dtype(ids_dtype);
  ti->add_shape(m);
  ti->add_shape(topk);
  if (ids_dtype == v1::DTYPE_INT64) {
    ti->mutable_data()->assign(reinterpret_cast<const char*>(ids.data()), ids.size() * 8);
  } else {
    std::vector<int32_t> ids32(ids.begin(), ids.end());
    ti->mutable_data()->assign(reinterpret_cast<const char*>(ids32.data()), ids32.size() * 4);
  }
  v1::Tensor* tw = r.mutable_topk_weights();
  tw->set_dtype(v1::DTYPE_FP32);
  tw->add_shape(m);
  tw->add_shape(topk);
  tw->mutable_data()->assign(reinterpret_cast<const char*>(w.data()), w.size() * 4);
  return r;
}

// GET http://127.0.0.1:port/metrics; empty on failure.
inline std::string HttpGetMetrics(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "";
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string response;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string req =
        "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\nAccept: text/plain\r\nConnection: "
        "close\r\n\r\n";
    if (send(fd, req.data(), req.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(req.size())) {
      char buf[8192];
      for (;;) {
        const ssize_t n = recv(fd, buf, sizeof(buf), 0);
        if (n <= 0) break;
        response.append(buf, n);
      }
    }
  }
  close(fd);
  return response;
}

// Sum of the samples named exactly `name` whose label set contains every `labels` item
// (each like `method="Forward"`); -1 if none is present.
inline double MetricValue(const std::string& text, const std::string& name,
                          const std::vector<std::string>& labels = {}) {
  double sum = 0;
  bool found = false;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (line.empty() || line[0] == '#') continue;
    if (!absl::StartsWith(line, name)) continue;
    const char next = line.size() > name.size() ? line[name.size()] : '\0';
    if (next != '{' && next != ' ') continue;
    const size_t space = line.rfind(' ');
    const absl::string_view head = line.substr(0, space);
    bool match = true;
    for (const std::string& l : labels) match = match && absl::StrContains(head, l);
    if (!match) continue;
    double v = 0;
    if (!absl::SimpleAtod(line.substr(space + 1), &v)) continue;
    sum += v;
    found = true;
  }
  return found ? sum : -1;
}

// The message's bytes cut at random into `pieces` slices, as gRPC may deliver them.
inline std::vector<grpc::Slice> RecutSlices(const grpc::ByteBuffer& buffer, int pieces,
                                            std::mt19937& rng) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buffer.Dump(&slices).ok());
  std::string all;
  for (const grpc::Slice& s : slices) {
    all.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  std::vector<size_t> cuts = {0, all.size()};
  std::uniform_int_distribution<size_t> at(1, all.size() - 1);
  for (int i = 1; i < pieces; ++i) cuts.push_back(at(rng));
  std::sort(cuts.begin(), cuts.end());
  std::vector<grpc::Slice> out;
  for (size_t i = 0; i + 1 < cuts.size(); ++i) {
    if (cuts[i + 1] > cuts[i]) out.emplace_back(all.data() + cuts[i], cuts[i + 1] - cuts[i]);
  }
  return out;
}

// A tensor header (dtype and shape, no data).
inline v1::Tensor TensorHeader(v1::DType dtype, std::initializer_list<int64_t> shape) {
  v1::Tensor t;
  t.set_dtype(dtype);
  for (int64_t d : shape) t.add_shape(d);
  return t;
}

}  // namespace moeserve::testing

#endif  // MOESERVE_TESTS_SERVER_TEST_UTIL_H_
