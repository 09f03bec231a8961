// Engine{backend=cuda} (CudaContext + DeviceWeightStore + CUDA no-EP PrepareAndFinalize +
// CudaExperts / CudaBatchedExperts on GPU 0) against Engine{backend=cpu, experts=reference},
// relative L2 < 1e-2 on BF16 outputs, for BF16 and MXFP8 weights. Without a GPU the cuda
// backend must be refused with FAILED_PRECONDITION and "auto" must pick cpu (those run in CI).
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/cuda/cuda_backend.h"
#include "core/cuda/cuda_grouped_experts.h"
#include "core/engine.h"
#include "core/provider_registry.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/dtype_convert.h"
#include "tests/engine/engine_test_util.h"

namespace moeserve {
namespace {

using ep_testing::Routing;
using ::testing::HasSubstr;

constexpr double kBf16Tolerance = 1e-2;

EngineOptions Small(const std::string& backend, const std::string& experts, WeightFormat wf) {
  EngineOptions o;
  o.model = *ApplyOverrides(
      *ModelPreset("tiny"),
      ModelOverrides{.num_experts = 32, .topk = 4, .hidden = 512, .intermediate = 192});
  o.backend = backend;
  o.experts = experts;
  o.weight_format = wf;
  o.seed = 11;
  o.num_threads = 2;
  o.max_tokens_per_request = 4096;
  return o;
}

// Small(...) on one GPU, one step in flight, steps of up to graph_max_tokens graphed.
EngineOptions GraphedOnOneGpu(const std::string& experts, WeightFormat wf,
                              int64_t graph_max_tokens) {
  EngineOptions o = Small("cuda", experts, wf);
  o.num_ranks = 1;
  o.steps_in_flight = 1;
  o.graph_max_tokens = graph_max_tokens;
  return o;
}

using ep_testing::Bf16ToFloats;
using ep_testing::ToBf16;

TEST(EngineCuda, RefusedOrAutoWithoutGpu) {
  if (CudaDeviceCount() > 0) GTEST_SKIP() << "a GPU is present";
  auto e = Engine::Create(Small("cuda", "blas", WeightFormat::kBF16));
  EXPECT_EQ(e.status().code(), absl::StatusCode::kFailedPrecondition) << e.status();
  EXPECT_THAT(e.status().message(), HasSubstr("no CUDA device"));
  auto a = Engine::Create(Small("auto", "blas", WeightFormat::kBF16));
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ((*a)->info().backend, "cpu");
  EXPECT_TRUE((*a)->healthy());
}

TEST(EngineCuda, BadBackendIsRefused) {
  auto e = Engine::Create(Small("tpu", "blas", WeightFormat::kBF16));
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(e.status().message(), HasSubstr("expected cpu, cuda or auto"));
}

TEST(EngineCuda, MatchesCpuReference) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  for (WeightFormat wf : {WeightFormat::kBF16, WeightFormat::kMXFP8}) {
    auto reference = Engine::Create(Small("cpu", "reference", wf));
    ASSERT_TRUE(reference.ok()) << reference.status();
    std::vector<std::string> names = {"blas", "batched_blas"};
    // Hopper: the grouped GEMM at every size too.
    if (CudaGroupedSm90Supported(0).ok()) {
      names.push_back("cuda_grouped_sm90");
    }
    for (const std::string& experts : names) {
      EngineOptions o = Small("cuda", experts, wf);
      o.num_ranks = 1;
      auto engine = Engine::Create(o);
      ASSERT_TRUE(engine.ok()) << engine.status();
      const EngineInfo& info = (*engine)->info();
      EXPECT_EQ(info.backend, "cuda");
      EXPECT_EQ(info.experts, experts == "blas"           ? "CudaExperts"
                              : experts == "batched_blas" ? "CudaBatchedExperts"
                                                          : "CudaGroupedSm90Experts");
      EXPECT_TRUE((*engine)->healthy());
      const ModelConfig& model = info.model;
      std::mt19937 rng(5);
      for (int64_t m : {1, 37, 512, 4096}) {
        for (Routing routing : {Routing::kUniform, Routing::kHotExpert}) {
          SCOPED_TRACE(absl::StrCat(WeightFormatName(wf), " ", experts, " M=", m, " ",
                                    ep_testing::RoutingName(routing)));
          const Tensor x = ToBf16(ep_testing::RandomNormal({m, model.hidden}, rng));
          const Tensor ids =
              ep_testing::MakeRouting(routing, m, model.topk, model.num_experts, {3, 4, 5, 6}, rng);
          const Tensor w = ep_testing::RandomTopkWeights(m, model.topk, rng);
          ForwardInput in{.layer = 1,
                          .hidden_states = x.view(),
                          .topk_ids = ids.view(),
                          .topk_weights = w.view()};
          Tensor got = Tensor::Empty(DType::kBF16, {m, model.hidden});
          Tensor want = Tensor::Empty(DType::kBF16, {m, model.hidden});
          ASSERT_TRUE((*engine)->Forward(in, got.view()).ok());
          ASSERT_TRUE((*reference)->Forward(in, want.view()).ok());
          const std::vector<float> g = Bf16ToFloats(got), r = Bf16ToFloats(want);
          EXPECT_LT(ep_testing::RelativeL2Error(g.data(), r.data(), g.size()), kBf16Tolerance);
        }
      }
    }
  }
}

// Two steps in flight (the default on one GPU): concurrent forwards from several threads run on
// two lanes (streams, buffers, workspaces) over shared weights; every answer matches the CPU
// reference, in every answer dtype, for both weight formats and both activation formats.
TEST(EngineCuda, StepsInFlightMatchCpuReference) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  for (WeightFormat wf : {WeightFormat::kBF16, WeightFormat::kMXFP8}) {
    auto reference = Engine::Create(Small("cpu", "reference", wf));
    ASSERT_TRUE(reference.ok()) << reference.status();
    for (const std::string experts : {"blas", "batched_blas"}) {
      EngineOptions o = Small("cuda", experts, wf);
      o.num_ranks = 1;
      auto engine = Engine::Create(o);
      ASSERT_TRUE(engine.ok()) << engine.status();
      ASSERT_EQ((*engine)->steps_in_flight(), 2);
      const ModelConfig& model = (*engine)->info().model;
      struct Case {
        Tensor x, ids, w, got, want;
        int layer;
      };
      std::vector<Case> cases;
      std::mt19937 rng(21);
      const DType dtypes[] = {DType::kBF16, DType::kFP16, DType::kFP32};
      for (int i = 0; i < 24; ++i) {
        const int64_t m = (i % 4 == 0) ? 1024 : 1 + (i * 37) % 200;
        Case c;
        c.layer = i % model.num_layers;
        Tensor f = ep_testing::RandomNormal({m, model.hidden}, rng);
        c.x = Tensor::Empty(dtypes[i % 3], {m, model.hidden});
        ASSERT_TRUE(ConvertTensor(f.view(), c.x.view()).ok());
        c.ids = ep_testing::MakeRouting(i % 2 ? Routing::kHotExpert : Routing::kUniform, m,
                                        model.topk, model.num_experts, {3, 4, 5, 6}, rng);
        c.w = ep_testing::RandomTopkWeights(m, model.topk, rng);
        c.got = Tensor::Empty(dtypes[i % 3], {m, model.hidden});
        c.want = Tensor::Empty(dtypes[i % 3], {m, model.hidden});
        cases.push_back(std::move(c));
      }
      std::vector<std::thread> threads;
      std::vector<absl::Status> statuses(cases.size());
      for (int t = 0; t < 4; ++t) {
        threads.emplace_back([&, t] {
          for (size_t i = t; i < cases.size(); i += 4) {
            const Case& c = cases[i];
            statuses[i] =
                (*engine)->Forward({c.layer, c.x.view(), c.ids.view(), c.w.view()}, c.got.view());
          }
        });
      }
      for (std::thread& t : threads) t.join();
      for (size_t i = 0; i < cases.size(); ++i) {
        SCOPED_TRACE(absl::StrCat(WeightFormatName(wf), " ", experts, " case ", i));
        ASSERT_TRUE(statuses[i].ok()) << statuses[i];
        const Case& c = cases[i];
        ASSERT_TRUE((*reference)
                        ->Forward({c.layer, c.x.view(), c.ids.view(), c.w.view()}, c.want.view())
                        .ok());
        Tensor g = Tensor::Empty(DType::kFP32, c.got.shape());
        Tensor r = Tensor::Empty(DType::kFP32, c.want.shape());
        ASSERT_TRUE(ConvertTensor(c.got.view(), g.view()).ok());
        ASSERT_TRUE(ConvertTensor(c.want.view(), r.view()).ok());
        EXPECT_LT(ep_testing::RelativeL2Error(g.data<float>(), r.data<float>(), g.numel()),
                  kBf16Tolerance);
      }
    }
  }
}

