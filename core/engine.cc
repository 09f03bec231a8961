#include "core/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "core/provider_registry.h"
#include "core/status_macros.h"
#include "core/weight_loader.h"
#include "kernels/cpu/dtype_convert.h"

namespace moeserve {

absl::Status ValidateForwardShapes(const ModelConfig& model, int64_t max_tokens,
                                   const ForwardInput& in) {
  auto bad = [](auto&&... parts) { return absl::InvalidArgumentError(absl::StrCat(parts...)); };
  if (!model.IsMoeLayer(in.layer)) {
    if (in.layer >= 0 && in.layer < model.num_layers) {
      return bad("layer: ", in.layer, " is a dense layer with no experts; MoE layers are ",
                 model.moe_layers.empty() ? "all" : "those listed by GetModelInfo");
    }
    return bad("layer: got ", in.layer, ", expected a value in [0, ", model.num_layers, ")");
  }
  const TensorView& x = in.hidden_states;
  if (x.dtype() != DType::kBF16 && x.dtype() != DType::kFP16 && x.dtype() != DType::kFP32) {
    return bad("hidden_states: dtype ", DTypeName(x.dtype()),
               " not accepted; expected bf16, "
               "fp16 or fp32");
  }
  if (x.rank() != 2 || x.dim(1) != model.hidden) {
    return bad("hidden_states: got shape ", ShapeToString(x.shape()), ", expected [M, ",
               model.hidden, "]");
  }
  const int64_t m = x.dim(0);
  if (m > max_tokens) {
    return absl::ResourceExhaustedError(absl::StrCat("hidden_states: M=", m,
                                                     " tokens exceeds the maximum of ", max_tokens,
                                                     " tokens per request; split the batch"));
  }
  if (in.topk_ids.dtype() != DType::kINT32 && in.topk_ids.dtype() != DType::kINT64) {
    return bad("topk_ids: dtype ", DTypeName(in.topk_ids.dtype()),
               " not accepted; expected int32 or int64");
  }
  if (in.topk_ids.rank() != 2 || in.topk_ids.dim(0) != m || in.topk_ids.dim(1) != model.topk) {
    return bad("topk_ids: got shape ", ShapeToString(in.topk_ids.shape()), ", expected [", m, ", ",
               model.topk, "] ([M, topk])");
  }
  if (in.topk_weights.dtype() != DType::kFP32) {
    return bad("topk_weights: dtype ", DTypeName(in.topk_weights.dtype()),
               " not accepted; expected fp32");
  }
  if (in.topk_weights.rank() != 2 || in.topk_weights.dim(0) != m ||
      in.topk_weights.dim(1) != model.topk) {
    return bad("topk_weights: got shape ", ShapeToString(in.topk_weights.shape()), ", expected [",
               m, ", ", model.topk, "] ([M, topk])");
  }
  // Routing is read as packed rows (the INT64 narrowing, the kernels' prepare); a strided view
  // would be read as if it were packed.
  if (!in.topk_ids.is_contiguous() || !in.topk_weights.is_contiguous()) {
    return bad(!in.topk_ids.is_contiguous() ? "topk_ids" : "topk_weights",
               ": a strided view is not accepted; expected packed [M, topk] rows");
  }
  return absl::OkStatus();
}

absl::Status ValidateForwardInput(const ModelConfig& model, int64_t max_tokens,
                                  const ForwardInput& in) {
  MOESERVE_RETURN_IF_ERROR(ValidateForwardShapes(model, max_tokens, in));
  const int64_t routes = in.hidden_states.dim(0) * model.topk;
  // Routing in device memory is checked by the engine on the device (EngineInfo::device_routing).
  if (!in.topk_ids.device().is_host() || !in.topk_weights.device().is_host()) {
    return absl::OkStatus();
  }
  for (int64_t i = 0; i < routes; ++i) {
    const int64_t id = in.topk_ids.dtype() == DType::kINT32 ? in.topk_ids.data<int32_t>()[i]
                                                            : in.topk_ids.data<int64_t>()[i];
    if (id < 0 || id >= model.num_experts) {
      return BadTopkIdError(id, i, model.topk, model.num_experts);
    }
  }
  for (int64_t i = 0; i < routes; ++i) {
    const float w = in.topk_weights.data<float>()[i];
    if (!std::isfinite(w) || std::fabs(w) > kMaxAbsTopkWeight) {
      return BadTopkWeightError(w, i, model.topk);
    }
  }
  return absl::OkStatus();
}

Engine::~Engine() {
  // The followers leave their loop before the ranks go away.
  if (multi_process_ != nullptr) multi_process_->Stop();
}

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const EngineOptions& requested) {
  EngineOptions options = requested;
  {
    WeightSource source;
    source.checkpoint_dir = options.checkpoint_dir;
    MOESERVE_ASSIGN_OR_RETURN(options.model, ResolveModelConfig(source, options.model));
  }
  const ProviderRegistry& registry = ProviderRegistry::Global();
  const BackendProvider* gpu = registry.FindBackend(Backend::kCuda);
  const int visible_gpus = gpu != nullptr && gpu->visible_devices ? gpu->visible_devices() : 0;
  MOESERVE_ASSIGN_OR_RETURN(EnginePlan plan, ResolveEngineConfig(options, registry, visible_gpus));
  const BackendProvider* backend = registry.FindBackend(plan.backend);
  if (backend == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("backend ", BackendName(plan.backend), " is not linked into this binary"));
  }

  if (plan.weights.observer != nullptr) {
    std::vector<int> experts_per_rank;
    experts_per_rank.reserve(static_cast<size_t>(plan.local_ranks));
    for (int r = 0; r < plan.local_ranks; ++r) {
      experts_per_rank.push_back(
          static_cast<int>(plan.placement->rank_experts(plan.first_rank + r).size()));
    }
    plan.weights.observer->OnLoadPlanned(
        ExpertWeightBytes(plan.model, plan.weights.format, experts_per_rank),
        plan.local_ranks * plan.model.num_moe_layers(), AvailableHostMemoryBytes());
  }

  auto engine = std::unique_ptr<Engine>(new Engine());
  engine->plan_ = plan;
  for (int lane = 0; lane < plan.lanes; ++lane) {
    engine->lane_mu_.push_back(std::make_unique<std::mutex>());
  }
  engine->lane_busy_.assign(plan.lanes, false);
  engine->ids32_.resize(plan.lanes);
  MOESERVE_ASSIGN_OR_RETURN(engine->ranks_, backend->create_rank_group(plan, registry));
  // The observer need only outlive Create: later loads (GetExpertWeights of an expert another
  // process serves) must not report to it.
  engine->plan_.weights.observer = nullptr;
  if (plan.multi_process) {
    engine->multi_process_ =
        std::make_unique<MultiProcessDriver>(engine->ranks_.get(), engine->lane_mu_[0].get());
  }

  EngineInfo& info = engine->info_;
  info.model = plan.model;
  info.backend = std::string(BackendName(plan.backend));
  info.prepare_finalize = plan.prepare_finalize;
  info.experts = plan.experts;
  info.weight_format = plan.weights.format;
  info.checkpoint_dir = plan.weights.checkpoint_dir;
  info.num_ranks = plan.world_size;
  info.local_ranks = plan.local_ranks;
  info.node_rank = plan.node_rank;
  info.placement = plan.placement->name();
  info.rank_experts = plan.placement->all_rank_experts();
  info.max_tokens_per_request = plan.max_tokens_per_request;
  info.max_tokens_per_rank = plan.max_tokens_per_rank;
  info.threads_per_rank = plan.threads_per_rank;
  // Only the leader process takes requests, so only it routes.
  if (plan.node_rank == 0) {
    const int router_threads =
        std::max(1, std::min(8, static_cast<int>(std::thread::hardware_concurrency())));
    MOESERVE_RETURN_IF_ERROR(LoadRouter(plan.weights, plan.model, router_threads, &engine->router_,
                                        &info.no_router_reason));
    if (engine->router_ != nullptr) info.router = engine->router_->config().Describe();
  } else {
    info.no_router_reason = "a follower process does not route";
  }
  const PrepareFinalizeProvider* pf = registry.FindPrepareFinalize(plan.prepare_finalize);
  // Followers receive their slices over host collectives: device memory stays in one process.
  info.device_tensors = pf != nullptr && pf->device_tensors && !plan.multi_process;
  // Device routing goes to one rank's PrepareAndFinalize as it is (no host split or map).
  info.device_routing = info.device_tensors && pf->device_routing && plan.world_size == 1;
  info.graph_max_tokens = engine->ranks_->graph_max_tokens();
  info.no_graphs_reason = engine->ranks_->no_graphs_reason();
  if (engine->multi_process_ != nullptr) engine->multi_process_->Start();
  return engine;
}

