#include "server/metrics.h"

#include <prometheus/text_serializer.h>

#include <cmath>
#include <exception>
#include <iterator>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "core/background_release.h"
#include "core/status_macros.h"
#include "moeserve_build_info.h"
#include "server/buffer_pool.h"

namespace moeserve {

namespace {

// 100us .. 10s, 1-2.5-5 per decade.
prometheus::Histogram::BucketBoundaries LatencyBuckets() {
  return {1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2,
          5e-2, 0.1,    0.25, 0.5,  1.0,    2.5,  5.0,  10.0};
}

// Stages can be far shorter than a request: 10us .. 10s.
prometheus::Histogram::BucketBoundaries StageBuckets() {
  prometheus::Histogram::BucketBoundaries b = {1e-5, 2.5e-5, 5e-5};
  for (double v : LatencyBuckets()) b.push_back(v);
  return b;
}

}  // namespace

absl::string_view GrpcCodeName(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK:
      return "OK";
    case grpc::StatusCode::CANCELLED:
      return "CANCELLED";
    case grpc::StatusCode::UNKNOWN:
      return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT:
      return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND:
      return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS:
      return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED:
      return "PERMISSION_DENIED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION:
      return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED:
      return "ABORTED";
    case grpc::StatusCode::OUT_OF_RANGE:
      return "OUT_OF_RANGE";
    case grpc::StatusCode::UNIMPLEMENTED:
      return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL:
      return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE:
      return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS:
      return "DATA_LOSS";
    case grpc::StatusCode::UNAUTHENTICATED:
      return "UNAUTHENTICATED";
    default:
      return "UNKNOWN";
  }
}