// CUDA graphs: steps of up to graph_max_tokens tokens are padded to a captured size and replayed.
// Every answer matches the CPU reference, over fresh inputs on every replay, every input dtype,
// alternating layers and routing, and after a larger eager step has grown (moved) the workspaces
// under the graphs captured before it.
// Staged copies of host inputs and answers on the SMs (the default at these sizes) and, with
// MOESERVE_GRAPH_SM_COPY_MAX_BYTES=0, on a copy engine.
TEST(EngineCuda, GraphReplayMatchesCpuReference) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  for (const char* sm_copy : {"default", "0"}) {
    if (std::string(sm_copy) == "0") {
      setenv("MOESERVE_GRAPH_SM_COPY_MAX_BYTES", "0", 1);
    } else {
      unsetenv("MOESERVE_GRAPH_SM_COPY_MAX_BYTES");
    }
    for (WeightFormat wf : {WeightFormat::kBF16, WeightFormat::kMXFP8}) {
      auto reference = Engine::Create(Small("cpu", "reference", wf));
      ASSERT_TRUE(reference.ok()) << reference.status();
      for (const std::string experts : {"cuda", "cuda_grouped_sm90"}) {
        if (experts == "cuda_grouped_sm90" && !CudaGroupedSm90Supported(0).ok()) continue;
        SCOPED_TRACE(absl::StrCat("SM copies up to ", sm_copy, " bytes"));
        auto engine = Engine::Create(GraphedOnOneGpu(experts, wf, 64));
        ASSERT_TRUE(engine.ok()) << engine.status();
        ASSERT_EQ((*engine)->info().graph_max_tokens, 64);
        const ModelConfig& model = (*engine)->info().model;
        std::mt19937 rng(wf == WeightFormat::kBF16 ? 5 : 6);
        const DType dtypes[] = {DType::kBF16, DType::kFP16, DType::kFP32};
        const int64_t sizes[] = {1, 3, 8, 9, 17, 64, 1, 3, 300, 3, 17, 64, 9, 1};
        int i = 0;
        for (int pass = 0; pass < 2; ++pass) {
          for (int64_t m : sizes) {
            SCOPED_TRACE(
                absl::StrCat(WeightFormatName(wf), " ", experts, " pass ", pass, " m=", m));
            const DType dtype = dtypes[i % 3];
            const int layer = i % model.num_layers;
            ++i;
            Tensor f = ep_testing::RandomNormal({m, model.hidden}, rng);
            Tensor x = Tensor::Empty(dtype, {m, model.hidden});
            ASSERT_TRUE(ConvertTensor(f.view(), x.view()).ok());
            Tensor ids = ep_testing::MakeRouting(i % 2 ? Routing::kHotExpert : Routing::kUniform, m,
                                                 model.topk, model.num_experts, {3, 4, 5, 6}, rng);
            Tensor w = ep_testing::RandomTopkWeights(m, model.topk, rng);
            Tensor got = Tensor::Empty(dtype, {m, model.hidden});
            Tensor want = Tensor::Empty(dtype, {m, model.hidden});
            ASSERT_TRUE(
                (*engine)->Forward({layer, x.view(), ids.view(), w.view()}, got.view()).ok());
            ASSERT_TRUE(
                (*reference)->Forward({layer, x.view(), ids.view(), w.view()}, want.view()).ok());
            Tensor g = Tensor::Empty(DType::kFP32, got.shape());
            Tensor r = Tensor::Empty(DType::kFP32, want.shape());
            ASSERT_TRUE(ConvertTensor(got.view(), g.view()).ok());
            ASSERT_TRUE(ConvertTensor(want.view(), r.view()).ok());
            EXPECT_LT(ep_testing::RelativeL2Error(g.data<float>(), r.data<float>(), g.numel()),
                      kBf16Tolerance);
          }
        }
        const GraphStats stats = (*engine)->graph_stats();
        EXPECT_TRUE(stats.disabled_reason.empty()) << stats.disabled_reason;
        EXPECT_EQ(stats.eager, 2);  // the two 300-token steps
        EXPECT_GT(stats.captures, 0);
        EXPECT_GT(stats.replays, 0);
        EXPECT_EQ(stats.replays + stats.captures + stats.eager, 2 * std::size(sizes));
      }
    }
  }
  unsetenv("MOESERVE_GRAPH_SM_COPY_MAX_BYTES");
}

