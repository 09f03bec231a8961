// moeserve: serves the expert layers of a Mixture-of-Experts model over gRPC.
// This file only turns flags into ProcessOptions; the process itself (ports first, weights in
// the background, serving, shutdown) is server/startup.h.
#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "core/engine.h"
#include "core/forward_batcher.h"
#include "core/model_config.h"
#include "core/status_macros.h"
#include "moeserve/v1/channel_args.h"
#include "moeserve_build_info.h"
#include "server/internal_bootstrap.h"
#include "server/security.h"
#include "server/server.h"
#include "server/startup.h"
#include "server/tls.h"

ABSL_FLAG(std::string, listen, moeserve::kDefaultListenAddress,
          "Comma-separated addresses to serve gRPC on: host:port (port 0 binds a free port; "
          "0.0.0.0 for every interface) or unix:/path/to.sock for frontends on the same host "
          "(no TCP stack). The default is reachable from this host only");
ABSL_FLAG(std::string, model, "tiny",
          "Model preset: tiny, qwen3-30b-a3b, deepseek-v3, seed-megamoe");
ABSL_FLAG(int32_t, num_layers, 0, "Override the preset's number of layers (0: preset value)");
ABSL_FLAG(int32_t, num_experts, 0, "Override the preset's number of experts (0: preset value)");
ABSL_FLAG(int32_t, topk, 0, "Override the preset's top-k (0: preset value)");
ABSL_FLAG(int64_t, hidden, 0, "Override the preset's hidden size (0: preset value)");
ABSL_FLAG(int64_t, intermediate, 0, "Override the preset's intermediate size (0: preset value)");
ABSL_FLAG(uint64_t, seed, 0, "Seed of the synthetic weights");
ABSL_FLAG(std::string, backend, "auto",
          "Compute backend: cpu, cuda, or auto (cuda where a GPU exists, else cpu)");
ABSL_FLAG(std::string, experts, "blas",
          "Experts: reference, blas, batched_reference, batched_blas, cuda, cuda_batched, "
          "cuda_grouped_sm90 or cuda_w8a8 (MXFP8 weights with FP8 activations: faster from 64 "
          "tokens per rank, about 4% relative L2 from the BF16 path) (or a class name; "
          "moeserve-mk-check --list prints every provider)");
ABSL_FLAG(std::string, weight_format, "bf16", "Expert weight format: bf16 or mxfp8");
ABSL_FLAG(std::string, checkpoint, "",
          "Hugging Face checkpoint directory (empty: synthetic weights from --seed)");
ABSL_FLAG(int32_t, ranks, 0,
          "Expert-parallel ranks (cuda: one GPU each, cpu: one worker thread each); 0: every "
          "visible GPU with cuda, 1 with cpu");
ABSL_FLAG(std::string, placement, "contiguous", "Experts over ranks: contiguous or round_robin");
ABSL_FLAG(std::string, prepare_finalize, "auto",
          "PrepareAndFinalize: auto, no_ep, all2all_contiguous or all2all_batched (or a class "
          "name; moeserve-mk-check --list)");
ABSL_FLAG(int64_t, max_tokens_per_rank, 0,
          "Tokens one rank submits per dispatch round (0: engine default); larger batches run "
          "in several rounds");
ABSL_FLAG(int32_t, steps_in_flight, 0,
          "Engine steps run at once, each on its own GPU stream and buffers so that one step's "
          "copies overlap another's experts; 0: auto (2 on a single GPU without expert "
          "parallelism, else 1)");
ABSL_FLAG(int64_t, inline_max_tokens, 64,
          "A forward-channel call of at most this many tokens that finds the server idle (and "
          "--max_batch_delay_us 0) runs on the channel's thread, without a hand-off to a "
          "scheduling thread (gRPC calls always hand off: measured faster); 0: always hand off");
ABSL_FLAG(int64_t, cuda_graph_max_tokens, -1,
          "Engine steps of at most this many tokens per rank replay CUDA graphs (captured per "
          "layer and padded size on first use); -1: auto (1024 on a GPU where the kernels can be "
          "captured), 0: off");
ABSL_FLAG(int32_t, threads, 0, "Compute threads (0: all cores)");
ABSL_FLAG(int32_t, health_poll_ms, 500,
          "How often the server checks the engine's health (NOT_SERVING while unhealthy)");
ABSL_FLAG(int32_t, recover_after_ms, 5000,
          "Unhealthy engine: try Engine::Recover() this often (0: never; stay NOT_SERVING)");
