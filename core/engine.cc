#include "core/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <thread>

#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/comm/nccl_communicator.h"
#include "core/cpu/all_to_all_prepare_finalize.h"
#include "core/cpu/kernel_factory.h"
#include "core/cpu/no_ep_prepare_finalize.h"
#include "core/cuda/cuda_backend.h"
#include "core/status_macros.h"
#include "core/weight_loader.h"
#include "kernels/cpu/dtype_convert.h"
#ifdef MOESERVE_HAVE_NCCL
#include "core/comm/nccl_host_transfer.h"
#include "core/cuda/nccl_all_to_all.h"
#endif

namespace moeserve {
namespace {

// Multi-process command, broadcast from global rank 0 to every rank (int64 words):
// [magic, op, layer, M, hidden dtype, world, bounds[0..world]] (rank r is the source of tokens
// [bounds[r], bounds[r+1])), zero-padded to a fixed size so every rank knows the byte count.
constexpr int64_t kCmdMagic = 0x6d6f65736d703031;  // "moesmp01"
constexpr int64_t kOpNoop = 0, kOpForward = 1, kOpShutdown = 2;
constexpr int kCmdBoundsAt = 6;
constexpr int kMaxMultiProcessWorld = 256;
constexpr int kCmdWords = kCmdBoundsAt + kMaxMultiProcessWorld + 1;

std::vector<int64_t> Command(int64_t op, int world) {
  std::vector<int64_t> cmd(kCmdWords, 0);
  cmd[0] = kCmdMagic;
  cmd[1] = op;
  cmd[5] = world;
  return cmd;
}

}  // namespace

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
  return absl::OkStatus();
}

absl::Status ValidateForwardInput(const ModelConfig& model, int64_t max_tokens,
                                  const ForwardInput& in) {
  MOESERVE_RETURN_IF_ERROR(ValidateForwardShapes(model, max_tokens, in));
  auto bad = [](auto&&... parts) { return absl::InvalidArgumentError(absl::StrCat(parts...)); };
  const int64_t routes = in.hidden_states.dim(0) * model.topk;
  for (int64_t i = 0; i < routes; ++i) {
    const int64_t id = in.topk_ids.dtype() == DType::kINT32 ? in.topk_ids.data<int32_t>()[i]
                                                            : in.topk_ids.data<int64_t>()[i];
    if (id < 0 || id >= model.num_experts) {
      return bad("topk_ids: value ", id, " at [", i / model.topk, ", ", i % model.topk,
                 "] is outside [0, ", model.num_experts, ") (num_experts)");
    }
  }
  for (int64_t i = 0; i < routes; ++i) {
    const float w = in.topk_weights.data<float>()[i];
    if (!std::isfinite(w)) {
      return bad("topk_weights: value ", w, " at [", i / model.topk, ", ", i % model.topk,
                 "] is not finite; expected finite router weights");
    }
  }
  return absl::OkStatus();
}

struct Engine::Rank {
  std::shared_ptr<Communicator> comm;  // null with no_ep (and on GPUs: the PF holds its own)
  std::shared_ptr<CudaContext> cuda;   // backend cuda: this rank's GPU
  std::shared_ptr<DeviceWeightStore> dev_weights;  // backend cuda: resident packed weights
  std::unique_ptr<ExpertWeightStore> weights;
  std::unique_ptr<ModularKernel> kernel;
  std::vector<int32_t> expert_map;  // global -> local on this rank
  HostBuffer out;                   // this rank's output slice (FP32) before the gather
  StageTimings timings;
#ifdef MOESERVE_HAVE_NCCL
  // Multi-process: host traffic with the other processes (command, token and output slices).
  std::unique_ptr<NcclHostTransfer> host;
#endif
  std::vector<int64_t> header;  // multi-process: the command last received
  std::vector<char> slice;      // multi-process: packed slices (leader: sent; follower: received)
};