absl::StatusOr<std::unique_ptr<Metrics>> Metrics::Create(const std::string& address,
                                                         const TlsFiles& tls) {
  auto m = std::unique_ptr<Metrics>(new Metrics());
  m->registry_ = std::make_shared<prometheus::Registry>();
  prometheus::Registry& r = *m->registry_;
  m->requests_ = &prometheus::BuildCounter()
                      .Name("moeserve_requests_total")
                      .Help("RPCs answered, by method and gRPC status code")
                      .Register(r);
  m->latency_ = &prometheus::BuildHistogram()
                     .Name("moeserve_request_latency_seconds")
                     .Help(
                         "Server-side RPC latency, from the call's arrival to its status, by "
                         "method")
                     .Register(r);
  m->tokens_ = &prometheus::BuildCounter()
                    .Name("moeserve_tokens_total")
                    .Help("Tokens answered by successful Forward calls")
                    .Register(r)
                    .Add({});
  auto& stages = prometheus::BuildHistogram()
                     .Name("moeserve_forward_stage_seconds")
                     .Help(
                         "Time per Forward stage: queue (worker + engine) of every call; "
                         "prepare, experts, finalize of the steps that ran their stage timers "
                         "(--stage_timing_every samples them)")
                     .Register(r);
  m->stage_queue_ = &stages.Add({{"stage", "queue"}}, StageBuckets());
  m->stage_prepare_ = &stages.Add({{"stage", "prepare"}}, StageBuckets());
  m->stage_experts_ = &stages.Add({{"stage", "experts"}}, StageBuckets());
  m->stage_finalize_ = &stages.Add({{"stage", "finalize"}}, StageBuckets());
  m->inflight_ = &prometheus::BuildGauge()
                      .Name("moeserve_inflight_requests")
                      .Help("RPCs received and not yet answered")
                      .Register(r)
                      .Add({});
  m->held_bytes_ = &prometheus::BuildGauge()
                        .Name("moeserve_held_bytes")
                        .Help(
                            "Request and answer bytes held by Forward calls, from arrival until "
                            "gRPC is done with them (bounded by --max_queued_bytes)")
                        .Register(r)
                        .Add({});
  m->answers_cancelled_ = &prometheus::BuildCounter()
                               .Name("moeserve_unread_answers_cancelled_total")
                               .Help(
                                   "Calls cancelled because the client did not take the answer "
                                   "within --max_answer_hold_ms")
                               .Register(r)
                               .Add({});
  prometheus::Histogram::BucketBoundaries powers_of_two;
  for (int e = 0; e <= 14; ++e) powers_of_two.push_back(std::ldexp(1.0, e));  // 1 .. 16384
  m->batch_calls_ = &prometheus::BuildHistogram()
                         .Name("moeserve_batch_calls")
                         .Help("Forward calls merged into one engine step")
                         .Register(r)
                         .Add({}, powers_of_two);
  m->batch_tokens_ = &prometheus::BuildHistogram()
                          .Name("moeserve_batch_tokens")
                          .Help("Tokens in one engine step (all its calls)")
                          .Register(r)
                          .Add({}, powers_of_two);
  m->queued_tokens_ = &prometheus::BuildGauge()
                           .Name("moeserve_queued_tokens")
                           .Help("Tokens waiting for an engine step (after the last step)")
                           .Register(r)
                           .Add({});
  m->lead_steps_ = &prometheus::BuildCounter()
                        .Name("moeserve_batch_lead_steps_total")
                        .Help(
                            "Small engine steps started beside running ones due to end within "
                            "--lane_lead_us")
                        .Register(r)
                        .Add({});
  m->merging_layers_ = &prometheus::BuildGauge()
                            .Name("moeserve_batch_merging_layers")
                            .Help(
                                "Layers whose calls wait for the callers that shared their "
                                "steps, as --company_wait_us -1 measured to serve more")
                            .Register(r)
                            .Add({});
  m->merged_steps_ = &prometheus::BuildCounter()
                          .Name("moeserve_batch_merged_steps_total")
                          .Help("Engine steps that merged several Forward calls")
                          .Register(r)
                          .Add({});
  auto& phases = prometheus::BuildCounter()
                     .Name("moeserve_batch_merged_step_seconds_total")
                     .Help(
                         "Where merged steps' time went, by phase: arrivals (first call to "
                         "last), take (last arrival to the step's start), merge (rows gathered), "
                         "engine, answers (engine's end to the last answer handed on)")
                     .Register(r);
  const char* const kPhases[] = {"arrivals", "take", "merge", "engine", "answers"};
  for (size_t i = 0; i < m->merged_phase_.size(); ++i) {
    m->merged_phase_[i] = &phases.Add({{"phase", kPhases[i]}});
  }
  m->turnaround_ = &prometheus::BuildHistogram()
                        .Name("moeserve_caller_turnaround_seconds")
                        .Help(
                            "From a caller's engine step's end to its next call of that layer "
                            "(its answer, its own work, its request's way in); callers known "
                            "by their connection or stream, measured while the batcher keeps "
                            "their history (--company_wait_us or --lane_lead_us, on by "
                            "default on a GPU)")
                        .Register(r)
                        .Add({}, StageBuckets());
  m->refused_ = &prometheus::BuildCounter()
                     .Name("moeserve_forward_refused_total")
                     .Help(
                         "Forward calls answered without running (or stopped between stages), "
                         "by reason: queue_full, memory, deadline, cancelled")
                     .Register(r);
  m->model_info_ = &prometheus::BuildGauge()
                        .Name("moeserve_model_info")
                        .Help("The served model and configuration (value is always 1)")
                        .Register(r);
  prometheus::BuildGauge()
      .Name("moeserve_build_info")
      .Help("The binary: version, commit (git describe), build type, backends (value is always 1)")
      .Register(r)
      .Add({{"version", build_info::kVersion},
            {"commit", build_info::kCommit},
            {"build_type", build_info::kBuildType},
            {"backend", build_info::kBackends}})
      .Set(1);
  m->weights_planned_ = &prometheus::BuildGauge()
                             .Name("moeserve_weights_planned_bytes")
                             .Help("Expert weight bytes this process loads (host memory)")
                             .Register(r)
                             .Add({});
  m->weights_loaded_ = &prometheus::BuildGauge()
                            .Name("moeserve_weights_loaded_bytes")
                            .Help("Expert weight bytes loaded so far")
                            .Register(r)
                            .Add({});
  m->load_seconds_ = &prometheus::BuildGauge()
                          .Name("moeserve_weights_load_seconds")
                          .Help("How long the weight load took (0 until it finished)")
                          .Register(r)
                          .Add({});
  m->serving_ = &prometheus::BuildGauge()
                     .Name("moeserve_serving")
                     .Help(
                         "1 while the health service reports SERVING, else 0 (loading, "
                         "unhealthy, shutting down)")
                     .Register(r)
                     .Add({});
  m->received_bytes_ = &prometheus::BuildCounter()
                            .Name("moeserve_received_bytes_total")
                            .Help("Request message bytes received, by method")
                            .Register(r);
  m->sent_bytes_ = &prometheus::BuildCounter()
                        .Name("moeserve_sent_bytes_total")
                        .Help("Response message bytes sent, by method")
                        .Register(r);
  // Read at each scrape (process-wide, so not updated by calls).
  auto& pool = prometheus::BuildGauge()
                   .Name("moeserve_host_buffer_pool_bytes")
                   .Help(
                       "The request/answer buffer pool's host memory: kind=pinned, page-locked "
                       "(in use or free; never unlocked while serving, at most 2 GiB); "
                       "kind=free, on its free list")
                   .Register(r);
  prometheus::Gauge* pool_pinned = &pool.Add({{"kind", "pinned"}});
  prometheus::Gauge* pool_free = &pool.Add({{"kind", "free"}});
  prometheus::Gauge* releases_pending =
      &prometheus::BuildGauge()
           .Name("moeserve_background_releases_pending")
           .Help(
               "Memory releases queued for the background release thread and not yet run (one "
               "that waits for the GPU holds every thread's CUDA calls until the device drains)")
           .Register(r)
           .Add({});
  m->refresh_ = [pool_pinned, pool_free, releases_pending] {
    const PooledBufferStats stats = GetPooledBufferStats();
    pool_pinned->Set(static_cast<double>(stats.pinned_bytes));
    pool_free->Set(static_cast<double>(stats.free_bytes));
    const BackgroundReleaseCounts releases = GetBackgroundReleaseCounts();
    releases_pending->Set(static_cast<double>(releases.queued - releases.done));
  };
  if (address.empty()) return m;

  std::weak_ptr<prometheus::Registry> registry = m->registry_;
  auto render = [registry, refresh = m->refresh_] {
    auto r = registry.lock();
    if (!r) return std::string();
    refresh();  // (the gauges belong to the registry, alive while it is)
    return prometheus::TextSerializer().Serialize(r->Collect());
  };
  MOESERVE_ASSIGN_OR_RETURN(m->http_, MetricsHttpServer::Start(address, render, tls));
  m->port_ = m->http_->port();
  const size_t colon = address.rfind(':');
  const std::string host = colon == std::string::npos ? "0.0.0.0" : address.substr(0, colon);
  m->bound_address_ = absl::StrCat(host, ":", m->port_);
  return m;
}