absl::Status Engine::health() const { return ranks_->health(); }

GraphStats Engine::graph_stats() const { return ranks_->graph_stats(); }

class Engine::LaneLease {
 public:
  explicit LaneLease(Engine* engine)
      : engine_(engine), lane_(engine->AcquireLane()), lock_(*engine->lane_mu_[lane_]) {}
  ~LaneLease() {
    lock_.unlock();
    engine_->ReleaseLane(lane_);
  }
  int lane() const { return lane_; }

 private:
  Engine* const engine_;
  const int lane_;
  std::unique_lock<std::mutex> lock_;
};

int Engine::AcquireLane() {
  std::unique_lock<std::mutex> lock(pool_mu_);
  for (;;) {
    for (size_t i = 0; i < lane_busy_.size(); ++i) {
      if (!lane_busy_[i]) {
        lane_busy_[i] = true;
        return static_cast<int>(i);
      }
    }
    pool_cv_.wait(lock);
  }
}

void Engine::ReleaseLane(int lane) {
  {
    std::lock_guard<std::mutex> lock(pool_mu_);
    lane_busy_[lane] = false;
  }
  pool_cv_.notify_all();
}

absl::Status Engine::Recover() {
  // Every lane: no step runs while the communicators are rebuilt.
  std::vector<std::unique_ptr<LaneLease>> leases;
  for (size_t i = 0; i < lane_mu_.size(); ++i) leases.push_back(std::make_unique<LaneLease>(this));
  return ranks_->Recover();
}