Engine::Engine() = default;
Engine::~Engine() { StopMultiProcess(); }

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const EngineOptions& requested) {
  EngineOptions options = requested;
  {
    WeightSource source;
    source.checkpoint_dir = options.checkpoint_dir;
    MOESERVE_ASSIGN_OR_RETURN(options.model, ResolveModelConfig(source, options.model));
  }
  MOESERVE_RETURN_IF_ERROR(options.model.Validate());
#ifdef MOESERVE_ENABLE_CUDA
  const int gpus = CudaDeviceCount();
#else
  const int gpus = 0;
#endif
  if (options.backend == "auto") {
    // The plain-loop reference experts are asked for by name only to check against: keep them.
    const bool reference = absl::StrContains(options.experts, "eference");
    options.backend = gpus > 0 && options.model.hidden % 8 == 0 && !reference ? "cuda" : "cpu";
  }
  if (options.backend != "cpu" && options.backend != "cuda") {
    return absl::InvalidArgumentError(
        absl::StrCat("backend: got '", options.backend, "', expected cpu, cuda or auto"));
  }
  const bool cuda = options.backend == "cuda";
  if (cuda) {
#ifndef MOESERVE_ENABLE_CUDA
    return absl::FailedPreconditionError(
        "backend 'cuda': this moeserve was built without CUDA (MOESERVE_ENABLE_CUDA=OFF); use "
        "--backend cpu");
#endif
    if (gpus == 0) {
      return absl::FailedPreconditionError(
          "backend 'cuda': no CUDA device is visible (no GPU or no driver); use --backend cpu");
    }
    if (options.num_ranks == 0) options.num_ranks = gpus;
    if (options.num_ranks > gpus) {
      return absl::FailedPreconditionError(
          absl::StrCat("num_ranks: ", options.num_ranks, " GPU ranks requested but ", gpus,
                       " CUDA devices are visible (backend cuda runs one rank per GPU)"));
    }
    if (options.model.hidden % 8 != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("backend 'cuda' needs hidden % 8 == 0, got hidden=", options.model.hidden));
    }
  } else if (options.num_ranks == 0) {
    options.num_ranks = 1;
  }
  const int num_ranks = options.num_ranks;
  // Multi-process: `world` ranks over all processes, `num_ranks` of them here.
  const int world = options.world_size > 0 ? options.world_size : num_ranks;
  const bool multi_process = world != num_ranks;
  if (num_ranks < 1 || world > options.model.num_experts) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_ranks: got ", world,
                     ", expected a value in [1, num_experts=", options.model.num_experts, "]"));
  }
  if (multi_process) {
    if (!cuda) {
      return absl::FailedPreconditionError(
          absl::StrCat("world_size: multi-process serving (world_size=", world,
                       " > num_ranks=", num_ranks, ") needs backend cuda"));
    }
    if (world % num_ranks != 0 || world > kMaxMultiProcessWorld) {
      return absl::InvalidArgumentError(absl::StrCat(
          "world_size: got ", world, ", expected a multiple of the ranks per process (", num_ranks,
          "), at most ", kMaxMultiProcessWorld));
    }
    if (options.node_rank < 0 || options.node_rank >= world / num_ranks) {
      return absl::InvalidArgumentError(absl::StrCat("node_rank: got ", options.node_rank,
                                                     ", expected a value in [0, ",
                                                     world / num_ranks, ")"));
    }
    if (options.collective_id.empty()) {
      return absl::InvalidArgumentError(
          "collective_id: multi-process serving needs the leader's NCCL unique id");
    }
  }
  if (options.max_tokens_per_request <= 0) {
    return absl::InvalidArgumentError("max_tokens_per_request must be > 0");
  }
  if (options.max_tokens_per_rank < 0) {
    return absl::InvalidArgumentError(absl::StrCat("max_tokens_per_rank: got ",
                                                   options.max_tokens_per_rank,
                                                   ", expected >= 0 (0: automatic)"));
  }
  if (options.dispatch != "per_rank" && options.dispatch != "per_route") {
    return absl::InvalidArgumentError(
        absl::StrCat("dispatch: got '", options.dispatch, "', expected per_rank or per_route"));
  }
  if (options.collective_timeout_ms <= 0) {
    return absl::InvalidArgumentError("collective_timeout_ms must be > 0");
  }
  // Experts: on GPUs the CPU names pick the activation format of the CUDA Experts.
  std::string experts_type;
  ActivationFormat cuda_format = ActivationFormat::kStandard;
  if (cuda && (options.experts == "cuda" || options.experts == "CudaExperts")) {
    experts_type = "CudaExperts";
  } else if (cuda &&
             (options.experts == "cuda_batched" || options.experts == "CudaBatchedExperts")) {
    experts_type = "CudaBatchedExperts";
    cuda_format = ActivationFormat::kBatchedExperts;
  } else {
    MOESERVE_ASSIGN_OR_RETURN(experts_type, CanonicalExpertsType(options.experts));
    if (cuda && absl::StartsWith(experts_type, "Batched")) {
      cuda_format = ActivationFormat::kBatchedExperts;
    }
  }
  std::string pf_type = options.prepare_finalize;
  if (pf_type == "auto") {
    pf_type = world == 1                                                 ? "no_ep"
              : cuda && cuda_format == ActivationFormat::kBatchedExperts ? "all2all_batched"
                                                                         : "all2all_contiguous";
  }
  MOESERVE_ASSIGN_OR_RETURN(pf_type, CanonicalPrepareFinalizeType(pf_type));
  if (cuda && pf_type == NoEpPrepareAndFinalize::kName && world > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("prepare_finalize: no_ep runs on a single rank, got num_ranks=", world));
  }

  // Placement.
  if (!options.rank_experts.empty() && static_cast<int>(options.rank_experts.size()) != world) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank_experts: lists ", options.rank_experts.size(), " ranks, num_ranks=", world));
  }
  MOESERVE_ASSIGN_OR_RETURN(
      Placement placement,
      options.rank_experts.empty()
          ? Placement::ByName(options.placement, options.model.num_experts, world)
          : Placement::FromRankExperts(options.model.num_experts, options.rank_experts));

  const int threads = options.num_threads > 0
                          ? options.num_threads
                          : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int threads_per_rank = std::max(1, threads / num_ranks);
  int64_t tokens_per_rank = options.max_tokens_per_rank;
  if (tokens_per_rank == 0) {
    tokens_per_rank = (options.max_tokens_per_request + world - 1) / world;
    if (pf_type == AllToAllBatchedPrepareAndFinalize::kName) {
      tokens_per_rank = std::min<int64_t>(tokens_per_rank, 128);
    }
  }

  auto engine = std::unique_ptr<Engine>(new Engine());
  engine->options_ = options;
  engine->placement_ = std::make_shared<const Placement>(std::move(placement));
  engine->multi_process_ = multi_process;
  engine->world_ = world;
  engine->first_rank_ = multi_process ? options.node_rank * num_ranks : 0;
  if (!cuda && (num_ranks > 1 || pf_type != NoEpPrepareAndFinalize::kName)) {
    MOESERVE_ASSIGN_OR_RETURN(
        engine->group_,
        InProcessCommGroup::Create(num_ranks, absl::Milliseconds(options.collective_timeout_ms)));
  }
  WeightSource source;
  source.checkpoint_dir = options.checkpoint_dir;
  source.seed = options.seed;
  source.format = options.weight_format;
  source.num_threads = threads;
  source.memory_budget_bytes = options.memory_budget_bytes;
  engine->source_ = source;
  if (cuda) {
    MOESERVE_RETURN_IF_ERROR(
        engine->CreateCudaRanks(source, pf_type, cuda_format, tokens_per_rank));
  }
  for (int r = 0; r < num_ranks && !cuda; ++r) {
    auto rank = std::make_unique<Rank>();
    if (engine->group_) rank->comm = engine->group_->MakeCommunicator(r);
    MOESERVE_ASSIGN_OR_RETURN(
        rank->weights,
        LoadExpertWeights(source, options.model, engine->placement_->rank_experts(r)));
    rank->expert_map = engine->placement_->ExpertMap(r);
    PrepareFinalizeConfig config;
    config.comm = rank->comm;
    config.placement = engine->placement_;
    config.dispatch = options.dispatch == "per_route" ? AllToAllOptions::Dispatch::kPerRoute
                                                      : AllToAllOptions::Dispatch::kPerRank;
    config.max_num_tokens_per_rank =
        pf_type == NoEpPrepareAndFinalize::kName ? options.max_tokens_per_request : tokens_per_rank;
    MOESERVE_ASSIGN_OR_RETURN(std::unique_ptr<PrepareAndFinalize> pf,
                              MakePrepareAndFinalize(pf_type, config));
    MOESERVE_ASSIGN_OR_RETURN(std::unique_ptr<Experts> experts,
                              MakeExperts(experts_type, threads_per_rank));
    MOESERVE_ASSIGN_OR_RETURN(rank->kernel,
                              ModularKernel::Create(std::move(pf), std::move(experts)));
    engine->ranks_.push_back(std::move(rank));
  }
  if (num_ranks > 1) engine->threads_ = std::make_unique<RankThreads>(num_ranks);

  EngineInfo& info = engine->info_;
  info.model = options.model;
  info.backend = options.backend;
  info.prepare_finalize = std::string(engine->ranks_[0]->kernel->prepare_finalize().name());
  info.experts = std::string(engine->ranks_[0]->kernel->experts().name());
  info.weight_format = options.weight_format;
  info.checkpoint_dir = options.checkpoint_dir;
  info.num_ranks = world;
  info.local_ranks = num_ranks;
  info.node_rank = multi_process ? options.node_rank : 0;
  info.placement = engine->placement_->name();
  info.rank_experts = engine->placement_->all_rank_experts();
  info.max_tokens_per_request = options.max_tokens_per_request;
  info.max_tokens_per_rank =
      pf_type == NoEpPrepareAndFinalize::kName ? options.max_tokens_per_request : tokens_per_rank;
  info.threads_per_rank = cuda ? 1 : threads_per_rank;
  engine->last_step_ = std::chrono::steady_clock::now();
  engine->formed_ = true;
  if (multi_process && engine->first_rank_ == 0 && options.heartbeat_ms > 0) {
    Engine* e = engine.get();
    engine->heartbeat_ = std::thread([e] { e->HeartbeatLoop(); });
  }
  return engine;
}

