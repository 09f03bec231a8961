// The server's own host work for one Forward call, without sockets or an engine: decoding the
// request (forward_wire), viewing its tensors (ForwardInputFromWire) and encoding the answer
// (EncodeForwardResponse), for requests of M tokens at H7168 BF16 with top-4 routing in one
// slice, as a client sends them. The peer, measured in the same run on the same bytes, is
// protobuf's own parse of the whole request (ParseFromString, which copies the tensor bytes) and
// its serialization of the whole answer.
//
//   handler_bench [--iters N] [--tokens 1,16,64] [--offset K] [--cold_bytes B] [--sleep_us U]
//
// --offset K puts the message at byte K of a 64-byte line (default: wherever std::string's bytes
// are), so that its tensors' bytes are aligned (viewed in place) or not (gathered) as chosen:
// gRPC's receive slices put them anywhere. --cold_bytes B writes B bytes of other memory and
// --sleep_us U sleeps before each iteration, as a server thread meets a call after other work.
//
// Prints per M: "handler tokens=.. decode_us=.. input_us=.. encode_us=.. protobuf_parse_us=..
// protobuf_serialize_us=.." (p50 over the iterations; the loop is warm, so these are the
// instruction costs unless --cold_bytes / --sleep_us: a server thread coming from its poll loop
// pays cache misses on top).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "moeserve/v1/forward_wire.h"
#include "moeserve/v1/moeserve.pb.h"
#include "server/convert.h"
#include "tests/benchmarks/transport/bench_flags.h"