ABSL_FLAG(int32_t, server_threads, 2, "Worker threads decoding and queueing Forward calls");
ABSL_FLAG(int32_t, gather_threads, 0,
          "Threads that copy a large request's pieces (gRPC slices, forward-channel slots) into "
          "one buffer, page-locked for a GPU; 0: auto (min(8, cores / 2): on a 16-core H200 "
          "host 8 took 8-16% off a 14.7 MB request's server time against 4, "
          "tests/benchmarks/transport/RESULTS.md)");
ABSL_FLAG(int64_t, malloc_trim_threshold_mb, 512,
          "Free heap memory (MB) that malloc keeps for reuse instead of giving it back to the "
          "system (glibc's M_TRIM_THRESHOLD); 0 keeps glibc's default. gRPC receives each "
          "request into heap buffers: with glibc's default their pages go back to the system "
          "after the call and are faulted in again on the next (a 14.7 MB request: 2,400-3,700 "
          "page faults per call, 650-1,200 with 512; tests/benchmarks/transport/RESULTS.md)");
ABSL_FLAG(bool, gather_streaming_stores, false,
          "The gather threads write with non-temporal stores (x86-64): the bytes go to memory "
          "for the GPU's DMA without a read of each line first or a dirty copy in the caches "
          "(faster beyond the caches, slower within them; to be measured on a GPU host)");
ABSL_FLAG(int64_t, inline_request_bytes, moeserve::kInlineRequestBytesByBackend,
          "-2 (default): by backend, 0 on a GPU (an H200 host's one-token server total 56-59 -> "
          "45-48 us, 8 callers of the seed layer 3% more calls/s), -1 on the CPU. "
          "Forward requests up to this many bytes are decoded, gathered and queued on the gRPC "
          "thread that received them, larger ones on a worker thread (a hop: a sleeping "
          "worker's wake-up put 45-110 us into every call over 256 KiB on an H200 host, "
          "tests/benchmarks/serving/RESULTS.md); -1: every request on gRPC's thread; 0: every "
          "one on a worker, which also runs the call's step where the batcher would run it "
          "inline (--inline_max_tokens: nothing queued or running), so a one-token call meets "
          "no cold thread after gRPC's; with any value >= 0 a "
          "ForwardStream's and ModelInfer's calls, always decoded on a worker, run their steps "
          "there so too");
ABSL_FLAG(int64_t, upload_min_bytes, int64_t{4} << 20,
          "GPU engine: hidden_states of at least this many bytes sent as gRPC bytes go to the "
          "device while they are gathered (one part per gather thread, each part's 1 MiB chunk "
          "copied while its next chunk is gathered) instead of being gathered whole and copied "
          "in the engine's step (14.8 MB: 685 us against 777 us one after the other on an H200 "
          "host, tests/benchmarks/transport/RESULTS.md); 0: never");
ABSL_FLAG(int64_t, max_batch_tokens, 1024,
          "Most tokens in one engine step: concurrent Forward calls for the same layer are "
          "merged up to this many tokens (a larger call runs alone)");
ABSL_FLAG(int64_t, max_batch_delay_us, 0,
          "How long the oldest queued call waits for others to join its step; 0: merge only "
          "what is queued when the engine is free (no added latency for a lone caller)");
ABSL_FLAG(int64_t, company_wait_us, -2,
          "When a layer's recent steps merged several calls (or served several callers: "
          "connections, streams) and fewer are queued, how long the oldest may wait for the "
          "rest (never longer than twice the layer's last step); a lone caller's layer never "
          "waits; 0: off. Pays where a step's time barely grows with its tokens (measured: "
          "BF16 decode of the seed layer, 1000 us: 8 callers +10%), costs where it grows "
          "(MXFP8 decode: -14%). -1: auto: per layer, steps with and without the wait are "
          "measured in turns (epochs of 8 steps) and the mode that served more calls per "
          "second is kept, the other measured again after a second and 16 of its epochs, or "
          "once the layer's callers change; -2: by backend (-1 on a GPU, 0 on the CPU)");
ABSL_FLAG(int64_t, lane_lead_us, -1,
          "With two or more steps in flight (a GPU): a step of fewer than half of "
          "--max_batch_tokens starts beside a running one once that one is expected (from recent "
          "steps' times) to end within this many us and the callers its layer expects back are "
          "queued (and come back, on average, within its expected time less the lead), so that "
          "its staging and launch overlap the running step's device work; 0: it "
          "waits for the running step to end; -1: 120 on a GPU backend, 0 on the CPU (three "
          "H100 hosts, seed layer MXFP8, 8 callers: 6-10% more calls/s, p50 10% lower; "
          "tests/benchmarks/serving/RESULTS.md 2026-12-06 10:30)");