// A timed graphed step replays a graph with event nodes between its stages, so prepare (the
// launch and the staged copy in), experts and finalize (the reduce and the copy out) are each
// measured, and within the step's host wall time; untimed steps replay a graph without them.
// Both answer as the CPU reference does.
TEST(EngineCuda, TimedGraphedStepsTimeEachStage) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  auto reference = Engine::Create(Small("cpu", "reference", WeightFormat::kBF16));
  ASSERT_TRUE(reference.ok()) << reference.status();
  auto engine = Engine::Create(GraphedOnOneGpu("cuda", WeightFormat::kBF16, 64));
  ASSERT_TRUE(engine.ok()) << engine.status();
  const ModelConfig& model = (*engine)->info().model;
  std::mt19937 rng(9);
  const int64_t m = 16;
  for (int step = 0; step < 6; ++step) {
    const bool timed = step % 2 == 0;
    SCOPED_TRACE(absl::StrCat("step ", step, timed ? " timed" : " untimed"));
    const Tensor x = ToBf16(ep_testing::RandomNormal({m, model.hidden}, rng));
    const Tensor ids = ep_testing::MakeRouting(Routing::kUniform, m, model.topk, model.num_experts,
                                               {3, 4, 5, 6}, rng);
    const Tensor w = ep_testing::RandomTopkWeights(m, model.topk, rng);
    Tensor got = Tensor::Empty(DType::kBF16, {m, model.hidden});
    Tensor want = Tensor::Empty(DType::kBF16, {m, model.hidden});
    ForwardTimings t;
    ASSERT_TRUE((*engine)
                    ->ForwardValidated({0, x.view(), ids.view(), w.view()}, got.view(), &t, nullptr,
                                       /*time_stages=*/timed)
                    .ok());
    ASSERT_TRUE((*reference)->Forward({0, x.view(), ids.view(), w.view()}, want.view()).ok());
    const std::vector<float> g = Bf16ToFloats(got), r = Bf16ToFloats(want);
    EXPECT_LT(ep_testing::RelativeL2Error(g.data(), r.data(), g.size()), kBf16Tolerance);
    EXPECT_EQ(t.stages_timed, timed);
    if (timed) {
      EXPECT_GT(t.stages.prepare_us, 0);
      EXPECT_GT(t.stages.experts_us, 0);
      EXPECT_GT(t.stages.finalize_us, 0);
      EXPECT_LE(t.stages.prepare_us + t.stages.experts_us + t.stages.finalize_us, t.engine_us);
    } else {
      EXPECT_EQ(t.stages.experts_us, 0);
    }
  }
  const GraphStats stats = (*engine)->graph_stats();
  EXPECT_TRUE(stats.disabled_reason.empty()) << stats.disabled_reason;
  EXPECT_EQ(stats.eager, 0);
  EXPECT_EQ(stats.captures, 2);  // the timed graph and the untimed one of 16 tokens
  EXPECT_EQ(stats.replays, 4);
}