absl::Status Engine::CreateCudaRanks(const WeightSource& source, const std::string& pf_type,
                                     ActivationFormat format, int64_t tokens_per_rank) {
#ifndef MOESERVE_ENABLE_CUDA
  return absl::FailedPreconditionError("built without CUDA");
#else
  const EngineOptions& options = options_;
  const int num_ranks = options.num_ranks;
  const bool ep = pf_type != NoEpPrepareAndFinalize::kName;
  for (int r = 0; r < num_ranks; ++r) {
    auto rank = std::make_unique<Rank>();
    MOESERVE_ASSIGN_OR_RETURN(rank->cuda, CreateCudaContext(/*device=*/r));
    MOESERVE_ASSIGN_OR_RETURN(
        rank->weights,
        LoadExpertWeights(source, options.model, placement_->rank_experts(first_rank_ + r)));
    MOESERVE_ASSIGN_OR_RETURN(rank->dev_weights,
                              DeviceWeightStore::Create(*rank->weights, *rank->cuda));
    rank->expert_map = placement_->ExpertMap(first_rank_ + r);
    ranks_.push_back(std::move(rank));
  }
  if (ep) {
#ifndef MOESERVE_HAVE_NCCL
    return absl::FailedPreconditionError(
        absl::StrCat("prepare_finalize ", pf_type, " on GPUs needs NCCL, which this build lacks"));
#else
    std::vector<int> devices;
    std::vector<void*> streams;
    for (int r = 0; r < num_ranks; ++r) {
      devices.push_back(r);
      streams.push_back(CudaContextStream(*ranks_[r]->cuda));
    }
    const absl::Duration timeout = absl::Milliseconds(options.collective_timeout_ms);
    if (multi_process_) {
      MOESERVE_ASSIGN_OR_RETURN(
          nccl_, NcclCommGroup::CreateMultiProcess(devices, streams, world_, first_rank_,
                                                   options.collective_id, timeout));
      for (int r = 0; r < num_ranks; ++r) {
        ranks_[r]->host = std::make_unique<NcclHostTransfer>(nccl_->communicator(r));
      }
    } else {
      MOESERVE_ASSIGN_OR_RETURN(nccl_, NcclCommGroup::Create(devices, streams, timeout));
    }
#endif
  }
  for (int r = 0; r < num_ranks; ++r) {
    Rank& rank = *ranks_[r];
    std::unique_ptr<PrepareAndFinalize> pf;
    if (!ep) {
      MOESERVE_ASSIGN_OR_RETURN(
          pf, CreateCudaNoEpPrepareAndFinalize(rank.cuda, options.max_tokens_per_request, format));
    } else {
#ifdef MOESERVE_HAVE_NCCL
      NcclAllToAllOptions o;
      o.max_num_tokens_per_rank = tokens_per_rank;
      o.format = pf_type == AllToAllBatchedPrepareAndFinalize::kName
                     ? ActivationFormat::kBatchedExperts
                     : ActivationFormat::kStandard;
      o.dispatch = options.dispatch == "per_route" ? AllToAllOptions::Dispatch::kPerRoute
                                                   : AllToAllOptions::Dispatch::kPerRank;
      MOESERVE_ASSIGN_OR_RETURN(pf, CreateNcclAllToAllPrepareAndFinalize(
                                        rank.cuda, nccl_->communicator(r), placement_, o));
#endif
    }
    MOESERVE_ASSIGN_OR_RETURN(std::unique_ptr<Experts> experts,
                              CreateCudaExperts(rank.cuda, rank.dev_weights, format));
    MOESERVE_ASSIGN_OR_RETURN(rank.kernel,
                              ModularKernel::Create(std::move(pf), std::move(experts)));
  }
  return absl::OkStatus();
#endif
}