Metrics::~Metrics() {
  // Stop serving HTTP before the registry and metrics go away.
  http_.reset();
}

void Metrics::SetModelInfo(const EngineInfo& info) {
  model_info_
      ->Add({{"model", info.model.name},
             {"backend", info.backend},
             {"weight_format", std::string(WeightFormatName(info.weight_format))},
             {"num_ranks", absl::StrCat(info.num_ranks)},
             {"experts", info.experts},
             {"prepare_finalize", info.prepare_finalize}})
      .Set(1);
  auto& layers = prometheus::BuildCounter()
                     .Name("moeserve_layer_tokens_total")
                     .Help("Tokens answered by successful calls, by MoE layer")
                     .Register(*registry_);
  layer_tokens_.assign(info.model.num_layers, nullptr);
  for (int l = 0; l < info.model.num_layers; ++l) {
    if (info.model.IsMoeLayer(l)) layer_tokens_[l] = &layers.Add({{"layer", absl::StrCat(l)}});
  }
  auto& ranks = prometheus::BuildCounter()
                    .Name("moeserve_rank_tokens_total")
                    .Help(
                        "Tokens dispatched to each expert-parallel rank by successful calls (a "
                        "token counts once per rank hosting one of its experts): expert balance")
                    .Register(*registry_);
  expert_rank_.assign(info.model.num_experts, 0);
  rank_tokens_.clear();
  for (size_t r = 0; r < info.rank_experts.size(); ++r) {
    rank_tokens_.push_back(&ranks.Add({{"rank", absl::StrCat(r)}}));
    for (int e : info.rank_experts[r]) {
      if (e >= 0 && e < info.model.num_experts) expert_rank_[e] = static_cast<int>(r);
    }
  }
}

void Metrics::SetLoadProgress(int64_t planned_bytes, int64_t loaded_bytes, double load_seconds) {
  weights_planned_->Set(static_cast<double>(planned_bytes));
  weights_loaded_->Set(static_cast<double>(loaded_bytes));
  if (load_seconds >= 0) load_seconds_->Set(load_seconds);
}

void Metrics::SetServing(bool serving) { serving_->Set(serving ? 1 : 0); }

Metrics::MethodSeries& Metrics::SeriesOf(absl::string_view method) {
  std::lock_guard<std::mutex> lock(series_mu_);
  auto it = series_.find(method);
  if (it != series_.end()) return *it->second;
  auto series = std::make_unique<MethodSeries>();
  const std::string m(method);
  series->received = &received_bytes_->Add({{"method", m}});
  series->sent = &sent_bytes_->Add({{"method", m}});
  series->latency = &latency_->Add({{"method", m}}, LatencyBuckets());
  MethodSeries& out = *series;
  series_.emplace(m, std::move(series));
  return out;
}

