// moeserve-mk-check: lists the provider registry, or reports whether a PrepareAndFinalize and an
// Experts can be combined (ResolveEngineConfig: each provider's Supports and the pair's formats)
// and, if so, runs one forward of the pair at R ranks against the single-rank CPU
// ReferenceExperts; --profile times the stages of one forward instead. Flags are spelled as the
// server's (moeserve --help); the old --pf-type / --experts-type / dashed spellings still work.
//
//   moeserve-mk-check --list
//   moeserve-mk-check --prepare_finalize=all2all_batched --experts=batched_blas --ranks=4
//   moeserve-mk-check --prepare_finalize=AllToAllContiguous --experts=BlasExperts --ranks=16
//       --tokens=256 --profile   (one command line)
//
// Exit status: 0 listed, or compatible and correct (or profiled), 1 incompatible, 2 mismatch,
// 3 bad usage or runtime error.
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "core/engine.h"
#include "core/provider_registry.h"
#include "tests/ep/ep_test_util.h"

ABSL_FLAG(bool, list, false, "Print every provider with its capabilities and exit");
ABSL_FLAG(std::string, backend, "cpu", "Backend: cpu, cuda or auto");
ABSL_FLAG(std::string, prepare_finalize, "auto",
          "PrepareAndFinalize: a name or alias from --list, or auto");
ABSL_FLAG(std::string, experts, "blas", "Experts: a name or alias from --list");
ABSL_FLAG(int32_t, ranks, 1, "Expert-parallel ranks");
ABSL_FLAG(int64_t, tokens, 64, "Tokens in the forward (M)");
ABSL_FLAG(int32_t, num_experts, 512, "Experts (E)");
ABSL_FLAG(int32_t, topk, 8, "Experts per token");
ABSL_FLAG(int64_t, hidden, 64, "Hidden size");
ABSL_FLAG(int64_t, intermediate, 32, "Intermediate size");
ABSL_FLAG(std::string, routing, "uniform", "uniform, balanced_affine or hot_expert");
ABSL_FLAG(std::string, placement, "contiguous", "Experts over ranks: contiguous or round_robin");
ABSL_FLAG(int64_t, max_tokens_per_rank, 0, "Tokens per rank per dispatch round (0: automatic)");
ABSL_FLAG(int32_t, threads, 0, "Compute threads (0: all cores)");
ABSL_FLAG(bool, profile, false, "Time the stages instead of checking against the reference");
ABSL_FLAG(int32_t, iters, 3, "Forwards to run with --profile");