ABSL_FLAG(int64_t, stage_timing_every, 16,
          "Engine steps that run their stage timers (prepare/experts/finalize in replies and in "
          "moeserve_forward_stage_seconds): the step of every call that asks for timings "
          "(return_timings), and one in this many of the others. On a GPU the timers record "
          "device events, 9 us of a one-token graphed step (H200: 30.7 untimed, 39.4 timed); 1: "
          "time every step");
ABSL_FLAG(int64_t, step_spin_us, -1,
          "How long an idle scheduling thread polls for the next gRPC call before it sleeps "
          "(one thread; it keeps a core busy while calls come within this window), and, when "
          "--inline_request_bytes hands requests to workers, as long an idle worker polls for "
          "the next one (one more thread). A "
          "sleeping thread's wake-up adds tens of us to a call (H200 host, one-token call: "
          "server total 70.8 -> 54.1 us polling); 0: sleep at once; -1: 2000 on a GPU backend, "
          "0 on the CPU backend (whose steps need the cores)");
ABSL_FLAG(bool, warm_graphs, true,
          "Before serving, run a step of every CUDA graph size up to --max_batch_tokens for every "
          "layer on every engine lane, so that no call waits for a graph capture (an eager step "
          "and a capture, milliseconds, on each size's first use: a fresh server's first second "
          "of an overload read p99 13-18 ms without, 3.7-3.9 with, H100 2026-12-06); startup "
          "grows with layers x sizes (32 sizes to 1024 tokens, 2 lanes: about 0.5 s per MoE "
          "layer on an H100); nothing to do without CUDA graphs (the CPU backend)");
ABSL_FLAG(bool, parallel_answers, true,
          "Send the answers of a merged engine step from the --server_threads workers at once "
          "rather than one after another from the step's thread");
ABSL_FLAG(int64_t, max_queued_tokens, 32768,
          "Most tokens queued for the engine; calls beyond it are refused at once with "
          "RESOURCE_EXHAUSTED");
ABSL_FLAG(double, max_queue_wait_ms, 0,
          "Refuse a Forward with RESOURCE_EXHAUSTED when it would wait more than this many "
          "milliseconds for its engine step to start: the steps running and the tokens queued "
          "ahead, timed by a line (a fixed cost plus a cost per token) fitted to recent steps; a "
          "call that finds an engine lane idle and nothing queued is always taken. Bounds the "
          "latency of answered calls under overload; the server times steps of 16, 1/4 and all of "
          "--max_batch_tokens tokens before it serves, so that the bound holds from the first "
          "call (also with --lane_lead_us); 0: off (--max_queued_tokens only)");
ABSL_FLAG(int64_t, max_message_bytes, 0,
          "Largest request accepted, in bytes (RESOURCE_EXHAUSTED beyond, naming the limit); 0: "
          "derived from the model so that --max_tokens_per_request tokens of fp32 hidden states "
          "(and one expert's weights) fit. A smaller value lowers --max_tokens_per_request to "
          "fit, with a log line");
ABSL_FLAG(bool, enable_shared_memory, false,
          "Accept shared-memory regions (Register*SharedMemory RPCs; Forward tensors and answers "
          "by region) from clients on this host (unix socket or loopback). Off by default: such "
          "a client may name any shm object the server's user can open, and have it written");
ABSL_FLAG(int32_t, max_forward_channels, 16,
          "With --enable_shared_memory: most forward channels (RegisterForwardChannel; Forward "
          "calls through a shared-memory object, each served by a polling thread) at once");
ABSL_FLAG(int64_t, forward_channel_spin_us, 2000,
          "How long a forward channel's thread keeps polling after a call before it sleeps on "
          "the doorbell (a frontend's next layer call usually comes within a millisecond; each "
          "polling channel keeps one core busy meanwhile). 0: sleep at once (a futex wake per "
          "call)");
ABSL_FLAG(int64_t, max_tokens_per_request, 8192,
          "Most tokens (M) one Forward / ModelInfer may carry; more fail with "
          "RESOURCE_EXHAUSTED naming hidden_states' M");
// Limits on what clients can make the server hold (README "Limits"; server/server.h).
ABSL_FLAG(int64_t, max_queued_bytes, int64_t{512} << 20,
          "Most request + answer bytes all Forward calls in progress may hold (from arrival "
          "until the client has the answer); calls beyond it are refused at once with "
          "RESOURCE_EXHAUSTED (0: no limit)");
ABSL_FLAG(int64_t, max_answer_hold_ms, 10000,
          "A finished answer the client does not take within this long is cancelled, releasing "
          "its memory (the client sees CANCELLED; 0: wait as long as the connection lives)");