void Engine::MarkUnhealthyForTesting(absl::Status cause) {
  ranks_->MarkUnhealthy(std::move(cause));
}

// A rank that timed out in a collective or was aborted by a peer is the server's failure, not a
// client deadline: clients see UNAVAILABLE (retry elsewhere), with the cause kept in the message.
absl::Status Engine::ClientStatusForFailedStep(absl::Status cause) {
  if (cause.code() != absl::StatusCode::kDeadlineExceeded &&
      cause.code() != absl::StatusCode::kAborted) {
    return cause;
  }
  return absl::UnavailableError(absl::StrCat("expert-parallel step failed (",
                                             absl::StatusCodeToString(cause.code()),
                                             "): ", cause.message()));
}

absl::Status Engine::Forward(const ForwardInput& input, const TensorView& output,
                             ForwardTimings* timings, StopCheck stop) {
  MOESERVE_RETURN_IF_ERROR(ValidateForwardInput(plan_.model, plan_.max_tokens_per_request, input));
  return ForwardValidated(input, output, timings, std::move(stop));
}

absl::Status Engine::ForwardValidated(const ForwardInput& input, const TensorView& output,
                                      ForwardTimings* timings, StopCheck stop, bool time_stages) {
  const ModelConfig& model = plan_.model;
  MOESERVE_RETURN_IF_ERROR(ValidateForwardShapes(model, plan_.max_tokens_per_request, input));
  const int64_t m = input.hidden_states.dim(0), k = model.hidden;
  const int topk = model.topk;
  if (output.dtype() != input.hidden_states.dtype() || output.shape() != Shape{m, k}) {
    return absl::InvalidArgumentError(absl::StrCat("output must be ",
                                                   DTypeName(input.hidden_states.dtype()), "[", m,
                                                   ", ", k, "], got ", output.DebugString()));
  }
  if ((!input.hidden_states.device().is_host() || !output.device().is_host()) &&
      !info_.device_tensors) {
    return absl::FailedPreconditionError(
        absl::StrCat("this engine (backend ", info_.backend, ", prepare_finalize ",
                     info_.prepare_finalize, ") takes host tensors only; got hidden_states ",
                     input.hidden_states.DebugString(), " and output ", output.DebugString()));
  }
  const bool device_ids = !input.topk_ids.device().is_host();
  const bool device_weights = !input.topk_weights.device().is_host();
  if ((device_ids || device_weights) && !info_.device_routing) {
    return absl::InvalidArgumentError(
        absl::StrCat("topk_ids and topk_weights must be host memory for this engine (backend ",
                     info_.backend, ", prepare_finalize ", info_.prepare_finalize, "), got ",
                     input.topk_ids.DebugString(), " and ", input.topk_weights.DebugString()));
  }
  if (device_ids && input.topk_ids.dtype() != DType::kINT32) {
    return absl::InvalidArgumentError(absl::StrCat("topk_ids in device memory must be int32, got ",
                                                   input.topk_ids.DebugString()));
  }
  const auto t_queue = std::chrono::steady_clock::now();
  const LaneLease lease(this);
  const int lane = lease.lane();
  if (absl::Status h = health(); !h.ok()) return h;
  if (timings) {
    *timings = ForwardTimings();
    timings->queue_us =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t_queue)
            .count();
  }
  if (m == 0) return absl::OkStatus();
  // The caller may have given up while this call waited for the engine.
  if (stop) {
    if (absl::Status s = stop(); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat(s.message(), " (before the engine ran it)"));
    }
  }

  ForwardStep step;
  step.layer = input.layer;
  step.lane = lane;
  step.timed = timings != nullptr && time_stages;
  step.hidden_states = input.hidden_states;
  step.topk_ids = input.topk_ids;
  if (step.topk_ids.dtype() == DType::kINT64) {
    MOESERVE_ASSIGN_OR_RETURN(step.topk_ids, ids32_[lane].TryGet(DType::kINT32, {m, topk}));
    for (int64_t i = 0; i < m * topk; ++i) {
      step.topk_ids.data<int32_t>()[i] = static_cast<int32_t>(input.topk_ids.data<int64_t>()[i]);
    }
  }
  step.topk_weights = input.topk_weights;
  // Each rank's Finalize writes the caller's dtype straight into its slice of `output`.
  step.output = output;
  // Tokens split evenly over every rank (of every process): rank r is the source of
  // [bounds[r], bounds[r+1]).
  const int world = plan_.world_size;
  step.bounds.assign(world + 1, 0);
  for (int r = 0; r < world; ++r) {
    step.bounds[r + 1] = step.bounds[r] + m / world + (r < m % world ? 1 : 0);
  }

  // Between stages too, where the ranks share this process (followers would not see it).
  std::optional<StopLatch> latch;
  if (stop && multi_process_ == nullptr) {
    latch.emplace(std::move(stop));
    step.stop = &*latch;
  }
  const auto t_run = std::chrono::steady_clock::now();
  const absl::Status s =
      multi_process_ != nullptr ? multi_process_->Forward(step) : ranks_->Run(step);
  if (timings) {
    timings->engine_us =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t_run).count();
  }
  if (latch && !latch->stopped().ok()) return latch->stopped();  // the caller's own code
  if (!s.ok()) return ClientStatusForFailedStep(s);
  if (step.timed) {
    timings->stages_timed = true;
    for (int r = 0; r < ranks_->num_local_ranks(); ++r) {
      timings->rank_stages.push_back(ranks_->timings(r, lane));
    }
    if (multi_process_ != nullptr) {
      timings->stages = ranks_->timings(0);  // this process's leader rank
    } else {
      // The slowest rank's stages; bytes summed over ranks.
      StageTimings& st = timings->stages;
      for (const StageTimings& t : timings->rank_stages) {
        st.prepare_us = std::max(st.prepare_us, t.prepare_us);
        st.experts_us = std::max(st.experts_us, t.experts_us);
        st.finalize_us = std::max(st.finalize_us, t.finalize_us);
        st.host_stage_us = std::max(st.host_stage_us, t.host_stage_us);
        st.host_launch_us = std::max(st.host_launch_us, t.host_launch_us);
        st.host_collect_us = std::max(st.host_collect_us, t.host_collect_us);
        st.host_timer_us = std::max(st.host_timer_us, t.host_timer_us);
        st.num_chunks = std::max(st.num_chunks, t.num_chunks);
        st.transfer.dispatch_bytes_sent += t.transfer.dispatch_bytes_sent;
        st.transfer.dispatch_bytes_received += t.transfer.dispatch_bytes_received;
        st.transfer.combine_bytes_sent += t.transfer.combine_bytes_sent;
        st.transfer.combine_bytes_received += t.transfer.combine_bytes_received;
      }
    }
  }
  return absl::OkStatus();
}