// A device copy of a host tensor (freed with the object).
struct DeviceCopy {
  void* ptr = nullptr;
  TensorView view;
  explicit DeviceCopy(const TensorView& host) {
    cudaMalloc(&ptr, std::max<size_t>(host.nbytes(), 16));
    cudaMemcpy(ptr, host.raw_data(), host.nbytes(), cudaMemcpyHostToDevice);
    view = TensorView(ptr, host.dtype(), host.shape(), Device::Cuda(0));
  }
  ~DeviceCopy() { cudaFree(ptr); }
  Tensor ToHost() const {
    Tensor t = Tensor::Empty(view.dtype(), view.shape());
    cudaMemcpy(t.view().raw_data(), ptr, view.nbytes(), cudaMemcpyDeviceToHost);
    return t;
  }
};

// Routing in device memory (a client's CUDA region) is read and checked on the device, graphed
// (M <= 64 here) and eager (M = 300): the same answers as the CPU reference, and every bad value
// refused with the host check's own words, after which the engine still answers correctly.
TEST(EngineCuda, DeviceRoutingMatchesReferenceAndRefusesBadValues) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  auto reference = Engine::Create(Small("cpu", "reference", WeightFormat::kBF16));
  ASSERT_TRUE(reference.ok()) << reference.status();
  auto engine = Engine::Create(GraphedOnOneGpu("cuda", WeightFormat::kBF16, 64));
  ASSERT_TRUE(engine.ok()) << engine.status();
  ASSERT_TRUE((*engine)->info().device_routing);
  const ModelConfig& model = (*engine)->info().model;
  std::mt19937 rng(17);
  int i = 0;
  for (int64_t m : {1, 9, 64, 300, 9, 1, 300}) {
    for (bool device_x : {false, true}) {
      SCOPED_TRACE(absl::StrCat("m=", m, device_x ? " device" : " host", " hidden/output"));
      ++i;
      const Tensor x = ToBf16(ep_testing::RandomNormal({m, model.hidden}, rng));
      const Tensor ids = ep_testing::MakeRouting(i % 2 ? Routing::kHotExpert : Routing::kUniform, m,
                                                 model.topk, model.num_experts, {3, 4}, rng);
      const Tensor w = ep_testing::RandomTopkWeights(m, model.topk, rng);
      const DeviceCopy d_ids(ids.view()), d_w(w.view()), d_x(x.view());
      Tensor want = Tensor::Empty(DType::kBF16, {m, model.hidden});
      ASSERT_TRUE((*reference)
                      ->Forward({i % model.num_layers, x.view(), ids.view(), w.view()}, want.view())
                      .ok());
      Tensor zeros = Tensor::Empty(DType::kBF16, {m, model.hidden});
      std::memset(zeros.view().raw_data(), 0, zeros.nbytes());
      DeviceCopy d_out(zeros.view());
      Tensor host_out = Tensor::Empty(DType::kBF16, {m, model.hidden});
      const ForwardInput in{i % model.num_layers, device_x ? d_x.view : x.view(), d_ids.view,
                            d_w.view};
      const absl::Status s = (*engine)->Forward(in, device_x ? d_out.view : host_out.view());
      ASSERT_TRUE(s.ok()) << s;
      const Tensor got = device_x ? d_out.ToHost() : std::move(host_out);
      host_out = Tensor::Empty(DType::kBF16, {m, model.hidden});
      const std::vector<float> g = Bf16ToFloats(got), r = Bf16ToFloats(want);
      EXPECT_LT(ep_testing::RelativeL2Error(g.data(), r.data(), g.size()), kBf16Tolerance);

      // One bad value at a random route, each kind in turn; the next good call is right.
      std::uniform_int_distribution<int64_t> at(0, m * model.topk - 1);
      const int64_t route = at(rng);
      Tensor bad_ids =
          ep_testing::MakeRouting(Routing::kUniform, m, model.topk, model.num_experts, {0}, rng);
      Tensor bad_w = ep_testing::RandomTopkWeights(m, model.topk, rng);
      std::string want_message;
      const std::string where =
          absl::StrCat(" at [", route / model.topk, ", ", route % model.topk, "]");
      switch (i % 4) {
        case 0:
          bad_ids.data<int32_t>()[route] = model.num_experts;
          want_message = absl::StrCat("topk_ids: value ", model.num_experts, where,
                                      " is outside [0, ", model.num_experts, ")");
          break;
        case 1:
          bad_ids.data<int32_t>()[route] = -1;
          want_message = absl::StrCat("topk_ids: value -1", where, " is outside");
          break;
        case 2:
          bad_w.data<float>()[route] = std::nanf("");
          want_message = absl::StrCat("topk_weights: value nan", where, " is not finite");
          break;
        default:
          bad_w.data<float>()[route] = -2e4f;
          want_message = absl::StrCat("topk_weights: value -20000", where, " is outside");
      }
      const DeviceCopy d_bad_ids(bad_ids.view()), d_bad_w(bad_w.view());
      const absl::Status bad =
          (*engine)->Forward({in.layer, in.hidden_states, d_bad_ids.view, d_bad_w.view},
                             device_x ? d_out.view : host_out.view());
      EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument) << bad;
      EXPECT_THAT(bad.message(), HasSubstr(want_message));
      // The host check says the same.
      const absl::Status host_bad =
          (*engine)->Forward({in.layer, x.view(), bad_ids.view(), bad_w.view()}, host_out.view());
      EXPECT_THAT(host_bad.message(), HasSubstr(want_message));
    }
  }
  // Refusals that never reach the device: INT64 ids in device memory; ids and weights apart.
  const Tensor x = ToBf16(ep_testing::RandomNormal({4, model.hidden}, rng));
  const Tensor w = ep_testing::RandomTopkWeights(4, model.topk, rng);
  Tensor ids64 = Tensor::Empty(DType::kINT64, {4, model.topk});
  for (int64_t j = 0; j < ids64.numel(); ++j) ids64.data<int64_t>()[j] = j % model.num_experts;
  const DeviceCopy d_ids64(ids64.view()), d_w(w.view());
  Tensor out = Tensor::Empty(DType::kBF16, {4, model.hidden});
  absl::Status s = (*engine)->Forward({0, x.view(), d_ids64.view, d_w.view}, out.view());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("must be int32"));
  const Tensor ids =
      ep_testing::MakeRouting(Routing::kUniform, 4, model.topk, model.num_experts, {0}, rng);
  s = (*engine)->Forward({0, x.view(), ids.view(), d_w.view}, out.view());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("both in device memory"));
  EXPECT_TRUE((*engine)->healthy());
}