absl::Status Engine::health() const {
  std::lock_guard<std::mutex> lock(health_mu_);
  return health_;
}

absl::Status Engine::Recover() {
  std::lock_guard<std::mutex> lock(mu_);
#ifdef MOESERVE_HAVE_NCCL
  if (nccl_ != nullptr && !nccl_->healthy()) MOESERVE_RETURN_IF_ERROR(nccl_->Reinit());
#endif
  std::lock_guard<std::mutex> hl(health_mu_);
  health_ = absl::OkStatus();
  return absl::OkStatus();
}

void Engine::MarkUnhealthyForTesting(absl::Status cause) {
  std::lock_guard<std::mutex> lock(health_mu_);
  health_ = std::move(cause);
}

// After a failed step with every rank thread returned: a group whose NCCL communicators failed
// cannot run another collective, so the engine stops serving until Recover().
// A rank that timed out in a collective or was aborted by a peer is the server's failure, not a
// client deadline: clients see UNAVAILABLE (retry elsewhere), with the cause kept in the message.
static absl::Status ForClient(absl::Status s) {
  if (s.code() != absl::StatusCode::kDeadlineExceeded && s.code() != absl::StatusCode::kAborted) {
    return s;
  }
  return absl::UnavailableError(absl::StrCat(
      "expert-parallel step failed (", absl::StatusCodeToString(s.code()), "): ", s.message()));
}