ABSL_FLAG(std::string, grpc_channel_args, "",
          "Further integer gRPC channel arguments for the listener, name=value[,name=value...] "
          "(e.g. grpc.http2.max_frame_size=1048576), for tuning the transport");
ABSL_FLAG(int32_t, max_concurrent_streams, 128,
          "Most concurrent calls on one HTTP/2 connection (GRPC_ARG_MAX_CONCURRENT_STREAMS)");
ABSL_FLAG(int64_t, grpc_memory_bytes, int64_t{1} << 30,
          "Memory gRPC itself may use for connections and buffers (its ResourceQuota)");
ABSL_FLAG(int32_t, grpc_max_threads, 64, "Most threads gRPC may start (its ResourceQuota)");
ABSL_FLAG(int32_t, max_metadata_bytes, 64 << 10,
          "Largest metadata (headers) one call may send; an oversized header fails its call and "
          "may fail the other calls of its connection (gRPC behaviour), so keep this well above "
          "what clients send (GRPC_ARG_MAX_METADATA_SIZE)");
ABSL_FLAG(std::string, metrics_address, moeserve::kDefaultMetricsAddress,
          "host:port of the Prometheus /metrics endpoint (empty: off; port 0: a free port; "
          "0.0.0.0 for every interface)");
// Security (docs/security.md).
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate chain for the gRPC API: with --tls_key, every --listen address "
          "serves TLS only");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA bundle: clients must present a certificate signed by it (mutual TLS)");
ABSL_FLAG(int32_t, tls_refresh_s, moeserve::kDefaultTlsRefreshSeconds,
          "How often the API's TLS files (--tls_*) are re-read, in seconds: certificates "
          "rotate without a restart (the metrics endpoint's --metrics_tls_* files are checked "
          "every second and re-read when they change)");
ABSL_FLAG(std::string, auth_token_file, "",
          "File of bearer tokens (one per line, >= 16 characters; '#' comments): every "
          "moeserve.v1.MoeService call and every KServe v2 call but ServerLive / ServerReady "
          "must send 'authorization: Bearer <token>' (UNAUTHENTICATED otherwise); health and "
          "reflection stay open. Re-read on change");
ABSL_FLAG(bool, enable_reflection, false,
          "Serve gRPC server reflection (grpcurl without .proto files)");
ABSL_FLAG(bool, enable_get_expert_weights, false,
          "Serve GetExpertWeights and StreamExpertWeights (moeserve-cli forward --check needs "
          "them); anyone who can call them can copy the model's weights");
ABSL_FLAG(std::string, metrics_tls_cert, "",
          "PEM certificate chain for the metrics endpoint: with --metrics_tls_key it serves "
          "HTTPS only");
ABSL_FLAG(std::string, metrics_tls_key, "", "PEM private key of --metrics_tls_cert");
ABSL_FLAG(std::string, metrics_tls_client_ca, "",
          "PEM CA bundle: scrapers must present a certificate signed by it (mutual TLS)");
ABSL_FLAG(std::string, ready_file, "",
          "If set, once serving write 'HOST:PORT' (first listen address, bound port) and, with "
          "metrics on, 'metrics HOST:PORT' to this file (atomically)");
// Multi-process (multi-node) serving; see server/internal_bootstrap.h for the LeaderWorkerSet
// environment (LWS_GROUP_SIZE, LWS_WORKER_INDEX, LWS_LEADER_ADDRESS) these fall back to.
ABSL_FLAG(int32_t, world_size, 0,
          "Total expert-parallel ranks over all processes (0: LWS_GROUP_SIZE * --ranks, else "
          "single process); more than --ranks turns on multi-process mode (backend cuda)");
ABSL_FLAG(int32_t, node_rank, -1,
          "This process's index in the group, 0 = leader (-1: LWS_WORKER_INDEX, else 0)");
ABSL_FLAG(std::string, leader_address, "",
          "host:port of the leader's internal bootstrap service (empty: LWS_LEADER_ADDRESS "
          "with --leader_port); the leader listens on its port");
ABSL_FLAG(int32_t, leader_port, moeserve::kDefaultLeaderPort,
          "Port of the bootstrap service when the leader address comes from LWS_LEADER_ADDRESS");
ABSL_FLAG(std::string, bootstrap_listen, "",
          "Leader: host:port its bootstrap service listens on while the group forms (empty: "
          "the leader address itself, whose host must be an address of this machine)");
