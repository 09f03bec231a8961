// Prometheus metrics of one moeserve process, served over HTTP at /metrics.
//
// Thread-safe: every recording method may be called from any thread.
#ifndef MOESERVE_SERVER_METRICS_H_
#define MOESERVE_SERVER_METRICS_H_

#include <grpcpp/support/status.h>
#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/engine.h"
#include "core/forward_batcher.h"
#include "server/metrics_http.h"

namespace moeserve {

// Also the ForwardBatcher's observer: moeserve_batch_calls / moeserve_batch_tokens per step,
// moeserve_queued_tokens, moeserve_batch_lead_steps_total, moeserve_batch_merging_layers,
// moeserve_batch_merged_step_seconds_total{phase}, moeserve_caller_turnaround_seconds,
// moeserve_forward_refused_total{reason}.
class Metrics : public ForwardBatcherObserver {
 public:
  // Creates the registry and, unless `address` ("host:port", port 0 picks a free one) is
  // empty, an HTTP endpoint (GET /metrics) bound to it, over TLS when `tls` is set.
  // UNAVAILABLE if the address cannot be bound; INVALID_ARGUMENT for unusable TLS files.
  // moeserve_build_info{version,commit,build_type,backend} = 1 from the start.
  static absl::StatusOr<std::unique_ptr<Metrics>> Create(const std::string& address,
                                                         const TlsFiles& tls = {});
  ~Metrics();

  // moeserve_model_info{model,backend,weight_format,num_ranks,experts,prepare_finalize} = 1,
  // and the per-layer and per-rank token counters (zero) of every MoE layer and rank. Call once,
  // before RecordRouting.
  void SetModelInfo(const EngineInfo& info);

  // Startup: moeserve_weights_planned_bytes, moeserve_weights_loaded_bytes and, once the load
  // finished (`load_seconds` >= 0), moeserve_weights_load_seconds.
  void SetLoadProgress(int64_t planned_bytes, int64_t loaded_bytes, double load_seconds = -1);
  // moeserve_serving: 1 while health reports SERVING.
  void SetServing(bool serving);

  // Message bytes of one RPC: moeserve_received_bytes_total{method} and
  // moeserve_sent_bytes_total{method}.
  void AddBytes(absl::string_view method, int64_t received, int64_t sent);
  // Per rank, how many of the call's tokens it receives (a token counts once for every rank that
  // hosts at least one of its experts; ids must be valid). Empty before SetModelInfo.
  std::vector<int64_t> RankTokens(const TensorView& topk_ids) const;
  // A successful call of `tokens` tokens on `layer`: moeserve_layer_tokens_total{layer} and
  // moeserve_rank_tokens_total{rank} (expert balance) from RankTokens' counts.
  void RecordRouting(int layer, int64_t tokens, const std::vector<int64_t>& rank_tokens);

  // One answered RPC: moeserve_requests_total{method,code} and
  // moeserve_request_latency_seconds{method}. The server's interceptor records every call
  // (server/call_accounting.h); handlers do not.
  void RecordRequest(absl::string_view method, grpc::StatusCode code, double seconds);
  // Tokens answered by successful Forwards: moeserve_tokens_total.
  void AddTokens(int64_t tokens);
  // moeserve_forward_stage_seconds{stage=queue|prepare|experts|finalize}; queue_us includes
  // the wait for a server worker. The engine stages only of steps that ran their stage timers
  // (timings.stages_timed; --stage_timing_every samples them), the queue of every call.
  void RecordStages(double queue_us, const ForwardTimings& timings);
  void OnStep(int64_t calls, int64_t tokens, int64_t queued_tokens) override;
  void OnRefused(absl::StatusCode reason) override;
  // moeserve_batch_lead_steps_total.
  void OnLeadStep() override { lead_steps_->Increment(); }
  // moeserve_batch_merging_layers (--company_wait_us -1).
  void OnCompanyMode(bool merging) override {
    merging ? merging_layers_->Increment() : merging_layers_->Decrement();
  }
  // moeserve_batch_merged_steps_total and moeserve_batch_merged_step_seconds_total{phase=
  // arrivals|take|merge|engine|answers}: where merged steps' time went (MergedStepTimes).
  void OnMergedStep(const MergedStepTimes& times) override;
  // moeserve_caller_turnaround_seconds: from a caller's step's end to its next call of the layer.
  void OnTurnaround(absl::Duration turnaround) override;
  // moeserve_inflight_requests.
  void IncrementInflight() { inflight_->Increment(); }
  void DecrementInflight() { inflight_->Decrement(); }
  // moeserve_held_bytes: request and answer bytes held by Forward calls (--max_queued_bytes).
  void SetHeldBytes(int64_t bytes) { held_bytes_->Set(static_cast<double>(bytes)); }
  // moeserve_forward_refused_total{reason="memory"}: refused at --max_queued_bytes.
  void OnRefusedForMemory() { refused_->Add({{"reason", "memory"}}).Increment(); }
  // moeserve_unread_answers_cancelled_total: answers the client did not take within
  // --max_answer_hold_ms.
  void OnAnswerCancelled() { answers_cancelled_->Increment(); }