// A token count the providers cannot capture is refused when asked for explicitly; auto on the
// CPU means no graphs (this part runs in CI).
TEST(EngineCuda, GraphOptionsRefusedWithReason) {
  EngineOptions cpu = Small("cpu", "reference", WeightFormat::kBF16);
  cpu.graph_max_tokens = 16;
  auto refused = Engine::Create(cpu);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_THAT(refused.status().message(), HasSubstr("graph_max_tokens"));
  cpu.graph_max_tokens = -2;
  EXPECT_EQ(Engine::Create(cpu).status().code(), absl::StatusCode::kInvalidArgument);
  cpu.graph_max_tokens = -1;
  auto auto_cpu = Engine::Create(cpu);
  ASSERT_TRUE(auto_cpu.ok()) << auto_cpu.status();
  EXPECT_EQ((*auto_cpu)->info().graph_max_tokens, 0);
  if (CudaDeviceCount() == 0) return;
  // The batched PrepareAndFinalize sizes its buffers from host counts: it cannot be captured.
  EngineOptions batched = Small("cuda", "cuda_batched", WeightFormat::kBF16);
  batched.num_ranks = 1;
  batched.graph_max_tokens = 16;
  auto b = Engine::Create(batched);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument) << b.status();
  EXPECT_THAT(b.status().message(), HasSubstr("graph"));
  batched.graph_max_tokens = -1;
  auto b_auto = Engine::Create(batched);
  ASSERT_TRUE(b_auto.ok()) << b_auto.status();
  EXPECT_EQ((*b_auto)->info().graph_max_tokens, 0);
  EXPECT_FALSE((*b_auto)->info().no_graphs_reason.empty());
}

