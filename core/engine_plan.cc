#include "core/engine_plan.h"

#include <algorithm>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/provider_registry.h"
#include "core/status_macros.h"

namespace moeserve {
namespace {

absl::Status Invalid(absl::string_view message) { return absl::InvalidArgumentError(message); }

// The Experts that serves `named` on `backend`: itself, or (a CPU name on another backend) that
// backend's Experts of the same activation format, preferring one that is not a reference.
const ExpertsProvider* ExpertsOn(const ProviderRegistry& registry, const ExpertsProvider& named,
                                 Backend backend) {
  if (named.backend == backend) return &named;
  const ExpertsProvider* found = nullptr;
  for (const ExpertsProvider* p : registry.experts()) {
    if (p->backend != backend || p->format != named.format) continue;
    if (found == nullptr || (found->reference && !p->reference)) found = p;
  }
  return found;
}

// Likewise for a PrepareAndFinalize: same EP support; format its own, except a no-EP one, which
// takes the Experts' (a local copy can build either layout).
const PrepareFinalizeProvider* PrepareFinalizeOn(const ProviderRegistry& registry,
                                                 const PrepareFinalizeProvider& named,
                                                 Backend backend, ActivationFormat experts_format) {
  if (named.backend == backend) return &named;
  const ActivationFormat format = named.supports_ep ? named.format : experts_format;
  for (const PrepareFinalizeProvider* p : registry.prepare_finalizes()) {
    if (p->backend == backend && p->supports_ep == named.supports_ep && p->format == format) {
      return p;
    }
  }
  return nullptr;
}

// "; use AllToAllContiguous (all2all_contiguous) or AllToAllBatched (all2all_batched)".
std::string EpChoices(const ProviderRegistry& registry, Backend backend) {
  std::vector<std::string> choices;
  for (const PrepareFinalizeProvider* p : registry.prepare_finalizes()) {
    if (p->backend != backend || !p->supports_ep) continue;
    choices.push_back(p->aliases.empty() ? p->name
                                         : absl::StrCat(p->name, " (", p->aliases[0], ")"));
  }
  if (choices.empty()) return "";
  const std::string last = choices.back();
  choices.pop_back();
  return absl::StrCat("; use ", absl::StrJoin(choices, ", "), choices.empty() ? "" : " or ", last);
}

// Backend "auto": the GPU where one is visible and the GPU providers serve these options;
// a reference oracle stays on the CPU, where it is the oracle. `why_cpu` (optional) says why
// the CPU was chosen.
Backend ChooseBackend(const EngineOptions& options, const ProviderRegistry& registry,
                      int visible_gpus, std::string* why_cpu = nullptr) {
  auto cpu = [why_cpu](std::string why) {
    if (why_cpu != nullptr) *why_cpu = std::move(why);
    return Backend::kCpu;
  };
  if (visible_gpus <= 0) return cpu("no CUDA device is visible");
  if (registry.FindBackend(Backend::kCuda) == nullptr) return cpu("this build has no CUDA");
  const ExpertsProvider* named = registry.FindExperts(options.experts);
  if (named != nullptr && named->reference) return cpu("a reference oracle runs on the CPU");
  EnginePlan probe;
  probe.model = options.model;
  probe.backend = Backend::kCuda;
  probe.weights.format = options.weight_format;
  if (named != nullptr) {
    const ExpertsProvider* cuda = ExpertsOn(registry, *named, Backend::kCuda);
    if (cuda == nullptr) return cpu(absl::StrCat(named->name, " has no GPU counterpart"));
    const absl::Status s = cuda->Supports(probe);
    if (!s.ok()) return cpu(std::string(s.message()));
  } else {
    // An unknown name: refused on the GPU as on the CPU; the GPU if any GPU Experts serves.
    for (const ExpertsProvider* p : registry.experts()) {
      if (p->backend == Backend::kCuda && p->Supports(probe).ok()) return Backend::kCuda;
    }
    return cpu("no GPU Experts serves this model");
  }
  return Backend::kCuda;
}

}  // namespace

absl::string_view BackendName(Backend backend) {
  return backend == Backend::kCuda ? "cuda" : "cpu";
}

absl::StatusOr<EnginePlan> ResolveEngineConfig(const EngineOptions& options,
                                               const ProviderRegistry& registry, int visible_gpus) {
  EnginePlan plan;
  plan.model = options.model;
  MOESERVE_RETURN_IF_ERROR(plan.model.Validate());

  // Backend.
  std::string why_cpu = "backend cpu was asked for";
  if (options.backend == "auto") {
    plan.backend = ChooseBackend(options, registry, visible_gpus, &why_cpu);
    why_cpu = absl::StrCat("backend auto chose cpu: ", why_cpu);
  } else if (options.backend == "cpu") {
    plan.backend = Backend::kCpu;
  } else if (options.backend == "cuda") {
    plan.backend = Backend::kCuda;
  } else {
    return Invalid(
        absl::StrCat("backend: got '", options.backend, "', expected cpu, cuda or auto"));
  }
  const bool cuda = plan.backend == Backend::kCuda;
  int num_ranks = options.num_ranks;
  if (cuda) {
    if (registry.FindBackend(Backend::kCuda) == nullptr) {
      // The CUDA backend registers itself from core_cuda (moeserve_backends).
      return absl::FailedPreconditionError(
          "backend 'cuda': this moeserve was built without CUDA (MOESERVE_ENABLE_CUDA=OFF); use "
          "--backend cpu");
    }
    if (visible_gpus == 0) {
      return absl::FailedPreconditionError(
          "backend 'cuda': no CUDA device is visible (no GPU or no driver); use --backend cpu");
    }
    if (num_ranks == 0) num_ranks = visible_gpus;
    if (num_ranks > visible_gpus) {
      return absl::FailedPreconditionError(
          absl::StrCat("num_ranks: ", num_ranks, " GPU ranks requested but ", visible_gpus,
                       " CUDA devices are visible (backend cuda runs one rank per GPU)"));
    }
    if (plan.model.hidden % 8 != 0) {
      return Invalid(
          absl::StrCat("backend 'cuda' needs hidden % 8 == 0, got hidden=", plan.model.hidden));
    }
  } else if (num_ranks == 0) {
    num_ranks = 1;
  }

  // Ranks: `world` over all processes, `num_ranks` of them here.
  const int world = options.world_size > 0 ? options.world_size : num_ranks;
  plan.local_ranks = num_ranks;
  plan.world_size = world;
  plan.multi_process = world != num_ranks;
  if (num_ranks < 1 || world > plan.model.num_experts) {
    return Invalid(absl::StrCat("num_ranks: got ", world, ", expected a value in [1, num_experts=",
                                plan.model.num_experts, "]"));
  }
  if (plan.multi_process) {
    if (!cuda) {
      return absl::FailedPreconditionError(
          absl::StrCat("world_size: multi-process serving (world_size=", world,
                       " > num_ranks=", num_ranks, ") needs backend cuda"));
    }
    if (world % num_ranks != 0 || world > kMaxMultiProcessWorld) {
      return Invalid(absl::StrCat("world_size: got ", world,
                                  ", expected a multiple of the ranks per process (", num_ranks,
                                  "), at most ", kMaxMultiProcessWorld));
    }
    if (options.node_rank < 0 || options.node_rank >= world / num_ranks) {
      return Invalid(absl::StrCat("node_rank: got ", options.node_rank,
                                  ", expected a value in [0, ", world / num_ranks, ")"));
    }
    if (options.collective_id.empty()) {
      return Invalid("collective_id: multi-process serving needs the leader's NCCL unique id");
    }
    plan.node_rank = options.node_rank;
    plan.first_rank = options.node_rank * num_ranks;
    plan.collective_id = options.collective_id;
  }

  // Limits.
  if (options.max_tokens_per_request <= 0) return Invalid("max_tokens_per_request must be > 0");
  if (options.max_tokens_per_rank < 0) {
    return Invalid(absl::StrCat("max_tokens_per_rank: got ", options.max_tokens_per_rank,
                                ", expected >= 0 (0: automatic)"));
  }
  if (options.dispatch == "per_rank") {
    plan.dispatch = AllToAllOptions::Dispatch::kPerRank;
  } else if (options.dispatch == "per_route") {
    plan.dispatch = AllToAllOptions::Dispatch::kPerRoute;
  } else {
    return Invalid(
        absl::StrCat("dispatch: got '", options.dispatch, "', expected per_rank or per_route"));
  }
  if (options.collective_timeout_ms <= 0) return Invalid("collective_timeout_ms must be > 0");
  plan.collective_timeout = absl::Milliseconds(options.collective_timeout_ms);
  if (options.group_formation_timeout_ms <= 0) {
    return Invalid(absl::StrCat("group_formation_timeout_ms: got ",
                                options.group_formation_timeout_ms, ", expected > 0"));
  }
  plan.group_formation_timeout =
      std::max(plan.collective_timeout, absl::Milliseconds(options.group_formation_timeout_ms));
  // A follower waits at most collective_timeout_ms for the next command, and an idle leader's
  // commands can come two heartbeats apart (the heartbeat skips a period that saw a step).
  if (plan.multi_process &&
      (options.heartbeat_ms <= 0 || options.heartbeat_ms > options.collective_timeout_ms / 3)) {
    return Invalid(absl::StrCat(
        "heartbeat_ms: got ", options.heartbeat_ms,
        ", expected a value in [1, collective_timeout_ms / 3 = ", options.collective_timeout_ms / 3,
        "] for multi-process serving (followers wait at most collective_timeout_ms for the next "
        "command, and an idle leader's heartbeats can be two periods apart)"));
  }
  plan.heartbeat_ms = options.heartbeat_ms;
  plan.max_tokens_per_request = options.max_tokens_per_request;

  // Providers: the names pick providers of this backend, or CPU ones whose format picks this
  // backend's. A GPU-only name on the CPU says why the CPU it is.
  if (!cuda) {
    const ExpertsProvider* gpu_only = registry.FindExperts(options.experts);
    if (gpu_only != nullptr && gpu_only->backend == Backend::kCuda) {
      return Invalid(absl::StrCat("experts: '", options.experts, "' (", gpu_only->name,
                                  ") runs on the cuda backend, but ", why_cpu));
    }
  }
  MOESERVE_ASSIGN_OR_RETURN(const ExpertsProvider* named_experts,
                            registry.LookupExperts(options.experts, plan.backend));
  const ExpertsProvider* experts = ExpertsOn(registry, *named_experts, plan.backend);
  if (experts == nullptr) {
    return Invalid(absl::StrCat("experts: ", named_experts->name, " has no ",
                                BackendName(plan.backend), " counterpart"));
  }
  std::string pf_name = options.prepare_finalize;
  if (pf_name == "auto") {
    // The GPU's batched Experts get the batched all-to-all; the CPU default stays contiguous.
    pf_name = world == 1                                                     ? "no_ep"
              : cuda && experts->format == ActivationFormat::kBatchedExperts ? "all2all_batched"
                                                                             : "all2all_contiguous";
  }
  MOESERVE_ASSIGN_OR_RETURN(const PrepareFinalizeProvider* named_pf,
                            registry.LookupPrepareFinalize(pf_name, plan.backend));
  const PrepareFinalizeProvider* pf =
      PrepareFinalizeOn(registry, *named_pf, plan.backend, experts->format);
  if (pf == nullptr) {
    return Invalid(absl::StrCat("prepare_finalize: ", named_pf->name, " has no ",
                                BackendName(plan.backend), " counterpart"));
  }
  if (!pf->supports_ep && world > 1) {
    if (cuda) {
      return Invalid(
          absl::StrCat("prepare_finalize: no_ep runs on a single rank, got num_ranks=", world));
    }
    return Invalid(absl::StrCat(pf->name, " serves a single rank, but there are ", world, " ranks",
                                EpChoices(registry, plan.backend)));
  }
  plan.prepare_finalize = pf->name;
  plan.experts = experts->name;
  plan.activation_format = pf->format;

  // Placement.
  if (!options.rank_experts.empty() && static_cast<int>(options.rank_experts.size()) != world) {
    return Invalid(absl::StrCat("rank_experts: lists ", options.rank_experts.size(),
                                " ranks, num_ranks=", world));
  }
  MOESERVE_ASSIGN_OR_RETURN(
      Placement placement,
      options.rank_experts.empty()
          ? Placement::ByName(options.placement, plan.model.num_experts, world)
          : Placement::FromRankExperts(plan.model.num_experts, options.rank_experts));
  plan.placement = std::make_shared<const Placement>(std::move(placement));

  // Threads and capacities.
  const int threads = options.num_threads > 0
                          ? options.num_threads
                          : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  plan.threads_per_rank = cuda ? 1 : std::max(1, threads / num_ranks);
  int64_t tokens_per_rank = options.max_tokens_per_rank;
  if (tokens_per_rank == 0) {
    tokens_per_rank = (options.max_tokens_per_request + world - 1) / world;
    // The batched format's capacity is tokens_per_rank x world rows per local expert.
    if (pf->supports_ep && pf->format == ActivationFormat::kBatchedExperts) {
      tokens_per_rank = std::min<int64_t>(tokens_per_rank, 128);
    }
  }
  plan.max_tokens_per_rank = pf->supports_ep ? tokens_per_rank : options.max_tokens_per_request;

  // Steps in flight: independent lanes need a PrepareAndFinalize without collectives (every rank
  // must issue those in one order). They pay on a GPU (copies overlap compute), so only there are
  // they the default; on the CPU they are allowed (e.g. to test the pipelined batcher).
  const bool lanes_possible = !pf->supports_ep && !plan.multi_process;
  if (options.steps_in_flight < 0 || options.steps_in_flight > kMaxStepsInFlight) {
    return Invalid(absl::StrCat("steps_in_flight: got ", options.steps_in_flight,
                                ", expected 0 (auto) to ", kMaxStepsInFlight));
  }
  if (options.steps_in_flight > 1 && !lanes_possible) {
    return Invalid(absl::StrCat(
        "steps_in_flight: ", options.steps_in_flight,
        " steps in flight need a single-rank PrepareAndFinalize (no_ep) in one process; got ",
        pf->name, "; use 0 (auto) or 1"));
  }
  plan.lanes =
      options.steps_in_flight > 0 ? options.steps_in_flight : (lanes_possible && cuda ? 2 : 1);
  // A token limit whose step buffers (one set per lane) cannot fit is refused now, not at the
  // first large call.
  MOESERVE_RETURN_IF_ERROR(CheckActivationBudget(
      plan.model, plan.max_tokens_per_request,
      options.memory_budget_bytes > 0 ? options.memory_budget_bytes : AvailableHostMemoryBytes(),
      plan.lanes));

  if (options.graph_max_tokens < -1) {
    return Invalid(absl::StrCat("graph_max_tokens: got ", options.graph_max_tokens,
                                ", expected -1 (auto), 0 (off) or a token count"));
  }
  if (options.graph_max_tokens > 0 && !cuda) {
    return Invalid(absl::StrCat("graph_max_tokens: ", options.graph_max_tokens,
                                " needs backend cuda (graphs replay device work); use 0 or -1"));
  }
  plan.graphs_required = options.graph_max_tokens > 0;
  plan.graph_max_tokens = std::min(
      plan.max_tokens_per_rank,
      options.graph_max_tokens >= 0 ? options.graph_max_tokens : (cuda ? kAutoGraphMaxTokens : 0));

  plan.weights.checkpoint_dir = options.checkpoint_dir;
  plan.weights.seed = options.seed;
  plan.weights.format = options.weight_format;
  plan.weights.num_threads = threads;
  plan.weights.observer = options.load_observer;
  plan.weights.memory_budget_bytes = options.memory_budget_bytes;
  plan.fault_injection_for_testing = options.fault_injection_for_testing;

  // Each provider's own refusals, then the pair.
  MOESERVE_RETURN_IF_ERROR(pf->Supports(plan));
  MOESERVE_RETURN_IF_ERROR(experts->Supports(plan));
  MOESERVE_RETURN_IF_ERROR(CheckProvidersCompatible(*pf, *experts, plan));
  return plan;
}

}  // namespace moeserve