namespace moeserve {
namespace {

std::string Aliases(const std::vector<std::string>& aliases) {
  return aliases.empty() ? "-" : absl::StrJoin(aliases, ",");
}

void List(const ProviderRegistry& registry) {
  std::printf("%-18s %-34s %-20s %-8s %-15s %-4s %s\n", "kind", "name", "aliases", "backend",
              "format", "ep", "notes");
  for (const PrepareFinalizeProvider* p : registry.prepare_finalizes()) {
    std::printf("%-18s %-34s %-20s %-8s %-15s %-4s %s\n", "prepare_finalize", p->name.c_str(),
                Aliases(p->aliases).c_str(), std::string(BackendName(p->backend)).c_str(),
                std::string(ActivationFormatName(p->format)).c_str(), p->supports_ep ? "yes" : "no",
                "");
  }
  for (const ExpertsProvider* p : registry.experts()) {
    std::printf("%-18s %-34s %-20s %-8s %-15s %-4s %s\n", "experts", p->name.c_str(),
                Aliases(p->aliases).c_str(), std::string(BackendName(p->backend)).c_str(),
                std::string(ActivationFormatName(p->format)).c_str(), p->supports_ep ? "yes" : "no",
                p->reference ? "reference" : "");
  }
  for (Backend b : {Backend::kCpu, Backend::kCuda}) {
    const BackendProvider* backend = registry.FindBackend(b);
    if (backend == nullptr) continue;
    std::printf("%-18s %-34s devices %d, multi-process %s\n", "backend",
                std::string(BackendName(b)).c_str(),
                backend->visible_devices ? backend->visible_devices() : 0,
                backend->new_collective_id ? "yes" : "no");
  }
}

// The old spellings: --pf-type, --experts-type and dashes for underscores.
std::vector<char*> Respell(int argc, char** argv, std::vector<std::string>* storage) {
  storage->reserve(argc);
  std::vector<char*> out;
  for (int i = 0; i < argc; ++i) {
    std::string a = argv[i];
    if (i > 0 && a.rfind("--", 0) == 0) {
      const size_t eq = a.find('=');
      std::string name = a.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
      const std::string rest = eq == std::string::npos ? "" : a.substr(eq);
      if (name == "pf-type") name = "prepare_finalize";
      if (name == "experts-type") name = "experts";
      a = absl::StrCat("--", absl::StrReplaceAll(name, {{"-", "_"}}), rest);
    }
    storage->push_back(a);
    out.push_back(storage->back().data());
  }
  return out;
}

int Main() {
  const ProviderRegistry& registry = ProviderRegistry::Global();
  if (absl::GetFlag(FLAGS_list)) {
    List(registry);
    return 0;
  }
  EngineOptions o;
  o.model.name = "mk-check";
  o.model.num_layers = 1;
  o.model.num_experts = absl::GetFlag(FLAGS_num_experts);
  o.model.topk = absl::GetFlag(FLAGS_topk);
  o.model.hidden = absl::GetFlag(FLAGS_hidden);
  o.model.intermediate = absl::GetFlag(FLAGS_intermediate);
  o.backend = absl::GetFlag(FLAGS_backend);
  o.prepare_finalize = absl::GetFlag(FLAGS_prepare_finalize);
  o.experts = absl::GetFlag(FLAGS_experts);
  o.num_ranks = absl::GetFlag(FLAGS_ranks);
  o.placement = absl::GetFlag(FLAGS_placement);
  o.num_threads = absl::GetFlag(FLAGS_threads);
  const int64_t m = absl::GetFlag(FLAGS_tokens);
  o.max_tokens_per_request = std::max<int64_t>(m, 1);
  o.max_tokens_per_rank = absl::GetFlag(FLAGS_max_tokens_per_rank);
  o.seed = 1;
  const std::string routing_name = absl::GetFlag(FLAGS_routing);
  const int ranks = o.num_ranks;

  // Unknown names are usage errors; a refusal of the combination is an incompatibility.
  if ((o.prepare_finalize != "auto" &&
       registry.FindPrepareFinalize(o.prepare_finalize) == nullptr) ||
      registry.FindExperts(o.experts) == nullptr) {
    std::fprintf(stderr, "error: unknown provider name; moeserve-mk-check --list prints them\n");
    return 3;
  }
  const BackendProvider* gpu = registry.FindBackend(Backend::kCuda);
  absl::StatusOr<EnginePlan> plan = ResolveEngineConfig(
      o, registry, gpu != nullptr && gpu->visible_devices ? gpu->visible_devices() : 0);
  if (!plan.ok()) {
    if (plan.status().code() != absl::StatusCode::kInvalidArgument) {
      std::fprintf(stderr, "error: %s\n", plan.status().ToString().c_str());
      return 3;
    }
    std::printf("INCOMPATIBLE at %d ranks: %s\n", ranks,
                std::string(plan.status().message()).c_str());
    return 1;
  }
  for (const std::string& name : {plan->prepare_finalize, plan->experts}) {
    const PrepareFinalizeProvider* pf = registry.FindPrepareFinalize(name);
    const ExpertsProvider* ex = registry.FindExperts(name);
    const Backend backend = pf ? pf->backend : ex->backend;
    const ActivationFormat format = pf ? pf->format : ex->format;
    std::printf("%s: backend %s, format %s, expert parallelism %s\n", name.c_str(),
                std::string(BackendName(backend)).c_str(),
                std::string(ActivationFormatName(format)).c_str(),
                (pf ? pf->supports_ep : ex->supports_ep) ? "yes" : "no");
  }
  std::printf("compatible at %d ranks\n", ranks);
  const bool gpu_pair = plan->backend == Backend::kCuda;
  const int64_t hidden = o.model.hidden;
  const int topk = o.model.topk, num_experts = o.model.num_experts;

  auto routing = ep_testing::ParseRouting(routing_name);
  if (!routing.ok()) {
    std::fprintf(stderr, "error: %s\n", routing.status().ToString().c_str());
    return 3;
  }
  auto engine = Engine::Create(o);
  if (!engine.ok()) {
    std::fprintf(stderr, "error: %s\n", engine.status().ToString().c_str());
    return 3;
  }
  const EngineInfo& info = (*engine)->info();
  std::mt19937 rng(std::random_device{}());
  const Tensor x = ep_testing::RandomNormal({m, hidden}, rng);
  const Tensor ids = ep_testing::MakeRouting(*routing, m, topk, num_experts,
                                             info.rank_experts[info.num_ranks - 1], rng);
  const Tensor w = ep_testing::RandomTopkWeights(m, topk, rng);
  ForwardInput in{
      .layer = 0, .hidden_states = x.view(), .topk_ids = ids.view(), .topk_weights = w.view()};
  Tensor out = Tensor::Empty(DType::kFP32, {m, hidden});

  if (absl::GetFlag(FLAGS_profile)) {
    ForwardTimings t;
    for (int i = 0; i < std::max(1, absl::GetFlag(FLAGS_iters)); ++i) {
      if (absl::Status s = (*engine)->Forward(in, out.view(), &t); !s.ok()) {
        std::fprintf(stderr, "error: %s\n", s.ToString().c_str());
        return 3;
      }
    }
    std::printf("profile (last of %d forwards), M=%lld, %s routing, %d threads per rank:\n",
                std::max(1, absl::GetFlag(FLAGS_iters)), static_cast<long long>(m),
                routing_name.c_str(), info.threads_per_rank);
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
  ro.backend = "cpu";
  ro.prepare_finalize = "no_ep";
  ro.experts = "reference";
  ro.num_ranks = 1;
  ro.max_tokens_per_rank = 0;
  auto reference = Engine::Create(ro);
  if (!reference.ok()) {
    std::fprintf(stderr, "error: %s\n", reference.status().ToString().c_str());
    return 3;
  }
  Tensor want = Tensor::Empty(DType::kFP32, {m, hidden});
  absl::Status s = (*engine)->Forward(in, out.view());
  if (s.ok()) s = (*reference)->Forward(in, want.view());
  if (!s.ok()) {
    std::fprintf(stderr, "error: %s\n", s.ToString().c_str());
    return 3;
  }
  const double err = ep_testing::RelativeL2Error(out.data<float>(), want.data<float>(), m * hidden);
  const double tol = gpu_pair ? 1e-2 : 1e-5;  // BF16 activations on GPUs
  std::printf(
      "M=%lld %s routing: relative L2 error vs ReferenceExperts %.3g (tolerance %.0e): %s\n",
      static_cast<long long>(m), routing_name.c_str(), err, tol, err <= tol ? "OK" : "FAIL");
  return err <= tol ? 0 : 2;
}

}  // namespace
}  // namespace moeserve

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Checks a PrepareAndFinalize x Experts pair against the reference, or lists the "
      "providers.\n  moeserve-mk-check --list\n"
      "  moeserve-mk-check --prepare_finalize=all2all_batched --experts=batched_blas --ranks=4");
  std::vector<std::string> storage;
  std::vector<char*> args = moeserve::Respell(argc, argv, &storage);
  absl::ParseCommandLine(static_cast<int>(args.size()), args.data());
  return moeserve::Main();
}