// The grouped GEMM's provider says why it cannot serve: no sm_90 device (or none at all; this
// part runs in CI).
TEST(EngineCuda, GroupedSm90ProviderRefusesWithReason) {
  const ExpertsProvider* p = ProviderRegistry::Global().FindExperts("cuda_grouped_sm90");
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(p->name, "CudaGroupedSm90Experts");
  EnginePlan plan;
  plan.model = Small("cuda", "cuda_grouped_sm90", WeightFormat::kBF16).model;
  plan.backend = Backend::kCuda;
  const absl::Status s = p->Supports(plan);
  if (CudaGroupedSm90Supported(0).ok()) {
    EXPECT_TRUE(s.ok()) << s;
  } else {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr("unavailable on CUDA device 0"));
  }
}

// W8A8 (cuda_w8a8): MXFP8 weights only; on BF16 weights the provider says so (runs in CI).
TEST(EngineCuda, W8A8ProviderRefusesBf16Weights) {
  const ExpertsProvider* p = ProviderRegistry::Global().FindExperts("cuda_w8a8");
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(p->name, "CudaW8A8Experts");
  EnginePlan plan;
  plan.model = Small("cuda", "cuda_w8a8", WeightFormat::kBF16).model;
  plan.backend = Backend::kCuda;
  plan.weights.format = WeightFormat::kBF16;
  const absl::Status s = p->Supports(plan);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("serves MXFP8 weights"));
  plan.weights.format = WeightFormat::kMXFP8;
  const absl::Status m = p->Supports(plan);
  if (CudaGroupedSm90Supported(0).ok()) {
    EXPECT_TRUE(m.ok()) << m;
  } else {
    EXPECT_EQ(m.code(), absl::StatusCode::kInvalidArgument) << m;
    EXPECT_THAT(m.message(), HasSubstr("unavailable on CUDA device 0"));
  }
}