namespace {

using Clock = std::chrono::steady_clock;
using ::moeserve::bench::ParseList;

double P50(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double Us(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::micro>(b - a).count();
}

// What a server thread meets between calls: other work through the caches (writing `scratch`)
// and a sleep (the core idles or runs something else).
void Unwarm(std::vector<uint8_t>* scratch, int sleep_us) {
  static uint8_t round = 0;
  ++round;
  for (size_t i = 0; i < scratch->size(); i += 64) (*scratch)[i] = round;
  if (sleep_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 20000;
  int64_t cold_bytes = 0;
  int sleep_us = 0;
  int offset = -1;
  std::vector<int64_t> tokens = {1, 16, 64};
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--iters") {
      iters = std::max(1, std::atoi(argv[i + 1]));
    } else if (flag == "--tokens") {
      tokens = ParseList(argv[i + 1]);
    } else if (flag == "--cold_bytes") {
      cold_bytes = std::max<int64_t>(0, std::atoll(argv[i + 1]));
    } else if (flag == "--offset") {
      offset = std::atoi(argv[i + 1]) & 63;
    } else if (flag == "--sleep_us") {
      sleep_us = std::max(0, std::atoi(argv[i + 1]));
    } else {
      std::fprintf(stderr,
                   "usage: handler_bench [--iters N] [--tokens 1,16,64] [--offset K] "
                   "[--cold_bytes B] [--sleep_us U]\n");
      return 2;
    }
  }
  namespace v1 = moeserve::v1;
  namespace v1wire = moeserve::v1wire;
  constexpr int64_t kHidden = 7168, kTopk = 4;
  std::mt19937 rng(7);
  std::vector<uint8_t> scratch(static_cast<size_t>(cold_bytes));
  for (const int64_t m : tokens) {
    std::vector<uint16_t> x(static_cast<size_t>(m * kHidden));
    for (auto& v : x) v = static_cast<uint16_t>(0x3c00 + (rng() & 0x3ff));
    std::vector<int32_t> ids(static_cast<size_t>(m * kTopk));
    std::vector<float> w(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) {
      ids[i] = static_cast<int32_t>(rng() % 16);
      w[i] = 0.25f;
    }
    v1::ForwardRequest h;
    h.set_layer(0);
    h.set_request_id("req-000123");
    h.set_return_timings(true);
    auto shape = [m](v1::Tensor* t, v1::DType dtype, int64_t cols) {
      t->set_dtype(dtype);
      t->add_shape(m);
      t->add_shape(cols);
    };
    shape(h.mutable_hidden_states(), v1::DTYPE_BF16, kHidden);
    shape(h.mutable_topk_ids(), v1::DTYPE_INT32, kTopk);
    shape(h.mutable_topk_weights(), v1::DTYPE_FP32, kTopk);
    const grpc::Slice sx(x.data(), x.size() * 2), si(ids.data(), ids.size() * 4),
        sw(w.data(), w.size() * 4);
    absl::StatusOr<grpc::ByteBuffer> encoded = v1wire::EncodeForwardRequest(h, sx, si, sw);
    std::vector<grpc::Slice> parts;
    if (!encoded.ok() || !encoded->Dump(&parts).ok()) return 1;
    // One slice, as a small request arrives.
    std::string wire;
    for (const grpc::Slice& p : parts)
      wire.append(reinterpret_cast<const char*>(p.begin()), p.size());
    // --offset: the message at this byte offset of a 64-byte line, so that the tensors' bytes
    // are aligned or not as chosen (gRPC's receive slices put them anywhere).
    std::vector<uint8_t> placed(wire.size() + 128);
    uint8_t* at = placed.data() + ((64 - reinterpret_cast<uintptr_t>(placed.data()) % 64) % 64) +
                  std::max(offset, 0);
    std::memcpy(at, wire.data(), wire.size());
    const grpc::Slice one = offset >= 0 ? grpc::Slice(at, wire.size(), grpc::Slice::STATIC_SLICE)
                                        : grpc::Slice(wire.data(), wire.size());
    const grpc::ByteBuffer request(&one, 1);
    v1::ForwardResponse full_answer;
    shape(full_answer.mutable_output(), v1::DTYPE_BF16, kHidden);
    full_answer.mutable_output()->set_data(x.data(), x.size() * 2);

    std::vector<double> decode, input, encode, pb_parse, pb_serialize;
    for (int it = 0; it < iters; ++it) {
      Unwarm(&scratch, sleep_us);
      const Clock::time_point t0 = Clock::now();
      absl::StatusOr<v1wire::ForwardRequestView> view = v1wire::DecodeForwardRequest(request);
      const Clock::time_point t1 = Clock::now();
      moeserve::GatheredBytes gathered;
      moeserve::ForwardRegions regions;
      absl::StatusOr<moeserve::ForwardInput> in =
          moeserve::ForwardInputFromWire(*view, &gathered, nullptr, false, &regions, false);
      const Clock::time_point t2 = Clock::now();
      v1::ForwardResponse answer;
      shape(answer.mutable_output(), v1::DTYPE_BF16, kHidden);
      answer.set_request_id(view->header.request_id());
      answer.mutable_timings()->set_total_us(50.5);
      answer.mutable_timings()->set_engine_us(30.25);
      absl::StatusOr<grpc::ByteBuffer> out = v1wire::EncodeForwardResponse(answer, sx);
      const Clock::time_point t3 = Clock::now();
      v1::ForwardRequest parsed;
      const bool parsed_ok = parsed.ParseFromString(wire);
      const Clock::time_point t4 = Clock::now();
      full_answer.set_request_id(parsed.request_id());
      const std::string serialized = full_answer.SerializeAsString();
      const Clock::time_point t5 = Clock::now();
      if (!view.ok() || !in.ok() || !out.ok() || !parsed_ok || serialized.empty() ||
          in->hidden_states.dim(0) != m) {
        std::fprintf(stderr, "handler_bench: a step failed at M=%lld\n", static_cast<long long>(m));
        return 1;
      }
      decode.push_back(Us(t0, t1));
      input.push_back(Us(t1, t2));
      encode.push_back(Us(t2, t3));
      pb_parse.push_back(Us(t3, t4));
      pb_serialize.push_back(Us(t4, t5));
    }
    std::printf(
        "handler tokens=%lld bytes=%zu decode_us=%.2f input_us=%.2f encode_us=%.2f "
        "protobuf_parse_us=%.2f protobuf_serialize_us=%.2f\n",
        static_cast<long long>(m), wire.size(), P50(decode), P50(input), P50(encode), P50(pb_parse),
        P50(pb_serialize));
  }
  return 0;
}
