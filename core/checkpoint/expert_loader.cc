#include "core/checkpoint/expert_loader.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/status_macros.h"
#include "core/thread_pool.h"
#include "kernels/cpu/dtype_convert.h"
#include "kernels/cpu/mxfp8.h"

namespace moeserve::checkpoint {
namespace {

enum Role { kGate = 0, kUp = 1, kDown = 2 };
constexpr const char* kRoleName[] = {"gate", "up", "down"};

// One expert weight matrix [rows, k] as found in the checkpoint.
struct Source {
  int layer = 0;
  int expert = 0;  // global id
  Role role = kGate;
  int64_t rows = 0, k = 0;
  SafetensorsTensor weight;
  SafetensorsTensor scale;  // pre-quantized MXFP8 only
  bool prequantized = false;

  std::string Where() const {
    return absl::StrCat("layer ", layer, " expert ", expert, " ", kRoleName[role], " weight '",
                        weight.name, "' (", weight.file, ")");
  }
};

std::string ShapeStr(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

absl::Status Resolve(const HfCheckpoint& ckpt, const std::string& name, int layer, int expert,
                     Role role, int64_t rows, int64_t k, Source* out) {
  out->layer = layer;
  out->expert = expert;
  out->role = role;
  out->rows = rows;
  out->k = k;
  absl::StatusOr<SafetensorsTensor> w = ckpt.Find(name);
  if (!w.ok()) {
    return absl::NotFoundError(absl::StrCat("checkpoint ", ckpt.dir(), ": layer ", layer,
                                            " expert ", expert, " ", kRoleName[role], " weight '",
                                            name, "' is missing"));
  }
  out->weight = *std::move(w);
  const std::vector<int64_t> want = {rows, k};
  if (out->weight.shape != want) {
    return absl::InvalidArgumentError(
        absl::StrCat(out->Where(), " has shape ", ShapeStr(out->weight.shape),
                     " but config.json implies ", ShapeStr(want),
                     role == kDown ? " ([hidden_size, moe_intermediate_size])"
                                   : " ([moe_intermediate_size, hidden_size])"));
  }
  switch (out->weight.dtype) {
    case StDType::kBF16:
    case StDType::kF16:
    case StDType::kF32:
      return absl::OkStatus();
    case StDType::kF8_E4M3:
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          out->Where(), " has dtype ", StDTypeName(out->weight.dtype),
          ", which is not supported; expected BF16, F16, F32 or F8_E4M3 with E8M0 scales"));
  }
  out->prequantized = true;
  const std::string scale_name = Mxfp8ScaleName(name);
  absl::StatusOr<SafetensorsTensor> s = ckpt.Find(scale_name);
  if (!s.ok()) {
    return absl::NotFoundError(absl::StrCat(out->Where(), " is F8_E4M3 but its E8M0 scales '",
                                            scale_name, "' are missing"));
  }
  out->scale = *std::move(s);
  if (out->scale.dtype != StDType::kU8 && out->scale.dtype != StDType::kF8_E8M0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer ", layer, " expert ", expert, " scales '", scale_name, "' (", out->scale.file,
        ") have dtype ", StDTypeName(out->scale.dtype), "; expected U8 or F8_E8M0"));
  }
  const std::vector<int64_t> want_scale = {rows, kernels::Mxfp8ScaleBlocks(k)};
  if (out->scale.shape != want_scale) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " expert ", expert, " scales '", scale_name, "' (",
                     out->scale.file, ") have shape ", ShapeStr(out->scale.shape), "; expected ",
                     ShapeStr(want_scale), " (one per 32 values of a row)"));
  }
  return absl::OkStatus();
}

absl::Status NonFinite(const Source& s, int64_t index, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(s.Where(), ": ", what, " at [", index / s.k, ", ",
                                                 index % s.k,
                                                 "]; refusing to serve non-finite weights"));
}

bool Bf16IsFinite(uint16_t b) { return (b & 0x7f80) != 0x7f80; }

