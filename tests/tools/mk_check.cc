// moeserve-mk-check: reports whether a PrepareAndFinalize and an Experts type can be combined
// (core's CheckCompatible) and, if so, runs one forward of the pair at R ranks against the
// single-rank ReferenceExperts; --profile times the stages of one forward instead.
//
//   moeserve-mk-check --pf-type AllToAllBatched --experts-type BatchedBlasExperts --ranks 4
//   moeserve-mk-check --pf-type AllToAllContiguous --experts-type BlasExperts --ranks 16 \
//       --tokens 256 --profile
//
// Exit status: 0 compatible and correct (or profiled), 1 incompatible, 2 mismatch, 3 bad usage
// or runtime error.
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/comm/in_process_communicator.h"
#include "core/cpu/kernel_factory.h"
#include "core/engine.h"
#include "tests/ep/ep_test_util.h"

namespace moeserve {
namespace {

struct Flags {
  std::string pf_type, experts_type, routing = "uniform", placement = "contiguous";
  int ranks = 1, experts = 512, topk = 8, threads = 0, iters = 3;
  int64_t hidden = 64, intermediate = 32, tokens = 64, max_tokens_per_rank = 0;
  bool profile = false, per_route = false;
};

void Usage() {
  std::fprintf(stderr,
               "usage: moeserve-mk-check --pf-type X --experts-type Y [--ranks R] [--tokens M]\n"
               "  [--num-experts E] [--topk K] [--hidden H] [--intermediate I]\n"
               "  [--routing uniform|balanced_affine|hot_expert] [--placement contiguous|"
               "round_robin]\n"
               "  [--max-tokens-per-rank T] [--threads N] [--profile [--iters N]]\n"
               "pf types: %s\nexperts types: %s\n",
               absl::StrJoin(PrepareFinalizeTypes(), ", ").c_str(),
               absl::StrJoin(ExpertsTypes(), ", ").c_str());
}

bool ParseFlags(int argc, char** argv, Flags* f) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&](auto* out) {
      if (i + 1 >= argc) return false;
      const std::string v = argv[++i];
      if constexpr (std::is_same_v<std::remove_pointer_t<decltype(out)>, std::string>) {
        *out = v;
        return true;
      } else {
        return absl::SimpleAtoi(v, out);
      }
    };
    bool ok = true;
    if (a == "--pf-type")
      ok = next(&f->pf_type);
    else if (a == "--experts-type")
      ok = next(&f->experts_type);
    else if (a == "--ranks")
      ok = next(&f->ranks);
    else if (a == "--tokens")
      ok = next(&f->tokens);
    else if (a == "--num-experts")
      ok = next(&f->experts);
    else if (a == "--topk")
      ok = next(&f->topk);
    else if (a == "--hidden")
      ok = next(&f->hidden);
    else if (a == "--intermediate")
      ok = next(&f->intermediate);
    else if (a == "--routing")
      ok = next(&f->routing);
    else if (a == "--placement")
      ok = next(&f->placement);
    else if (a == "--max-tokens-per-rank")
      ok = next(&f->max_tokens_per_rank);
    else if (a == "--threads")
      ok = next(&f->threads);
    else if (a == "--iters")
      ok = next(&f->iters);
    else if (a == "--profile")
      f->profile = true;
    else if (a == "--help" || a == "-h")
      return false;
    else
      ok = false;
    if (!ok) {
      std::fprintf(stderr, "bad flag or value: %s\n", a.c_str());
      return false;
    }
  }
  return !f->pf_type.empty() && !f->experts_type.empty();
}