// W8A8 through the engine, on both sides of its crossover (decode kernels at 1 token, the FP8
// grouped GEMM from its crossover), against the CPU reference. Tolerance: relative L2 <
// kW8A8Tolerance where the FP8 path ran (E4M3 activations; tests/cuda/cuda_experts_test.cc says
// why), the BF16 one below.
TEST(EngineCuda, W8A8MatchesCpuReference) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  if (!CudaGroupedSm90Supported(0).ok()) GTEST_SKIP() << CudaGroupedSm90Supported(0);
  constexpr double kW8A8Tolerance = 6e-2;
  auto reference = Engine::Create(Small("cpu", "reference", WeightFormat::kMXFP8));
  ASSERT_TRUE(reference.ok()) << reference.status();
  EngineOptions o = Small("cuda", "cuda_w8a8", WeightFormat::kMXFP8);
  o.num_ranks = 1;
  auto engine = Engine::Create(o);
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_EQ((*engine)->info().experts, "CudaW8A8Experts");
  const ModelConfig& model = (*engine)->info().model;
  std::mt19937 rng(7);
  for (int64_t m : {1, 37, 512, 4096}) {
    for (Routing routing : {Routing::kUniform, Routing::kHotExpert}) {
      SCOPED_TRACE(absl::StrCat("M=", m, " ", ep_testing::RoutingName(routing)));
      const Tensor x = ToBf16(ep_testing::RandomNormal({m, model.hidden}, rng));
      const Tensor ids =
          ep_testing::MakeRouting(routing, m, model.topk, model.num_experts, {3, 4, 5, 6}, rng);
      const Tensor w = ep_testing::RandomTopkWeights(m, model.topk, rng);
      ForwardInput in{
          .layer = 1, .hidden_states = x.view(), .topk_ids = ids.view(), .topk_weights = w.view()};
      Tensor got = Tensor::Empty(DType::kBF16, {m, model.hidden});
      Tensor want = Tensor::Empty(DType::kBF16, {m, model.hidden});
      ASSERT_TRUE((*engine)->Forward(in, got.view()).ok());
      ASSERT_TRUE((*reference)->Forward(in, want.view()).ok());
      const std::vector<float> g = Bf16ToFloats(got), r = Bf16ToFloats(want);
      const double err = ep_testing::RelativeL2Error(g.data(), r.data(), g.size());
      const bool fp8_path =
          m * model.topk >=
          CudaGroupedCrossoverRoutes(model.hidden, model.intermediate, WeightFormat::kMXFP8, true) *
              model.num_experts;
      EXPECT_LT(err, fp8_path ? kW8A8Tolerance : kBf16Tolerance);
      std::printf("w8a8 engine M=%lld %s rel_l2 %.5f (%s)\n", static_cast<long long>(m),
                  ep_testing::RoutingName(routing), err, fp8_path ? "fp8 grouped" : "decode");
    }
  }
}