void Engine::AfterFailedStep(const absl::Status& cause) {
#ifdef MOESERVE_HAVE_NCCL
  if (nccl_ != nullptr && !nccl_->healthy()) {
    nccl_->AbortAll();
    std::lock_guard<std::mutex> lock(health_mu_);
    health_ = absl::UnavailableError(
        absl::StrCat("not serving: the NCCL communicators were aborted after: ", cause.message()));
  }
#endif
}

absl::Status Engine::RunRank(int r, const ForwardInput& input, const TensorView& ids,
                             const TensorView& out32, const std::vector<int64_t>& bounds) {
  Rank& rank = *ranks_[r];
  if (options_.fault_injection_for_testing) {
    MOESERVE_RETURN_IF_ERROR(options_.fault_injection_for_testing(r));
  }
  const int64_t begin = bounds[r], end = bounds[r + 1], k = options_.model.hidden;
  // GPU ranks live in this process: each copies its slice of the answer straight into place.
  const bool in_place = r == 0 || rank.cuda != nullptr;
  // The leader writes its slice in place; the others gather theirs to it below.
  TensorView out =
      in_place ? out32.Slice(begin, end) : rank.out.Get(DType::kFP32, {end - begin, k});
  ModularKernelArgs args;
  args.hidden_states = input.hidden_states.Slice(begin, end);
  args.topk_ids = ids.Slice(begin, end);
  args.topk_weights = input.topk_weights.Slice(begin, end);
  args.weights = rank.weights->layer(input.layer);
  args.num_experts = options_.model.num_experts;
  args.expert_map = TensorView(rank.expert_map.data(), DType::kINT32,
                               {static_cast<int64_t>(rank.expert_map.size())});
  if (args.weights == nullptr) {
    return absl::InternalError(absl::StrCat("rank ", r, " has no weights for layer ", input.layer));
  }
  MOESERVE_RETURN_IF_ERROR(rank.kernel->Forward(args, out, &rank.timings));
  if (ranks_.size() == 1 || rank.cuda != nullptr) return absl::OkStatus();
  // Gather the output slices on the leader.
  const int world = static_cast<int>(ranks_.size());
  const int64_t row = k * static_cast<int64_t>(sizeof(float));
  std::vector<int64_t> sc(world, 0), sd(world, 0), rc(world, 0), rd(world, 0);
  if (r != 0) sc[0] = (end - begin) * row;
  if (r == 0) {
    for (int p = 1; p < world; ++p)
      rc[p] = (bounds[p + 1] - bounds[p]) * row, rd[p] = bounds[p] * row;
  }
  return rank.comm->AllToAllV(out.raw_data(), sc, sd, out32.raw_data(), rc, rd);
}