// Float checkpoint values -> BF16 dst [rows, k], refusing NaN / Inf (also F32 values that
// overflow BF16).
absl::Status FloatToBf16(const Source& s, uint16_t* dst) {
  const int64_t n = s.rows * s.k;
  const uint8_t* p = s.weight.data;
  switch (s.weight.dtype) {
    case StDType::kBF16:
      std::memcpy(dst, p, n * 2);
      break;
    case StDType::kF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        dst[i] = kernels::FloatToBf16(kernels::Fp16ToFloat(h));
      }
      break;
    case StDType::kF32:
      for (int64_t i = 0; i < n; ++i) {
        float f;
        std::memcpy(&f, p + 4 * i, 4);
        if (!std::isfinite(f)) return NonFinite(s, i, absl::StrCat("value ", f));
        dst[i] = kernels::FloatToBf16(f);
      }
      break;
    default:
      return absl::InternalError(absl::StrCat(s.Where(), ": unexpected dtype"));
  }
  for (int64_t i = 0; i < n; ++i) {
    if (!Bf16IsFinite(dst[i])) {
      return NonFinite(s, i,
                       absl::StrCat("value ", kernels::Bf16ToFloat(dst[i]),
                                    s.weight.dtype == StDType::kF32 ? " (in BF16)" : ""));
    }
  }
  return absl::OkStatus();
}