void Metrics::AddBytes(absl::string_view method, int64_t received, int64_t sent) {
  MethodSeries& s = SeriesOf(method);
  s.received->Increment(static_cast<double>(received));
  s.sent->Increment(static_cast<double>(sent));
}

std::vector<int64_t> Metrics::RankTokens(const TensorView& topk_ids) const {
  std::vector<int64_t> counts(rank_tokens_.size(), 0);
  if (counts.empty() || topk_ids.rank() != 2) return counts;
  const int64_t m = topk_ids.dim(0), k = topk_ids.dim(1);
  const int num_experts = static_cast<int>(expert_rank_.size());
  // last[r]: the last token counted for rank r (a token counts once per rank).
  std::vector<int64_t> last(counts.size(), -1);
  for (int64_t t = 0; t < m; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int64_t id = topk_ids.dtype() == DType::kINT64 ? topk_ids.data<int64_t>()[t * k + j]
                                                           : topk_ids.data<int32_t>()[t * k + j];
      if (id < 0 || id >= num_experts) continue;
      const int r = expert_rank_[id];
      if (last[r] != t) {
        last[r] = t;
        ++counts[r];
      }
    }
  }
  return counts;
}

void Metrics::RecordRouting(int layer, int64_t tokens, const std::vector<int64_t>& rank_tokens) {
  if (layer >= 0 && layer < static_cast<int>(layer_tokens_.size()) && layer_tokens_[layer]) {
    layer_tokens_[layer]->Increment(static_cast<double>(tokens));
  }
  for (size_t r = 0; r < rank_tokens.size() && r < rank_tokens_.size(); ++r) {
    if (rank_tokens[r] > 0) rank_tokens_[r]->Increment(static_cast<double>(rank_tokens[r]));
  }
}

void Metrics::RecordRequest(absl::string_view method, grpc::StatusCode code, double seconds) {
  MethodSeries& s = SeriesOf(method);
  const int c = static_cast<int>(code);
  const bool cached = c >= 0 && c < static_cast<int>(s.by_code.size());
  prometheus::Counter* counter = cached ? s.by_code[c].load(std::memory_order_acquire) : nullptr;
  if (counter == nullptr) {  // Family::Add returns the same series for the same labels
    counter = &requests_->Add(
        {{"method", std::string(method)}, {"code", std::string(GrpcCodeName(code))}});
    if (cached) s.by_code[c].store(counter, std::memory_order_release);
  }
  counter->Increment();
  s.latency->Observe(seconds);
}

void Metrics::AddTokens(int64_t tokens) { tokens_->Increment(static_cast<double>(tokens)); }

void Metrics::OnStep(int64_t calls, int64_t tokens, int64_t queued_tokens) {
  batch_calls_->Observe(static_cast<double>(calls));
  batch_tokens_->Observe(static_cast<double>(tokens));
  queued_tokens_->Set(static_cast<double>(queued_tokens));
}

void Metrics::OnRefused(absl::StatusCode reason) {
  const char* name = reason == absl::StatusCode::kResourceExhausted  ? "queue_full"
                     : reason == absl::StatusCode::kDeadlineExceeded ? "deadline"
                                                                     : "cancelled";
  refused_->Add({{"reason", name}}).Increment();
}

void Metrics::OnMergedStep(const MergedStepTimes& times) {
  merged_steps_->Increment();
  const absl::Duration phases[] = {times.arrivals, times.take, times.merge, times.engine,
                                   times.answers};
  static_assert(std::size(phases) == std::tuple_size_v<decltype(merged_phase_)>);
  for (size_t i = 0; i < merged_phase_.size(); ++i) {
    merged_phase_[i]->Increment(absl::ToDoubleSeconds(phases[i]));
  }
}

void Metrics::OnTurnaround(absl::Duration turnaround) {
  turnaround_->Observe(absl::ToDoubleSeconds(turnaround));
}

void Metrics::RecordStages(double queue_us, const ForwardTimings& timings) {
  stage_queue_->Observe(queue_us * 1e-6);
  if (!timings.stages_timed) return;  // a step that ran without its stage timers
  const StageTimings& stages = timings.stages;
  stage_prepare_->Observe(stages.prepare_us * 1e-6);
  stage_experts_->Observe(stages.experts_us * 1e-6);
  stage_finalize_->Observe(stages.finalize_us * 1e-6);
}

}  // namespace moeserve