absl::Status Engine::Forward(const ForwardInput& input, const TensorView& output,
                             ForwardTimings* timings) {
  MOESERVE_RETURN_IF_ERROR(
      ValidateForwardInput(options_.model, options_.max_tokens_per_request, input));
  const int64_t m = input.hidden_states.dim(0), k = options_.model.hidden;
  const int topk = options_.model.topk;
  if (output.dtype() != input.hidden_states.dtype() || output.shape() != Shape{m, k}) {
    return absl::InvalidArgumentError(absl::StrCat("output must be ",
                                                   DTypeName(input.hidden_states.dtype()), "[", m,
                                                   ", ", k, "], got ", output.DebugString()));
  }
  const auto t_queue = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  if (absl::Status h = health(); !h.ok()) return h;
  if (timings) {
    *timings = ForwardTimings();
    timings->queue_us =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t_queue)
            .count();
  }
  if (m == 0) return absl::OkStatus();
  TensorView ids = input.topk_ids;
  if (ids.dtype() == DType::kINT64) {
    ids = ids32_.Get(DType::kINT32, {m, topk});
    for (int64_t i = 0; i < m * topk; ++i) {
      ids.data<int32_t>()[i] = static_cast<int32_t>(input.topk_ids.data<int64_t>()[i]);
    }
  }
  const bool fp32_out = output.dtype() == DType::kFP32;
  TensorView out32 = fp32_out ? output : out32_.Get(DType::kFP32, {m, k});
  if (multi_process_) {
    // Every process's ranks run this forward; the followers' slices travel over NCCL.
    std::vector<int64_t> cmd = {
        kCmdMagic, kOpForward, input.layer, m, static_cast<int64_t>(input.hidden_states.dtype()),
        world_};
    cmd.resize(kCmdBoundsAt + world_ + 1, 0);
    for (int r = 0; r < world_; ++r) {
      cmd[kCmdBoundsAt + r + 1] = cmd[kCmdBoundsAt + r] + m / world_ + (r < m % world_ ? 1 : 0);
    }
    MOESERVE_RETURN_IF_ERROR(ForClient(RunStep(&cmd, &input, ids, out32)));
    if (timings) {
      for (const auto& rank : ranks_) timings->rank_stages.push_back(rank->timings);
      if (!ranks_.empty()) timings->stages = ranks_[0]->timings;  // this process's leader rank
    }
    if (!fp32_out) MOESERVE_RETURN_IF_ERROR(ConvertTensor(out32, output));
    return absl::OkStatus();
  }
  // Tokens split evenly: rank r is the source of [bounds[r], bounds[r+1]).
  const int world = static_cast<int>(ranks_.size());
  std::vector<int64_t> bounds(world + 1, 0);
  for (int r = 0; r < world; ++r) bounds[r + 1] = bounds[r] + m / world + (r < m % world ? 1 : 0);

  if (world == 1) {
    if (absl::Status s = RunRank(0, input, ids, out32, bounds); !s.ok()) {
      if (group_) group_->Reset();
#ifdef MOESERVE_HAVE_NCCL
      if (nccl_ && !IsAgreedFailure(s)) nccl_->Abort(s);
#endif
      AfterFailedStep(s);
      return ForClient(s);
    }
  } else {
    const std::vector<absl::Status> statuses = threads_->Run([&](int r) {
      absl::Status s = RunRank(r, input, ids, out32, bounds);
      // Peers blocked in a collective waiting for this rank give up at once. (A refusal all
      // GPU ranks agreed on in PlanChunks leaves NCCL intact.)
      if (!s.ok() && group_) group_->Abort(s);
#ifdef MOESERVE_HAVE_NCCL
      if (!s.ok() && nccl_ && !IsAgreedFailure(s)) nccl_->Abort(s);
#endif
      return s;
    });
    absl::Status first = absl::OkStatus();
    for (int r = 0; r < world; ++r) {
      const absl::Status& s = statuses[r];
      if (s.ok()) continue;
      // Prefer the root cause over the peers' ABORTED echoes.
      if (first.ok() ||
          (first.code() == absl::StatusCode::kAborted && s.code() != absl::StatusCode::kAborted)) {
        first = absl::Status(s.code(), absl::StrCat("rank ", r, ": ", s.message()));
      }
    }
    if (!first.ok()) {
      if (group_) group_->Reset();  // every rank thread has returned: no collective in flight
      AfterFailedStep(first);
      return ForClient(first);
    }
  }
  if (timings) {
    StageTimings& st = timings->stages;
    for (const auto& rank : ranks_) {
      const StageTimings& t = rank->timings;
      timings->rank_stages.push_back(t);
      st.prepare_us = std::max(st.prepare_us, t.prepare_us);
      st.experts_us = std::max(st.experts_us, t.experts_us);
      st.finalize_us = std::max(st.finalize_us, t.finalize_us);
      st.num_chunks = std::max(st.num_chunks, t.num_chunks);
      st.transfer.dispatch_bytes_sent += t.transfer.dispatch_bytes_sent;
      st.transfer.dispatch_bytes_received += t.transfer.dispatch_bytes_received;
      st.transfer.combine_bytes_sent += t.transfer.combine_bytes_sent;
      st.transfer.combine_bytes_received += t.transfer.combine_bytes_received;
    }
  }
  if (!fp32_out) MOESERVE_RETURN_IF_ERROR(ConvertTensor(out32, output));
  return absl::OkStatus();
}

absl::Status Engine::GetExpertWeightsBf16(int layer, int expert, uint16_t* w13,
                                          uint16_t* w2) const {
  if (layer < 0 || ranks_.empty() || ranks_[0]->weights->layer(layer) == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("layer: ", layer, " has no experts"));
  }
  if (expert < 0 || expert >= options_.model.num_experts) {
    return absl::InvalidArgumentError(
        absl::StrCat("expert: got ", expert, ", expected [0, ", options_.model.num_experts, ")"));
  }
  const int owner = placement_->owner(expert);
  const LayerWeights* lw = nullptr;
  int64_t e = placement_->local_index(expert);
  std::unique_ptr<ExpertWeightStore> remote;  // an expert another process serves
  if (owner < first_rank_ || owner >= first_rank_ + static_cast<int>(ranks_.size())) {
    MOESERVE_ASSIGN_OR_RETURN(remote, LoadExpertWeights(source_, options_.model, {expert}));
    lw = remote->layer(layer);
    e = 0;
  } else {
    lw = ranks_[owner - first_rank_]->weights->layer(layer);
  }
  const int64_t k = lw->hidden, n = lw->intermediate;
  std::vector<float> f13(2 * n * k), f2(k * n);
  MOESERVE_RETURN_IF_ERROR(DequantizeExpertToFp32(*lw, e, f13.data(), f2.data()));
  kernels::ConvertFp32ToBf16Ref(f13.data(), w13, 2 * n * k);
  kernels::ConvertFp32ToBf16Ref(f2.data(), w2, k * n);
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// Multi-process mode.

absl::StatusOr<std::string> Engine::NewCollectiveId() {
#ifdef MOESERVE_HAVE_NCCL
  return NcclCommGroup::NewUniqueId();
#else
  return absl::FailedPreconditionError("multi-process serving needs a build with CUDA and NCCL");
#endif
}