ABSL_FLAG(std::string, bootstrap_token_file, "",
          "File of bearer tokens (as --auth_token_file) guarding the bootstrap: the leader "
          "requires one, a follower sends the first; give every process the same file");
ABSL_FLAG(std::string, internal_tls_cert, "",
          "PEM certificate chain of this process for the multi-process bootstrap (mutual TLS, "
          "with --internal_tls_key and --internal_tls_ca on every process)");
ABSL_FLAG(std::string, internal_tls_key, "", "PEM private key of --internal_tls_cert");
ABSL_FLAG(std::string, internal_tls_ca, "",
          "PEM CA bundle that signs every process's --internal_tls_cert");
ABSL_FLAG(std::string, internal_tls_server_name, "",
          "Follower: name the leader's certificate must carry (empty: the leader address's "
          "host)");
ABSL_FLAG(int32_t, bootstrap_timeout_s, 300,
          "Follower: how long to keep asking the leader for the group's id");
ABSL_FLAG(int64_t, collective_timeout_ms, 60000,
          "How long a rank waits for its peers in one collective before failing (the NCCL "
          "group's formation at start: --group_formation_timeout_s); followers also wait at "
          "most this long for the next command");
ABSL_FLAG(int64_t, group_formation_timeout_s, 600,
          "Multi-process: how long the GPU ranks' NCCL group may take to form at start (each "
          "process joins after loading its own weights, so this covers the slowest load's lag; "
          "at least --collective_timeout_ms is used)");
ABSL_FLAG(int64_t, heartbeat_ms, 1000,
          "Multi-process leader: idle no-op command to the followers this often; at most "
          "--collective_timeout_ms / 3 (a follower waits at most that long for a command)");
ABSL_FLAG(int64_t, debug_load_delay_ms, 0,
          "Sleep this long after each loaded layer shard: makes the startup (health NOT_SERVING, "
          "progress lines, UNAVAILABLE while loading) observable in tests and demos; 0: off");