  // Bound HTTP port, 0 when metrics are off.
  int port() const { return port_; }
  // "host:port" with the bound port; empty when metrics are off.
  const std::string& address() const { return bound_address_; }
  prometheus::Registry& registry() { return *registry_; }

 private:
  Metrics() = default;

  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<MetricsHttpServer> http_;
  int port_ = 0;
  std::string bound_address_;

  prometheus::Family<prometheus::Counter>* requests_ = nullptr;
  prometheus::Family<prometheus::Histogram>* latency_ = nullptr;
  prometheus::Counter* tokens_ = nullptr;
  prometheus::Histogram* stage_queue_ = nullptr;
  prometheus::Histogram* stage_prepare_ = nullptr;
  prometheus::Histogram* stage_experts_ = nullptr;
  prometheus::Histogram* stage_finalize_ = nullptr;
  prometheus::Gauge* inflight_ = nullptr;
  prometheus::Gauge* held_bytes_ = nullptr;
  // Sets the gauges read at scrape time (the host buffer pool, pending background releases).
  std::function<void()> refresh_;
  prometheus::Counter* answers_cancelled_ = nullptr;
  prometheus::Histogram* batch_calls_ = nullptr;
  prometheus::Histogram* batch_tokens_ = nullptr;
  prometheus::Gauge* queued_tokens_ = nullptr;
  prometheus::Counter* lead_steps_ = nullptr;
  prometheus::Gauge* merging_layers_ = nullptr;
  prometheus::Counter* merged_steps_ = nullptr;
  // moeserve_batch_merged_step_seconds_total by phase, in MergedStepTimes' order.
  std::array<prometheus::Counter*, 5> merged_phase_{};
  prometheus::Histogram* turnaround_ = nullptr;
  prometheus::Family<prometheus::Counter>* refused_ = nullptr;
  prometheus::Family<prometheus::Gauge>* model_info_ = nullptr;
  prometheus::Gauge* weights_planned_ = nullptr;
  prometheus::Gauge* weights_loaded_ = nullptr;
  prometheus::Gauge* load_seconds_ = nullptr;
  prometheus::Gauge* serving_ = nullptr;
  prometheus::Family<prometheus::Counter>* received_bytes_ = nullptr;
  prometheus::Family<prometheus::Counter>* sent_bytes_ = nullptr;
  // A method's series, looked up once: Family::Add builds a label map, hashes it and locks the
  // family on every call (a few thousand instructions per Forward otherwise).
  struct MethodSeries {
    prometheus::Counter* received = nullptr;
    prometheus::Counter* sent = nullptr;
    prometheus::Histogram* latency = nullptr;
    std::array<std::atomic<prometheus::Counter*>, 17> by_code{};  // grpc::StatusCode 0..16
  };
  MethodSeries& SeriesOf(absl::string_view method);
  std::mutex series_mu_;
  absl::flat_hash_map<std::string, std::unique_ptr<MethodSeries>> series_;  // by method

  // Set once by SetModelInfo, read-only afterwards.
  std::vector<prometheus::Counter*> layer_tokens_;  // by model layer; null for dense layers
  std::vector<prometheus::Counter*> rank_tokens_;   // by global rank
  std::vector<int> expert_rank_;                    // global expert -> rank hosting it
};

// "OK", "INVALID_ARGUMENT", ... as gRPC spells the code.
absl::string_view GrpcCodeName(grpc::StatusCode code);

}  // namespace moeserve

#endif  // MOESERVE_SERVER_METRICS_H_