void Engine::AbortCollectives(const absl::Status& cause) {
#ifdef MOESERVE_HAVE_NCCL
  if (nccl_ != nullptr) nccl_->Abort(cause);
#endif
}

absl::Status Engine::RunStep(const std::vector<int64_t>* cmd, const ForwardInput* input,
                             const TensorView& ids, const TensorView& out32) {
#ifndef MOESERVE_HAVE_NCCL
  return absl::FailedPreconditionError("multi-process serving needs NCCL");
#else
  auto step = [&](int i) {
    absl::Status s = MultiStep(i, cmd, input, ids, out32);
    if (!s.ok() && nccl_ != nullptr && !IsAgreedFailure(s)) nccl_->Abort(s);
    return s;
  };
  std::vector<absl::Status> statuses;
  if (threads_ != nullptr) {
    statuses = threads_->Run(step);
  } else {
    statuses.push_back(step(0));
  }
  last_step_ = std::chrono::steady_clock::now();
  absl::Status first = absl::OkStatus();
  for (size_t i = 0; i < statuses.size(); ++i) {
    const absl::Status& s = statuses[i];
    if (s.ok()) continue;
    if (first.ok() ||
        (first.code() == absl::StatusCode::kAborted && s.code() != absl::StatusCode::kAborted)) {
      first = absl::Status(
          s.code(), absl::StrCat("rank ", first_rank_ + static_cast<int>(i), ": ", s.message()));
      if (IsAgreedFailure(s)) first.SetPayload("moeserve/agreed_failure", absl::Cord("1"));
    }
  }
  if (!first.ok()) AfterFailedStep(first);
  return first;
#endif
}

absl::Status Engine::MultiStep(int i, const std::vector<int64_t>* cmd, const ForwardInput* input,
                               const TensorView& ids, const TensorView& out32) {
#ifndef MOESERVE_HAVE_NCCL
  return absl::FailedPreconditionError("multi-process serving needs NCCL");
#else
  Rank& rank = *ranks_[i];
  const int g = first_rank_ + i;
  const int local = static_cast<int>(ranks_.size());
  // The leader's process hosts global ranks [0, local); the others' slices travel.
  auto remote = [local](int p) { return p >= local; };
  std::vector<int64_t>& h = rank.header;
  h.assign(kCmdWords, 0);
  if (cmd != nullptr) std::copy(cmd->begin(), cmd->end(), h.begin());
  MOESERVE_RETURN_IF_ERROR(
      rank.host->Broadcast(h.data(), static_cast<int64_t>(h.size() * sizeof(int64_t)), 0));
  if (h[0] != kCmdMagic || h[5] != world_) {
    return absl::InternalError(absl::StrCat("rank ", g, ": bad command from the leader (world ",
                                            h[5], ", expected ", world_, ")"));
  }
  if (h[1] != kOpForward) return absl::OkStatus();
  if (options_.fault_injection_for_testing) {
    MOESERVE_RETURN_IF_ERROR(options_.fault_injection_for_testing(g));
  }
  const int layer = static_cast<int>(h[2]);
  const DType dtype = static_cast<DType>(h[4]);
  const int64_t* bounds = &h[kCmdBoundsAt];
  const int64_t k = options_.model.hidden, topk = options_.model.topk;
  const int64_t hidden_row = k * static_cast<int64_t>(DTypeSize(dtype));
  const int64_t row_bytes = hidden_row + topk * 8;  // hidden, int32 ids, fp32 weights
  const int64_t begin = bounds[g], rows = bounds[g + 1] - bounds[g];
  std::vector<int64_t> sc(world_, 0), sd(world_, 0), rc(world_, 0), rd(world_, 0);

  // 1. The leader sends every remote rank its tokens: hidden rows, then ids, then weights.
  TensorView hs, tid, tw;
  if (g == 0) {
    int64_t total = 0;
    for (int p = local; p < world_; ++p) total += (bounds[p + 1] - bounds[p]) * row_bytes;
    rank.slice.resize(static_cast<size_t>(total));
    char* dst = rank.slice.data();
    for (int p = local; p < world_; ++p) {
      const int64_t b = bounds[p], n = bounds[p + 1] - bounds[p];
      sd[p] = dst - rank.slice.data();
      sc[p] = n * row_bytes;
      std::memcpy(dst, static_cast<const char*>(input->hidden_states.raw_data()) + b * hidden_row,
                  n * hidden_row);
      dst += n * hidden_row;
      std::memcpy(dst, ids.data<int32_t>() + b * topk, n * topk * 4);
      dst += n * topk * 4;
      std::memcpy(dst, input->topk_weights.data<float>() + b * topk, n * topk * 4);
      dst += n * topk * 4;
    }
    MOESERVE_RETURN_IF_ERROR(rank.host->AllToAllV(rank.slice.data(), sc, sd, nullptr, rc, rd));
  } else if (remote(g)) {
    rc[0] = rows * row_bytes;
    rank.slice.resize(static_cast<size_t>(rc[0]));
    MOESERVE_RETURN_IF_ERROR(rank.host->AllToAllV(nullptr, sc, sd, rank.slice.data(), rc, rd));
    char* src = rank.slice.data();
    hs = TensorView(src, dtype, {rows, k});
    tid = TensorView(src + rows * hidden_row, DType::kINT32, {rows, topk});
    tw = TensorView(src + rows * (hidden_row + topk * 4), DType::kFP32, {rows, topk});
  }
  if (!remote(g)) {
    hs = input->hidden_states.Slice(begin, begin + rows);
    tid = ids.Slice(begin, begin + rows);
    tw = input->topk_weights.Slice(begin, begin + rows);
  }

  // 2. The modular kernel (its own collectives, the same on every rank).
  const TensorView out =
      remote(g) ? rank.out.Get(DType::kFP32, {rows, k}) : out32.Slice(begin, begin + rows);
  ModularKernelArgs args;
  args.hidden_states = hs;
  args.topk_ids = tid;
  args.topk_weights = tw;
  args.weights = rank.weights->layer(layer);
  args.num_experts = options_.model.num_experts;
  args.expert_map = TensorView(rank.expert_map.data(), DType::kINT32,
                               {static_cast<int64_t>(rank.expert_map.size())});
  if (args.weights == nullptr) {
    return absl::InternalError(absl::StrCat("rank ", g, " has no weights for layer ", layer));
  }
  MOESERVE_RETURN_IF_ERROR(rank.kernel->Forward(args, out, &rank.timings));

  // 3. The remote ranks' output rows back to the leader.
  std::fill(sc.begin(), sc.end(), 0);
  std::fill(sd.begin(), sd.end(), 0);
  std::fill(rc.begin(), rc.end(), 0);
  std::fill(rd.begin(), rd.end(), 0);
  const int64_t out_row = k * static_cast<int64_t>(sizeof(float));
  if (g == 0) {
    for (int p = local; p < world_; ++p) {
      rc[p] = (bounds[p + 1] - bounds[p]) * out_row;
      rd[p] = bounds[p] * out_row;
    }
    return rank.host->AllToAllV(nullptr, sc, sd, out32.raw_data(), rc, rd);
  }
  if (remote(g)) {
    sc[0] = rows * out_row;
    return rank.host->AllToAllV(out.raw_data(), sc, sd, nullptr, rc, rd);
  }
  return absl::OkStatus();
#endif
}