absl::Status Engine::Route(int layer, const TensorView& hidden_states, const TensorView& topk_ids,
                           const TensorView& topk_weights) const {
  if (router_ == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "server-side routing (a request without topk_ids and topk_weights) is not available: ",
        info_.no_router_reason, "; send topk_ids and topk_weights"));
  }
  ForwardInput in;
  in.layer = layer;
  in.hidden_states = hidden_states;
  in.topk_ids = topk_ids;
  in.topk_weights = topk_weights;
  MOESERVE_RETURN_IF_ERROR(ValidateForwardShapes(plan_.model, plan_.max_tokens_per_request, in));
  if (topk_ids.dtype() != DType::kINT32) {
    return absl::InvalidArgumentError(
        absl::StrCat("Route: topk_ids must be int32, got ", DTypeName(topk_ids.dtype())));
  }
  return router_->Route(layer, hidden_states, topk_ids, topk_weights);
}

absl::Status Engine::ValidateExpertRef(int layer, int expert) const {
  if (layer < 0 || ranks_->num_local_ranks() == 0 || ranks_->weights(0).layer(layer) == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("layer: ", layer, " has no experts"));
  }
  if (expert < 0 || expert >= plan_.model.num_experts) {
    return absl::InvalidArgumentError(
        absl::StrCat("expert: got ", expert, ", expected [0, ", plan_.model.num_experts, ")"));
  }
  return absl::OkStatus();
}