namespace moeserve {
namespace {

absl::StatusOr<EngineOptions> EngineOptionsFromFlags() {
  EngineOptions options;
  MOESERVE_ASSIGN_OR_RETURN(ModelConfig model, ModelPreset(absl::GetFlag(FLAGS_model)));
  ModelOverrides overrides;
  auto positive = [](auto v) { return v > 0 ? std::optional(v) : std::nullopt; };
  overrides.num_layers = positive(absl::GetFlag(FLAGS_num_layers));
  overrides.num_experts = positive(absl::GetFlag(FLAGS_num_experts));
  overrides.topk = positive(absl::GetFlag(FLAGS_topk));
  overrides.hidden = positive(absl::GetFlag(FLAGS_hidden));
  overrides.intermediate = positive(absl::GetFlag(FLAGS_intermediate));
  for (auto [name, value] :
       {std::pair<const char*, int64_t>{"num_layers", absl::GetFlag(FLAGS_num_layers)},
        {"num_experts", absl::GetFlag(FLAGS_num_experts)},
        {"topk", absl::GetFlag(FLAGS_topk)},
        {"hidden", absl::GetFlag(FLAGS_hidden)},
        {"intermediate", absl::GetFlag(FLAGS_intermediate)}}) {
    if (value < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", name, ": got ", value, ", expected >= 0 (0: preset value)"));
    }
  }
  MOESERVE_ASSIGN_OR_RETURN(options.model, ApplyOverrides(std::move(model), overrides));
  options.backend = absl::GetFlag(FLAGS_backend);
  options.experts = absl::GetFlag(FLAGS_experts);
  MOESERVE_ASSIGN_OR_RETURN(options.weight_format,
                            ParseWeightFormat(absl::GetFlag(FLAGS_weight_format)));
  options.checkpoint_dir = absl::GetFlag(FLAGS_checkpoint);
  options.num_ranks = absl::GetFlag(FLAGS_ranks);
  options.placement = absl::GetFlag(FLAGS_placement);
  options.prepare_finalize = absl::GetFlag(FLAGS_prepare_finalize);
  options.max_tokens_per_rank = absl::GetFlag(FLAGS_max_tokens_per_rank);
  options.steps_in_flight = absl::GetFlag(FLAGS_steps_in_flight);
  options.graph_max_tokens = absl::GetFlag(FLAGS_cuda_graph_max_tokens);
  options.seed = absl::GetFlag(FLAGS_seed);
  options.num_threads = absl::GetFlag(FLAGS_threads);
  options.max_tokens_per_request = absl::GetFlag(FLAGS_max_tokens_per_request);
  options.collective_timeout_ms = absl::GetFlag(FLAGS_collective_timeout_ms);
  if (absl::GetFlag(FLAGS_group_formation_timeout_s) <= 0 ||
      absl::GetFlag(FLAGS_group_formation_timeout_s) > 86400) {
    return absl::InvalidArgumentError(absl::StrCat("--group_formation_timeout_s: got ",
                                                   absl::GetFlag(FLAGS_group_formation_timeout_s),
                                                   ", expected 1 to 86400"));
  }
  options.group_formation_timeout_ms = absl::GetFlag(FLAGS_group_formation_timeout_s) * 1000;
  options.heartbeat_ms = absl::GetFlag(FLAGS_heartbeat_ms);
  return options;
}

// TLS files are checked here (readable, a key with every certificate) so that a bad flag fails
// before anything binds; gRPC and the metrics endpoint re-read them later.
absl::Status SecurityFromFlags(ProcessOptions* options) {
  ServerOptions& server = options->server;
  server.tls = {absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key),
                absl::GetFlag(FLAGS_tls_client_ca)};
  MOESERVE_RETURN_IF_ERROR(CheckTlsFiles(server.tls, "--tls_", TlsRole::kServer));
  server.metrics_tls = {absl::GetFlag(FLAGS_metrics_tls_cert), absl::GetFlag(FLAGS_metrics_tls_key),
                        absl::GetFlag(FLAGS_metrics_tls_client_ca)};
  MOESERVE_RETURN_IF_ERROR(CheckTlsFiles(server.metrics_tls, "--metrics_tls_", TlsRole::kServer));
  if (const std::string path = absl::GetFlag(FLAGS_auth_token_file); !path.empty()) {
    MOESERVE_ASSIGN_OR_RETURN(server.auth, BearerTokens::FromFile(path, "--auth_token_file"));
  }
  server.tls_refresh_s = absl::GetFlag(FLAGS_tls_refresh_s);
  if (server.tls_refresh_s <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls_refresh_s: got ", server.tls_refresh_s, ", expected > 0"));
  }
  server.enable_reflection = absl::GetFlag(FLAGS_enable_reflection);
  server.enable_get_expert_weights = absl::GetFlag(FLAGS_enable_get_expert_weights);
  BootstrapOptions& bootstrap = options->bootstrap;
  bootstrap.listen = absl::GetFlag(FLAGS_bootstrap_listen);
  bootstrap.security.tls = {absl::GetFlag(FLAGS_internal_tls_cert),
                            absl::GetFlag(FLAGS_internal_tls_key),
                            absl::GetFlag(FLAGS_internal_tls_ca)};
  MOESERVE_RETURN_IF_ERROR(
      CheckTlsFiles(bootstrap.security.tls, "--internal_tls_", TlsRole::kMutual));
  bootstrap.security.tls_server_name = absl::GetFlag(FLAGS_internal_tls_server_name);
  if (const std::string path = absl::GetFlag(FLAGS_bootstrap_token_file); !path.empty()) {
    MOESERVE_ASSIGN_OR_RETURN(bootstrap.security.token,
                              BearerTokens::FromFile(path, "--bootstrap_token_file"));
  }
  return absl::OkStatus();
}

absl::StatusOr<ProcessOptions> ProcessOptionsFromFlags() {
  ProcessOptions options;
  MOESERVE_ASSIGN_OR_RETURN(options.engine, EngineOptionsFromFlags());
  options.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  ServerOptions& server = options.server;
  server.listen_addresses = SplitListenAddresses(absl::GetFlag(FLAGS_listen));
  server.server_threads = absl::GetFlag(FLAGS_server_threads);
  server.gather_threads = absl::GetFlag(FLAGS_gather_threads);  // checked by MoeServer::Bind
  server.gather_streaming_stores = absl::GetFlag(FLAGS_gather_streaming_stores);
  // Checked by MoeServer::Bind.
  server.upload_min_bytes = absl::GetFlag(FLAGS_upload_min_bytes);
  server.inline_request_bytes = absl::GetFlag(FLAGS_inline_request_bytes);
  server.parallel_answers = absl::GetFlag(FLAGS_parallel_answers);
  server.warm_graphs = absl::GetFlag(FLAGS_warm_graphs);
  server.batcher.max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens);
  server.batcher.max_batch_delay = absl::Microseconds(absl::GetFlag(FLAGS_max_batch_delay_us));
  const int64_t company_wait_us = absl::GetFlag(FLAGS_company_wait_us);
  if (company_wait_us < -2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "batcher flags: --company_wait_us must be >= 0, -1 (auto) or -2 (by backend); got ",
        company_wait_us));
  }
  // -2: negative, "by backend" (ResolveCompanyWait).
  server.batcher.company_wait_auto = company_wait_us == -1;
  server.batcher.company_wait =
      company_wait_us == -1 ? kAutoCompanyWait : absl::Microseconds(company_wait_us);
  if (absl::GetFlag(FLAGS_lane_lead_us) < -1) {
    return absl::InvalidArgumentError(
        absl::StrCat("batcher flags: --lane_lead_us must be >= 0, or -1 (by backend); got ",
                     absl::GetFlag(FLAGS_lane_lead_us)));
  }
  // -1: "by backend" (ResolveLaneLead), as --step_spin_us.
  server.batcher.lane_lead = absl::Microseconds(absl::GetFlag(FLAGS_lane_lead_us));
  server.batcher.max_queued_tokens = absl::GetFlag(FLAGS_max_queued_tokens);
  server.batcher.inline_max_tokens = absl::GetFlag(FLAGS_inline_max_tokens);
  if (absl::GetFlag(FLAGS_step_spin_us) < -1) {
    return absl::InvalidArgumentError(
        absl::StrCat("batcher flags: --step_spin_us must be >= 0, or -1 (by backend); got ",
                     absl::GetFlag(FLAGS_step_spin_us)));
  }
  // -1: ServerOptions' "by backend", resolved when the engine is attached.
  server.batcher.idle_spin = absl::Microseconds(absl::GetFlag(FLAGS_step_spin_us));
  server.batcher.stage_timing_every = absl::GetFlag(FLAGS_stage_timing_every);
  server.batcher.max_queue_wait =
      absl::Microseconds(absl::GetFlag(FLAGS_max_queue_wait_ms) * 1000.0);
  // Refused here, before anything listens or loads (the batcher starts after the weights).
  ForwardBatcherOptions checked = server.batcher;
  checked.idle_spin = std::max(checked.idle_spin, absl::ZeroDuration());
  checked.lane_lead = std::max(checked.lane_lead, absl::ZeroDuration());
  checked.company_wait = std::max(checked.company_wait, absl::ZeroDuration());
  if (absl::Status s = ForwardBatcher::CheckOptions(checked); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "batcher flags (--max_batch_tokens, --max_batch_delay_us, --company_wait_us, "
        "--lane_lead_us, --max_queued_tokens, --inline_max_tokens, --max_queue_wait_ms, "
        "--step_spin_us, --stage_timing_every): ",
        s.message()));
  }
  server.enable_shared_memory = absl::GetFlag(FLAGS_enable_shared_memory);
  if (absl::GetFlag(FLAGS_max_forward_channels) < 1 ||
      absl::GetFlag(FLAGS_forward_channel_spin_us) < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_forward_channels (got ", absl::GetFlag(FLAGS_max_forward_channels),
                     ") must be >= 1 and --forward_channel_spin_us (got ",
                     absl::GetFlag(FLAGS_forward_channel_spin_us), ") >= 0"));
  }
  server.max_forward_channels = absl::GetFlag(FLAGS_max_forward_channels);
  server.forward_channel_spin = absl::Microseconds(absl::GetFlag(FLAGS_forward_channel_spin_us));
  server.health_poll = std::chrono::milliseconds(absl::GetFlag(FLAGS_health_poll_ms));
  server.recover_after = std::chrono::milliseconds(absl::GetFlag(FLAGS_recover_after_ms));
  server.metrics_address = absl::GetFlag(FLAGS_metrics_address);
  // Limits on what clients can make the server hold (the byte limits are checked against the
  // memory there is in startup.cc, once max_message_bytes is resolved).
  server.max_queued_bytes = absl::GetFlag(FLAGS_max_queued_bytes);
  server.max_answer_hold = std::chrono::milliseconds(absl::GetFlag(FLAGS_max_answer_hold_ms));
  server.max_concurrent_streams = absl::GetFlag(FLAGS_max_concurrent_streams);
  absl::StatusOr<std::vector<std::pair<std::string, int>>> channel_args =
      v1wire::ParseChannelArgs(absl::GetFlag(FLAGS_grpc_channel_args));
  if (!channel_args.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--grpc_channel_args: ", channel_args.status().message()));
  }
  server.grpc_channel_args = *std::move(channel_args);
  server.grpc_memory_bytes = absl::GetFlag(FLAGS_grpc_memory_bytes);
  server.grpc_max_threads = absl::GetFlag(FLAGS_grpc_max_threads);
  server.max_metadata_bytes = absl::GetFlag(FLAGS_max_metadata_bytes);
  MOESERVE_RETURN_IF_ERROR(SecurityFromFlags(&options));
  options.multi_process.world_size = absl::GetFlag(FLAGS_world_size);
  options.multi_process.node_rank = absl::GetFlag(FLAGS_node_rank);
  options.multi_process.leader_address = absl::GetFlag(FLAGS_leader_address);
  options.multi_process.leader_port = absl::GetFlag(FLAGS_leader_port);
  options.bootstrap_timeout = absl::Seconds(absl::GetFlag(FLAGS_bootstrap_timeout_s));
  options.ready_file = absl::GetFlag(FLAGS_ready_file);
  options.load_delay_ms = absl::GetFlag(FLAGS_debug_load_delay_ms);
  if (options.load_delay_ms < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--debug_load_delay_ms: got ", options.load_delay_ms, ", expected >= 0"));
  }
  return options;
}