// W8A8 inside CUDA graphs: steps of 150 and 200 tokens take the FP8 grouped GEMM (>= 17 routes
// per expert here) and are captured, then replayed; a larger eager step moves the workspaces, so
// they are captured again and replayed again. Answers within the W8A8 bound of the CPU
// reference, fresh inputs every time.
TEST(EngineCuda, W8A8GraphReplayMatchesCpuReference) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  if (!CudaGroupedSm90Supported(0).ok()) GTEST_SKIP() << CudaGroupedSm90Supported(0);
  auto reference = Engine::Create(Small("cpu", "reference", WeightFormat::kMXFP8));
  ASSERT_TRUE(reference.ok()) << reference.status();
  auto engine = Engine::Create(GraphedOnOneGpu("cuda_w8a8", WeightFormat::kMXFP8, 256));
  ASSERT_TRUE(engine.ok()) << engine.status();
  ASSERT_EQ((*engine)->info().graph_max_tokens, 256);
  const ModelConfig& model = (*engine)->info().model;
  std::mt19937 rng(8);
  const int64_t sizes[] = {200, 150, 200, 150, 1, 700, 200, 150, 200};
  for (size_t i = 0; i < std::size(sizes); ++i) {
    const int64_t m = sizes[i];
    SCOPED_TRACE(absl::StrCat("step ", i, " m=", m));
    const Tensor x = ToBf16(ep_testing::RandomNormal({m, model.hidden}, rng));
    const Tensor ids = ep_testing::MakeRouting(i % 2 ? Routing::kHotExpert : Routing::kUniform, m,
                                               model.topk, model.num_experts, {3, 4, 5, 6}, rng);
    const Tensor w = ep_testing::RandomTopkWeights(m, model.topk, rng);
    const int layer = 1;  // graphs are kept per layer
    Tensor got = Tensor::Empty(DType::kBF16, {m, model.hidden});
    Tensor want = Tensor::Empty(DType::kBF16, {m, model.hidden});
    ASSERT_TRUE((*engine)->Forward({layer, x.view(), ids.view(), w.view()}, got.view()).ok());
    ASSERT_TRUE((*reference)->Forward({layer, x.view(), ids.view(), w.view()}, want.view()).ok());
    const std::vector<float> g = Bf16ToFloats(got), r = Bf16ToFloats(want);
    EXPECT_LT(ep_testing::RelativeL2Error(g.data(), r.data(), g.size()),
              m == 1 ? kBf16Tolerance : 6e-2);
  }
  const GraphStats stats = (*engine)->graph_stats();
  EXPECT_TRUE(stats.disabled_reason.empty()) << stats.disabled_reason;
  EXPECT_EQ(stats.eager, 1);     // the 700-token step
  EXPECT_EQ(stats.replays, 3);   // steps 2, 3 and 8
  EXPECT_EQ(stats.captures, 5);  // 200, 150, 1; 200 and 150 again after the workspaces moved
}

TEST(EngineCuda, TooManyGpuRanksRefused) {
  const int n = CudaDeviceCount();
  if (n == 0) GTEST_SKIP() << "no CUDA device";
  EngineOptions o = Small("cuda", "blas", WeightFormat::kBF16);
  o.num_ranks = n * 2 <= 32 ? n * 2 : 32;
  if (o.num_ranks <= n) GTEST_SKIP();
  auto e = Engine::Create(o);
  EXPECT_EQ(e.status().code(), absl::StatusCode::kFailedPrecondition) << e.status();
  EXPECT_THAT(e.status().message(), HasSubstr("CUDA devices are visible"));
}

}  // namespace
}  // namespace moeserve