absl::Status Engine::GetExpertWeightsBf16(int layer, int expert, uint16_t* w13,
                                          uint16_t* w2) const {
  MOESERVE_RETURN_IF_ERROR(ValidateExpertRef(layer, expert));
  const int owner = plan_.placement->owner(expert);
  const int first = ranks_->first_rank();
  const LayerWeights* lw = nullptr;
  int64_t e = plan_.placement->local_index(expert);
  std::unique_ptr<ExpertWeightStore> remote;  // an expert another process serves
  if (owner < first || owner >= first + ranks_->num_local_ranks()) {
    MOESERVE_ASSIGN_OR_RETURN(remote, LoadExpertWeights(plan_.weights, plan_.model, {expert}));
    lw = remote->layer(layer);
    e = 0;
  } else {
    lw = ranks_->weights(owner - first).layer(layer);
  }
  const int64_t k = lw->hidden, n = lw->intermediate;
  std::vector<float> f13(2 * n * k), f2(k * n);
  MOESERVE_RETURN_IF_ERROR(DequantizeExpertToFp32(*lw, e, f13.data(), f2.data()));
  kernels::ConvertFp32ToBf16Ref(f13.data(), w13, 2 * n * k);
  kernels::ConvertFp32ToBf16Ref(f2.data(), w2, k * n);
  return absl::OkStatus();
}

absl::StatusOr<std::string> Engine::NewCollectiveId() {
  const BackendProvider* gpu = ProviderRegistry::Global().FindBackend(Backend::kCuda);
  if (gpu == nullptr || !gpu->new_collective_id) {
    return absl::FailedPreconditionError("multi-process serving needs a build with CUDA and NCCL");
  }
  return gpu->new_collective_id();
}

absl::Status Engine::RunFollower() {
  if (!is_follower()) {
    return absl::FailedPreconditionError(
        "RunFollower: this engine is not a follower (multi-process node_rank > 0)");
  }
  return multi_process_->RunFollower();
}

void Engine::AbortCollectives(const absl::Status& cause) { ranks_->Abort(cause); }

}  // namespace moeserve