// --help and --helpshort list every flag defined in this project's sources (absl's default
// lists only files named after the binary, which matched none: "No flags matched");
// --helpfull adds absl's own. --version prints the build.
void SetFlagsUsage() {
  absl::SetProgramUsageMessage(
      "Serves the expert layers of a Mixture-of-Experts model over gRPC (moeserve.v1 and the "
      "KServe v2 inference protocol).\n"
      "  moeserve --model=tiny --listen=127.0.0.1:50051 --metrics_address=127.0.0.1:9464\n"
      "  moeserve --version\n"
      "Listens on 127.0.0.1 unless told otherwise; TLS, tokens and the debug RPCs: "
      "docs/security.md");
  absl::FlagsUsageConfig config;
  auto ours = [](absl::string_view file) {
    return absl::StrContains(file, "server/") || absl::StrContains(file, "core/");
  };
  config.contains_helpshort_flags = ours;
  config.contains_help_flags = ours;
  config.version_string = [] {
    return absl::StrCat("moeserve ", build_info::kVersion, " (", build_info::kCommit, ")\n",
                        "build type: ", build_info::kBuildType, "\n",
                        "backends: ", build_info::kBackends, "\n",
                        "compiler: ", build_info::kCompiler, "\n");
  };
  config.normalize_filename = [](absl::string_view file) {
    // Paths relative to the source tree.
    for (absl::string_view dir : {"server/", "core/"}) {
      const size_t at = file.rfind(dir);
      if (at != absl::string_view::npos) return std::string(file.substr(at));
    }
    return std::string(file);
  };
  absl::SetFlagsUsageConfig(config);
}