absl::Status Engine::RunFollower() {
  if (!is_follower()) {
    return absl::FailedPreconditionError(
        "RunFollower: this engine is not a follower (multi-process node_rank > 0)");
  }
  std::lock_guard<std::mutex> lock(mu_);
  while (true) {
    if (absl::Status h = health(); !h.ok()) return h;
    const TensorView none;
    absl::Status s = RunStep(nullptr, nullptr, none, none);
#ifdef MOESERVE_HAVE_NCCL
    if (!s.ok() && IsAgreedFailure(s)) continue;  // a refusal every rank agreed on
#endif
    if (!s.ok()) return s;
    if (ranks_[0]->header[1] == kOpShutdown) return absl::OkStatus();
  }
}

void Engine::HeartbeatLoop() {
  const auto period = std::chrono::milliseconds(options_.heartbeat_ms);
  std::unique_lock<std::mutex> hl(hb_mu_);
  while (!hb_stop_) {
    hb_cv_.wait_for(hl, period, [this] { return hb_stop_; });
    if (hb_stop_) break;
    hl.unlock();
    {
      std::unique_lock<std::mutex> step(mu_, std::try_to_lock);  // a forward is a heartbeat too
      if (step.owns_lock() && healthy() &&
          std::chrono::steady_clock::now() - last_step_ >= period) {
        const std::vector<int64_t> cmd = Command(kOpNoop, world_);
        const TensorView none;
        (void)RunStep(&cmd, nullptr, none, none);  // a failure marks the engine unhealthy
      }
    }
    hl.lock();
  }
}

void Engine::StopMultiProcess() {
  if (!multi_process_) return;
  {
    std::lock_guard<std::mutex> hl(hb_mu_);
    hb_stop_ = true;
  }
  hb_cv_.notify_all();
  if (heartbeat_.joinable()) heartbeat_.join();
  // Only a leader whose group formed (Create may have failed half-way) tells the followers.
  if (first_rank_ != 0 || !formed_) return;
  // Leader: let the followers leave their loop (bounded by the collective timeout).
  std::lock_guard<std::mutex> lock(mu_);
  if (healthy()) {
    const std::vector<int64_t> cmd = Command(kOpShutdown, world_);
    const TensorView none;
    (void)RunStep(&cmd, nullptr, none, none);
  }
}

}  // namespace moeserve