// Values whose dequantized magnitude reaches 2^128 (Inf in FP32): a block scale of 2^120 or
// more (code >= 247) with a large enough value. The loader promises no Inf weight in any
// format; a pre-quantized checkpoint can hold one, and so can a float checkpoint quantized
// here (|x| >= 1.9375 * 2^127 rounds to 2^128, kernels/cpu/mxfp8.h).
absl::Status CheckMxfp8Range(const Source& s, const uint8_t* q, const uint8_t* scales) {
  constexpr uint8_t kFirstRiskyScale = 247;  // 448 x 2^(c - 127) < 2^128 below it
  const int64_t blocks = kernels::Mxfp8ScaleBlocks(s.k);
  for (int64_t i = 0; i < s.rows * blocks; ++i) {
    if (scales[i] < kFirstRiskyScale || scales[i] == kernels::kE8M0NanCode) continue;
    const int64_t r = i / blocks, begin = (i % blocks) * kernels::kMxfp8BlockSize;
    const int64_t end = std::min<int64_t>(begin + kernels::kMxfp8BlockSize, s.k);
    const float scale = kernels::E8M0ToFloat(scales[i]);
    for (int64_t c = begin; c < end; ++c) {
      if (std::isinf(kernels::E4M3ToFloat(q[r * s.k + c]) * scale)) {
        return NonFinite(s, r * s.k + c, "value x scale overflows FP32 (Inf)");
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CheckMxfp8Codes(const Source& s, const uint8_t* q, const uint8_t* scales) {
  const int64_t blocks = kernels::Mxfp8ScaleBlocks(s.k);
  for (int64_t i = 0; i < s.rows * blocks; ++i) {
    if (scales[i] == kernels::kE8M0NanCode) {
      return NonFinite(s, (i / blocks) * s.k + (i % blocks) * kernels::kMxfp8BlockSize,
                       "E8M0 scale code 255 (NaN)");
    }
  }
  for (int64_t i = 0; i < s.rows * s.k; ++i) {
    if ((q[i] & 0x7f) == kernels::kE4M3NanCode) return NonFinite(s, i, "E4M3 NaN code");
  }
  return CheckMxfp8Range(s, q, scales);
}

// Pre-quantized MXFP8 -> BF16 dst (exact except below BF16's smallest subnormal).
absl::Status Mxfp8ToBf16(const Source& s, uint16_t* dst) {
  MOESERVE_RETURN_IF_ERROR(CheckMxfp8Codes(s, s.weight.data, s.scale.data));
  const int64_t blocks = kernels::Mxfp8ScaleBlocks(s.k);
  for (int64_t r = 0; r < s.rows; ++r) {
    for (int64_t c = 0; c < s.k; ++c) {
      const float v = kernels::E4M3ToFloat(s.weight.data[r * s.k + c]) *
                      kernels::E8M0ToFloat(s.scale.data[r * blocks + c / 32]);
      dst[r * s.k + c] = kernels::FloatToBf16(v);
      if (!Bf16IsFinite(dst[r * s.k + c])) return NonFinite(s, r * s.k + c, "value overflows BF16");
    }
  }
  return absl::OkStatus();
}

// The BF16 -> MXFP8 step for float checkpoints served as mxfp8.
absl::Status QuantizeBf16(const Source& s, const uint16_t* bf16, uint8_t* q, uint8_t* scales) {
  int64_t bad = -1;
  const kernels::Mxfp8Status st =
      kernels::QuantizeMxfp8RowsFromBf16Ref(bf16, s.rows, s.k, q, scales, &bad);
  if (st == kernels::Mxfp8Status::kNonFinite) return NonFinite(s, bad, "non-finite value");
  if (st != kernels::Mxfp8Status::kOk) {
    return absl::InternalError(
        absl::StrCat(s.Where(), ": MXFP8 quantization failed: ", kernels::Mxfp8StatusName(st)));
  }
  return CheckMxfp8Range(s, q, scales);
}

}  // namespace

absl::StatusOr<std::unique_ptr<ExpertWeightStore>> LoadCheckpointExperts(
    const HfCheckpoint& ckpt, const ModelConfig& model, std::vector<int> expert_ids,
    const ExpertLoadOptions& options) {
  MOESERVE_RETURN_IF_ERROR(model.Validate());
  const ModelConfig& cc = ckpt.config();
  if (model.num_layers != cc.num_layers || model.num_experts != cc.num_experts ||
      model.hidden != cc.hidden || model.intermediate != cc.intermediate ||
      model.moe_layers != cc.moe_layers) {
    return absl::InvalidArgumentError(absl::StrCat("model ", model.DebugString(),
                                                   " does not match checkpoint ", ckpt.dir(),
                                                   "'s config.json: ", cc.DebugString()));
  }
  for (int id : expert_ids) {
    if (id < 0 || id >= model.num_experts) {
      return absl::InvalidArgumentError(
          absl::StrCat("expert id ", id, " not in [0, ", model.num_experts, ")"));
    }
  }
  const int num_local = static_cast<int>(expert_ids.size());
  const int64_t h = model.hidden, n = model.intermediate;
  const bool mx = options.format == WeightFormat::kMXFP8;
  {
    const int64_t needed =
        model.LayerWeightBytes(num_local, options.format) * model.num_moe_layers();
    const int64_t budget =
        options.memory_budget_bytes > 0 ? options.memory_budget_bytes : AvailableHostMemoryBytes();
    MOESERVE_RETURN_IF_ERROR(CheckMemoryBudget(model, needed, budget));
  }
  std::vector<int> moe_layers = model.moe_layers;
  if (moe_layers.empty()) {
    for (int l = 0; l < model.num_layers; ++l) moe_layers.push_back(l);
  }
  ThreadPool pool(std::max(1, options.num_threads));
  // Per-thread BF16 staging for float -> MXFP8 (one matrix at a time).
  std::vector<std::vector<uint16_t>> staging(mx ? pool.num_threads() : 0);

  std::vector<LayerWeights> layers;
  std::vector<Tensor> storage;
  for (int layer : moe_layers) {
    // Find and check every tensor first: cheap, and the first error is deterministic.
    std::vector<Source> sources(static_cast<size_t>(num_local) * 3);
    for (int e = 0; e < num_local; ++e) {
      const ExpertTensorNames names = ExpertTensorNamesFor(ckpt.naming(), layer, expert_ids[e]);
      MOESERVE_RETURN_IF_ERROR(
          Resolve(ckpt, names.gate, layer, expert_ids[e], kGate, n, h, &sources[3 * e]));
      MOESERVE_RETURN_IF_ERROR(
          Resolve(ckpt, names.up, layer, expert_ids[e], kUp, n, h, &sources[3 * e + 1]));
      MOESERVE_RETURN_IF_ERROR(
          Resolve(ckpt, names.down, layer, expert_ids[e], kDown, h, n, &sources[3 * e + 2]));
    }
    const DType value_dtype = mx ? DType::kFP8E4M3 : DType::kBF16;
    MOESERVE_ASSIGN_OR_RETURN(Tensor w13, Tensor::Allocate(value_dtype, {num_local, 2 * n, h}));
    MOESERVE_ASSIGN_OR_RETURN(Tensor w2, Tensor::Allocate(value_dtype, {num_local, h, n}));
    Tensor w13_scale, w2_scale;
    if (mx) {
      MOESERVE_ASSIGN_OR_RETURN(
          w13_scale,
          Tensor::Allocate(DType::kUINT8, {num_local, 2 * n, kernels::Mxfp8ScaleBlocks(h)}));
      MOESERVE_ASSIGN_OR_RETURN(
          w2_scale, Tensor::Allocate(DType::kUINT8, {num_local, h, kernels::Mxfp8ScaleBlocks(n)}));
    }
    std::vector<absl::Status> status(sources.size());
    pool.ParallelFor(static_cast<int64_t>(sources.size()), [&](int64_t i, int thread) {
      const Source& s = sources[i];
      const int64_t e = i / 3;
      // Offsets (in elements) of this matrix inside the layer's tensors.
      const int64_t row0 = s.role == kUp ? n : 0;
      const int64_t value_off = s.role == kDown ? e * h * n : (e * 2 * n + row0) * h;
      const int64_t scale_off = s.role == kDown ? e * h * kernels::Mxfp8ScaleBlocks(n)
                                                : (e * 2 * n + row0) * kernels::Mxfp8ScaleBlocks(h);
      const int64_t count = s.rows * s.k;
      const int64_t scale_count = s.rows * kernels::Mxfp8ScaleBlocks(s.k);
      Tensor& values = s.role == kDown ? w2 : w13;
      Tensor& scales = s.role == kDown ? w2_scale : w13_scale;
      if (!mx) {
        uint16_t* dst = values.data<uint16_t>() + value_off;
        status[i] = s.prequantized ? Mxfp8ToBf16(s, dst) : FloatToBf16(s, dst);
      } else if (s.prequantized) {
        std::memcpy(values.data<uint8_t>() + value_off, s.weight.data, count);
        std::memcpy(scales.data<uint8_t>() + scale_off, s.scale.data, scale_count);
        status[i] = CheckMxfp8Codes(s, values.data<uint8_t>() + value_off,
                                    scales.data<uint8_t>() + scale_off);
      } else {
        std::vector<uint16_t>& tmp = staging[thread];
        tmp.resize(count);
        status[i] = FloatToBf16(s, tmp.data());
        if (status[i].ok()) {
          status[i] = QuantizeBf16(s, tmp.data(), values.data<uint8_t>() + value_off,
                                   scales.data<uint8_t>() + scale_off);
        }
      }
    });
    for (const absl::Status& s : status) MOESERVE_RETURN_IF_ERROR(s);
    LayerWeights lw;
    lw.format = options.format;
    lw.num_local_experts = num_local;
    lw.hidden = h;
    lw.intermediate = n;
    lw.w13 = w13.view();
    lw.w2 = w2.view();
    storage.push_back(std::move(w13));
    storage.push_back(std::move(w2));
    if (mx) {
      lw.w13_scale = w13_scale.view();
      lw.w2_scale = w2_scale.view();
      storage.push_back(std::move(w13_scale));
      storage.push_back(std::move(w2_scale));
    }
    layers.push_back(lw);
    if (options.on_layer) {
      MOESERVE_RETURN_IF_ERROR(
          options.on_layer(layer, model.LayerWeightBytes(num_local, options.format)));
    }
  }
  return ExpertWeightStore::FromLayers(model, std::move(expert_ids), std::move(layers),
                                       std::move(storage));
}

}  // namespace moeserve::checkpoint