// --malloc_trim_threshold_mb: set before the first call (later frees follow it). An allocator
// that is not glibc's (tcmalloc or jemalloc preloaded, a sanitizer's) refuses mallopt and keeps
// memory its own way: noted, not an error.
absl::Status SetMallocTrimThreshold(int64_t mb) {
  if (mb < 0 || mb > (int64_t{1} << 20)) {
    return absl::InvalidArgumentError(absl::StrCat("--malloc_trim_threshold_mb: got ", mb,
                                                   ", expected 0 (glibc's default) to 1048576"));
  }
#if defined(__GLIBC__)
  if (mb > 0 && mallopt(M_TRIM_THRESHOLD, static_cast<int>(std::min<int64_t>(
                                              mb << 20, std::numeric_limits<int>::max()))) != 1) {
    std::fprintf(stderr,
                 "moeserve: --malloc_trim_threshold_mb=%lld not applied: this process's malloc "
                 "refuses mallopt(M_TRIM_THRESHOLD) (not glibc's?)\n",
                 static_cast<long long>(mb));
  }
#endif
  return absl::OkStatus();
}

}  // namespace
}  // namespace moeserve

int main(int argc, char** argv) {
  // gRPC locks absl::Mutexes on every call; a distribution's Abseil may be built with the
  // lock-order graph on (seen in a server profile: GraphCycles on each lock, ~1.5% of a
  // 1-token call's CPU). The server's own locks are std::mutex.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  moeserve::SetFlagsUsage();
  absl::ParseCommandLine(argc, argv);
  absl::StatusOr<moeserve::ProcessOptions> options = moeserve::ProcessOptionsFromFlags();
  if (!options.ok()) {
    std::fprintf(stderr, "moeserve: bad flags: %s\n", options.status().ToString().c_str());
    return 1;
  }
  if (absl::Status s =
          moeserve::SetMallocTrimThreshold(absl::GetFlag(FLAGS_malloc_trim_threshold_mb));
      !s.ok()) {
    std::fprintf(stderr, "moeserve: bad flags: %s\n", s.ToString().c_str());
    return 1;
  }
  return moeserve::RunMoeserveProcess(*std::move(options));
}
