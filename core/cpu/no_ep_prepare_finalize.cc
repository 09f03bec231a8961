#include "core/cpu/no_ep_prepare_finalize.h"

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace moeserve {

absl::Status NoEpPrepareAndFinalize::Prepare(const PrepareArgs& args, PreparedActivations* out) {
  MOESERVE_RETURN_IF_ERROR(CheckPrepareArgsLayout(kName, args));
  const TensorView& x = args.hidden_states;
  const int64_t m = x.dim(0), k = x.dim(1), topk = args.topk_ids.dim(1);
  if (m > max_num_tokens_) {
    return absl::ResourceExhaustedError(
        absl::StrCat(kName, ": ", m, " tokens exceed max_num_tokens_per_rank=", max_num_tokens_));
  }
  // Quantization hook.
  if (x.dtype() == quant_.activation_dtype && x.is_contiguous()) {
    out->a1q = x;
  } else {
    MOESERVE_ASSIGN_OR_RETURN(out->a1q, a1q_.TryGet(quant_.activation_dtype, {m, k}));
    MOESERVE_RETURN_IF_ERROR(ConvertTensor(x, out->a1q));
  }
  // Global -> local ids.
  MOESERVE_ASSIGN_OR_RETURN(const TensorView ids, local_ids_.TryGet(DType::kINT32, {m, topk}));
  const int32_t* g = args.topk_ids.data<int32_t>();
  int32_t* l = ids.data<int32_t>();
  const bool has_map = !args.expert_map.empty();
  for (int64_t i = 0; i < m * topk; ++i) {
    l[i] = has_map ? args.expert_map.data<int32_t>()[g[i]] : g[i];
  }
  out->format = ActivationFormat::kStandard;
  out->a1q_scale = TensorView();
  out->topk_ids = ids;
  out->topk_weights = args.topk_weights;
  out->expert_num_tokens = TensorView();
  out->problem = NoEpProblem(args, m, k, topk);
  return absl::OkStatus();
}

absl::Status NoEpPrepareAndFinalize::Finalize(const TensorView& output,
                                              const TensorView& fused_expert_output,
                                              const PreparedActivations& prepared,
                                              const TopKWeightAndReduce& weight_and_reduce) {
  if (weight_and_reduce.kind() == TopKWeightAndReduce::Kind::kDelegate) {
    return MakeTopKWeightAndReduce(
               ResolveWeightAndReduce(weight_and_reduce.kind(), activation_format()))
        ->Apply(output, fused_expert_output, prepared.topk_weights, prepared.topk_ids);
  }
  return weight_and_reduce.Apply(output, fused_expert_output, prepared.topk_weights,
                                 prepared.topk_ids);
}

}  // namespace moeserve