int Main(int argc, char** argv) {
  Flags f;
  if (!ParseFlags(argc, argv, &f)) {
    Usage();
    return 3;
  }
  // Compatibility, from instances built for R ranks.
  absl::Status compat;
  {
    auto group = InProcessCommGroup::Create(std::max(1, f.ranks), absl::Seconds(10));
    auto placement = group.ok() ? Placement::ByName(f.placement, f.experts, f.ranks)
                                : absl::StatusOr<Placement>(group.status());
    if (!placement.ok()) {
      std::fprintf(stderr, "error: %s\n", placement.status().ToString().c_str());
      return 3;
    }
    PrepareFinalizeConfig config;
    config.comm = (*group)->MakeCommunicator(0);
    config.placement = std::make_shared<const Placement>(*placement);
    config.max_num_tokens_per_rank = 64;
    auto pf = MakePrepareAndFinalize(f.pf_type, config);
    auto experts = MakeExperts(f.experts_type, 1);
    if (!experts.ok()) {
      std::fprintf(stderr, "error: %s\n", experts.status().ToString().c_str());
      return 3;
    }
    compat = pf.ok() ? CheckCompatible(**pf, **experts) : pf.status();
    if (pf.ok()) {
      std::printf("%s: format %s, %d dispatchers\n", std::string((*pf)->name()).c_str(),
                  std::string(ActivationFormatName((*pf)->activation_format())).c_str(),
                  (*pf)->num_dispatchers());
    }
    const ActivationFormats formats = (*experts)->activation_formats();
    std::printf("%s: format %s, expert map %s, weight-and-reduce %s\n",
                std::string((*experts)->name()).c_str(),
                std::string(ActivationFormatName(formats.input)).c_str(),
                (*experts)->supports_expert_map() ? "yes" : "no",
                std::string((*experts)->FinalizeWeightAndReduceImpl()->name()).c_str());
  }
  if (!compat.ok()) {
    std::printf("INCOMPATIBLE at %d ranks: %s\n", f.ranks, std::string(compat.message()).c_str());
    return 1;
  }
  std::printf("compatible at %d ranks\n", f.ranks);

  auto routing = ep_testing::ParseRouting(f.routing);
  if (!routing.ok()) {
    std::fprintf(stderr, "error: %s\n", routing.status().ToString().c_str());
    return 3;
  }
  EngineOptions o;
  o.model.name = "mk-check";
  o.model.num_layers = 1;
  o.model.num_experts = f.experts;
  o.model.topk = f.topk;
  o.model.hidden = f.hidden;
  o.model.intermediate = f.intermediate;
  o.prepare_finalize = f.pf_type;
  o.experts = f.experts_type;
  o.num_ranks = f.ranks;
  o.placement = f.placement;
  o.num_threads = f.threads;
  o.max_tokens_per_request = std::max<int64_t>(f.tokens, 1);
  o.max_tokens_per_rank = f.max_tokens_per_rank;
  o.seed = 1;
  auto engine = Engine::Create(o);
  if (!engine.ok()) {
    std::fprintf(stderr, "error: %s\n", engine.status().ToString().c_str());
    return 3;
  }
  const EngineInfo& info = (*engine)->info();
  std::mt19937 rng(std::random_device{}());
  const int64_t m = f.tokens;
  const Tensor x = ep_testing::RandomNormal({m, f.hidden}, rng);
  const Tensor ids = ep_testing::MakeRouting(*routing, m, f.topk, f.experts,
                                             info.rank_experts[info.num_ranks - 1], rng);
  const Tensor w = ep_testing::RandomTopkWeights(m, f.topk, rng);
  ForwardInput in{
      .layer = 0, .hidden_states = x.view(), .topk_ids = ids.view(), .topk_weights = w.view()};
  Tensor out = Tensor::Empty(DType::kFP32, {m, f.hidden});

  if (f.profile) {
    ForwardTimings t;
    for (int i = 0; i < std::max(1, f.iters); ++i) {
      if (absl::Status s = (*engine)->Forward(in, out.view(), &t); !s.ok()) {
        std::fprintf(stderr, "error: %s\n", s.ToString().c_str());
        return 3;
      }
    }
    std::printf("profile (last of %d forwards), M=%lld, %s routing, %d threads per rank:\n",
                std::max(1, f.iters), static_cast<long long>(m), f.routing.c_str(),
                info.threads_per_rank);
    std::printf("%6s %12s %12s %12s %7s %14s %14s\n", "rank", "prepare_us", "experts_us",
                "finalize_us", "chunks", "dispatch_B", "combine_B");
    for (size_t r = 0; r < t.rank_stages.size(); ++r) {
      const StageTimings& s = t.rank_stages[r];
      std::printf("%6zu %12.1f %12.1f %12.1f %7lld %14lld %14lld\n", r, s.prepare_us, s.experts_us,
                  s.finalize_us, static_cast<long long>(s.num_chunks),
                  static_cast<long long>(s.transfer.dispatch_bytes_sent),
                  static_cast<long long>(s.transfer.combine_bytes_sent));
    }
    std::printf("%6s %12.1f %12.1f %12.1f %7lld %14lld %14lld\n", "max/sum", t.stages.prepare_us,
                t.stages.experts_us, t.stages.finalize_us,
                static_cast<long long>(t.stages.num_chunks),
                static_cast<long long>(t.stages.transfer.dispatch_bytes_sent),
                static_cast<long long>(t.stages.transfer.combine_bytes_sent));
    return 0;
  }

  EngineOptions ro = o;
  ro.prepare_finalize = "no_ep";
  ro.experts = "reference";
  ro.num_ranks = 1;
  ro.max_tokens_per_rank = 0;
  auto reference = Engine::Create(ro);
  if (!reference.ok()) {
    std::fprintf(stderr, "error: %s\n", reference.status().ToString().c_str());
    return 3;
  }
  Tensor want = Tensor::Empty(DType::kFP32, {m, f.hidden});
  absl::Status s = (*engine)->Forward(in, out.view());
  if (s.ok()) s = (*reference)->Forward(in, want.view());
  if (!s.ok()) {
    std::fprintf(stderr, "error: %s\n", s.ToString().c_str());
    return 3;
  }
  const double err =
      ep_testing::RelativeL2Error(out.data<float>(), want.data<float>(), m * f.hidden);
  const double tol = 1e-5;
  std::printf(
      "M=%lld %s routing: relative L2 error vs ReferenceExperts %.3g (tolerance %.0e): %s\n",
      static_cast<long long>(m), f.routing.c_str(), err, tol, err <= tol ? "OK" : "FAIL");
  return err <= tol ? 0 : 2;
}

}  // namespace
}  // namespace moeserve

int main(int argc, char** argv) { return moeserve::Main(argc, argv); }
