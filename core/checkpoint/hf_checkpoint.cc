#include "core/checkpoint/hf_checkpoint.h"

#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <set>
#include <sstream>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "core/status_macros.h"
#include "nlohmann/json.hpp"

namespace moeserve::checkpoint {
namespace {

constexpr char kConfigFile[] = "config.json";
constexpr char kSingleFile[] = "model.safetensors";
constexpr char kIndexFile[] = "model.safetensors.index.json";
constexpr int64_t kMaxGroups = 1 << 20;

bool IsFile(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

bool IsDir(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

std::string JoinPath(const std::string& dir, absl::string_view name) {
  if (dir.empty() || dir.back() == '/') return absl::StrCat(dir, name);
  return absl::StrCat(dir, "/", name);
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::ostringstream ss;
  ss << f.rdbuf();
  if (f.bad()) return absl::DataLossError(absl::StrCat(path, ": read failed"));
  return ss.str();
}

absl::StatusOr<nlohmann::json> ParseJsonObject(absl::string_view text, absl::string_view path) {
  nlohmann::json j = nlohmann::json::parse(text.begin(), text.end(), nullptr, false);
  if (j.is_discarded()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not well-formed JSON"));
  }
  if (!j.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a JSON object"));
  }
  return j;
}

// The first of `keys` present: its value if it is an integer in [min, max].
absl::StatusOr<int64_t> GetInt(const nlohmann::json& j, absl::string_view path,
                               std::initializer_list<const char*> keys, int64_t min, int64_t max) {
  for (const char* key : keys) {
    const auto it = j.find(key);
    if (it == j.end() || it->is_null()) continue;
    if (!it->is_number_integer() ||
        (it->is_number_unsigned() && it->get<uint64_t>() > static_cast<uint64_t>(max)) ||
        it->get<int64_t>() < min || it->get<int64_t>() > max) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": '", key, "' is ", it->dump(),
                                                     "; expected an integer in [", min, ", ", max,
                                                     "]"));
    }
    return it->get<int64_t>();
  }
  return absl::InvalidArgumentError(
      absl::StrCat(path, ": none of ", absl::StrJoin(keys, ", "), " is set"));
}

// The first of `keys` present (or `fallback`): a number, finite.
absl::StatusOr<double> GetNumber(const nlohmann::json& j, absl::string_view path, const char* key,
                                 double fallback) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_number() || !std::isfinite(it->get<double>())) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": '", key, "' is ", it->dump(), "; expected a finite number"));
  }
  return it->get<double>();
}

absl::StatusOr<bool> GetBool(const nlohmann::json& j, absl::string_view path, const char* key,
                             bool fallback) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_boolean()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": '", key, "' is ", it->dump(), "; expected true or false"));
  }
  return it->get<bool>();
}

absl::StatusOr<std::string> GetString(const nlohmann::json& j, absl::string_view path,
                                      const char* key, absl::string_view fallback) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::string(fallback);
  if (!it->is_string()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": '", key, "' is ", it->dump(), "; expected a string"));
  }
  return it->get<std::string>();
}

// The router of `c` from config.json (see RouterConfigFromHfConfig in the header). Sets
// c->router, or c->no_router_reason when the routing is not one moeserve implements; errors
// only for keys of the wrong type.
absl::Status ReadRouterConfig(const nlohmann::json& j, absl::string_view path, ModelConfig* c) {
  MOESERVE_ASSIGN_OR_RETURN(const std::string model_type, GetString(j, path, "model_type", ""));
  const bool v3 = model_type == "deepseek_v3";
  const bool v2 = model_type == "deepseek_v2";
  const bool mixtral = model_type == "mixtral";
  const bool qwen = model_type == "qwen2_moe" || model_type == "qwen3_moe";
  if (!v3 && !v2 && !mixtral && !qwen) {
    c->no_router_reason =
        absl::StrCat("model_type '", model_type,
                     "' is not one whose routing moeserve implements (mixtral, qwen2_moe, "
                     "qwen3_moe, deepseek_v2 with topk_method greedy, deepseek_v3)");
    return absl::OkStatus();
  }
  // Defaults are the Hugging Face configuration classes' own.
  MOESERVE_ASSIGN_OR_RETURN(const std::string scoring,
                            GetString(j, path, "scoring_func", v3 ? "sigmoid" : "softmax"));
  MOESERVE_ASSIGN_OR_RETURN(const std::string method,
                            GetString(j, path, "topk_method", v3 ? "noaux_tc" : "greedy"));
  MOESERVE_ASSIGN_OR_RETURN(const bool norm, GetBool(j, path, "norm_topk_prob", v3));
  MOESERVE_ASSIGN_OR_RETURN(const double scale,
                            GetNumber(j, path, "routed_scaling_factor", v3 ? 2.5 : 1.0));
  RouterConfig r;
  if (scoring == "softmax") {
    r.scoring = RouterScoring::kSoftmax;
  } else if (scoring == "sigmoid") {
    r.scoring = RouterScoring::kSigmoid;
  } else {
    c->no_router_reason =
        absl::StrCat(path, ": scoring_func '", scoring, "' is not implemented (softmax, sigmoid)");
    return absl::OkStatus();
  }
  // Mixtral always renormalizes (softmax, top-k, divide by the sum); it has no key for it.
  r.renormalize = mixtral ? true : norm;
  if (v2 || v3) {
    r.routed_scaling_factor = static_cast<float>(scale);
    if (method == "noaux_tc") {
      int64_t n_group = 8, topk_group = 4;  // DeepseekV3Config's defaults
      if (j.contains("n_group") && !j["n_group"].is_null()) {
        MOESERVE_ASSIGN_OR_RETURN(n_group, GetInt(j, path, {"n_group"}, 1, kMaxGroups));
      }
      if (j.contains("topk_group") && !j["topk_group"].is_null()) {
        MOESERVE_ASSIGN_OR_RETURN(topk_group, GetInt(j, path, {"topk_group"}, 1, kMaxGroups));
      }
      r.n_group = static_cast<int>(n_group);
      r.topk_group = static_cast<int>(topk_group);
      r.correction_bias = true;  // the loader clears it when no layer has the tensor
    } else if (method != "greedy") {
      c->no_router_reason =
          absl::StrCat(path, ": topk_method '", method, "' is not implemented (greedy, noaux_tc)");
      return absl::OkStatus();
    }
  }
  if (absl::Status s = r.Validate(c->num_experts, c->topk); !s.ok()) {
    c->no_router_reason = absl::StrCat(path, ": ", s.message());
    return absl::OkStatus();
  }
  c->router = r;
  return absl::OkStatus();
}

std::string LastPathComponent(std::string dir) {
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  const size_t slash = dir.rfind('/');
  return slash == std::string::npos ? dir : dir.substr(slash + 1);
}

}  // namespace

absl::string_view ExpertNamingName(ExpertNaming naming) {
  return naming == ExpertNaming::kMixtral ? "mixtral (block_sparse_moe.experts.E.w1/w3/w2)"
                                          : "mlp.experts.E.gate_proj/up_proj/down_proj";
}

ExpertTensorNames ExpertTensorNamesFor(ExpertNaming naming, int layer, int expert) {
  if (naming == ExpertNaming::kMixtral) {
    const std::string p =
        absl::StrCat("model.layers.", layer, ".block_sparse_moe.experts.", expert, ".");
    return {p + "w1.weight", p + "w3.weight", p + "w2.weight"};
  }
  const std::string p = absl::StrCat("model.layers.", layer, ".mlp.experts.", expert, ".");
  return {p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"};
}

std::string Mxfp8ScaleName(absl::string_view weight_name) {
  return absl::StrCat(weight_name, "_scale");
}

absl::StatusOr<ModelConfig> ModelConfigFromHfConfigJson(absl::string_view json_text,
                                                        absl::string_view path,
                                                        absl::string_view name) {
  MOESERVE_ASSIGN_OR_RETURN(const nlohmann::json j, ParseJsonObject(json_text, path));
  constexpr int64_t kMaxInt = int64_t{1} << 30;
  ModelConfig c;
  c.name = std::string(name);
  if (!j.contains("n_routed_experts") && !j.contains("num_experts") &&
      !j.contains("num_local_experts")) {
    return absl::InvalidArgumentError(
        absl::StrCat(path,
                     ": none of n_routed_experts, num_experts, num_local_experts is set "
                     "(not a Mixture-of-Experts model?)"));
  }
  MOESERVE_ASSIGN_OR_RETURN(
      const int64_t experts,
      GetInt(j, path, {"n_routed_experts", "num_experts", "num_local_experts"}, 1, kMaxInt));
  c.num_experts = static_cast<int>(experts);
  MOESERVE_ASSIGN_OR_RETURN(const int64_t topk,
                            GetInt(j, path, {"num_experts_per_tok"}, 1, kMaxInt));
  c.topk = static_cast<int>(topk);
  MOESERVE_ASSIGN_OR_RETURN(c.hidden, GetInt(j, path, {"hidden_size"}, 1, kMaxInt));
  MOESERVE_ASSIGN_OR_RETURN(
      c.intermediate, GetInt(j, path, {"moe_intermediate_size", "intermediate_size"}, 1, kMaxInt));
  // Bounded here, not only by Validate: the per-layer lists below are built from it.
  MOESERVE_ASSIGN_OR_RETURN(const int64_t layers,
                            GetInt(j, path, {"num_hidden_layers"}, 1, ModelConfig::kMaxLayers));
  c.num_layers = static_cast<int>(layers);

  std::vector<int> moe;
  if (j.contains("first_k_dense_replace")) {  // DeepSeek-V2/V3
    MOESERVE_ASSIGN_OR_RETURN(const int64_t k,
                              GetInt(j, path, {"first_k_dense_replace"}, 0, kMaxInt));
    int64_t freq = 1;
    if (j.contains("moe_layer_freq")) {
      MOESERVE_ASSIGN_OR_RETURN(freq, GetInt(j, path, {"moe_layer_freq"}, 1, kMaxInt));
    }
    for (int l = 0; l < c.num_layers; ++l) {
      if (l >= k && l % freq == 0) moe.push_back(l);
    }
  } else if (j.contains("decoder_sparse_step") || j.contains("mlp_only_layers")) {  // Qwen-MoE
    int64_t step = 1;
    if (j.contains("decoder_sparse_step") && !j["decoder_sparse_step"].is_null()) {
      MOESERVE_ASSIGN_OR_RETURN(step, GetInt(j, path, {"decoder_sparse_step"}, 1, kMaxInt));
    }
    std::set<int64_t> dense;
    if (j.contains("mlp_only_layers") && !j["mlp_only_layers"].is_null()) {
      const nlohmann::json& m = j["mlp_only_layers"];
      if (!m.is_array()) {
        return absl::InvalidArgumentError(
            absl::StrCat(path, ": 'mlp_only_layers' is ", m.dump(), "; expected a list of ints"));
      }
      for (const auto& v : m) {
        if (!v.is_number_integer()) {
          return absl::InvalidArgumentError(absl::StrCat(path, ": 'mlp_only_layers' has ", v.dump(),
                                                         "; expected a list of ints"));
        }
        dense.insert(v.get<int64_t>());
      }
    }
    for (int l = 0; l < c.num_layers; ++l) {
      if (dense.count(l) == 0 && (l + 1) % step == 0) moe.push_back(l);
    }
  } else {  // Mixtral: every layer
    for (int l = 0; l < c.num_layers; ++l) moe.push_back(l);
  }
  if (moe.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path,
                     ": no layer has experts (first_k_dense_replace / mlp_only_layers / "
                     "decoder_sparse_step leave none of ",
                     c.num_layers, " layers)"));
  }
  if (static_cast<int>(moe.size()) != c.num_layers) c.moe_layers = std::move(moe);
  if (absl::Status s = c.Validate(); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", s.message()));
  }
  MOESERVE_RETURN_IF_ERROR(ReadRouterConfig(j, path, &c));
  return c;
}

absl::StatusOr<ModelConfig> ReadHfModelConfig(const std::string& dir) {
  if (!IsDir(dir)) {
    return absl::NotFoundError(absl::StrCat("checkpoint directory ", dir, " does not exist"));
  }
  const std::string path = JoinPath(dir, kConfigFile);
  if (!IsFile(path)) {
    return absl::NotFoundError(absl::StrCat("checkpoint ", dir, " has no ", kConfigFile,
                                            " (a Hugging Face checkpoint "
                                            "directory holds config.json and *.safetensors)"));
  }
  MOESERVE_ASSIGN_OR_RETURN(const std::string text, ReadFile(path));
  return ModelConfigFromHfConfigJson(text, path, LastPathComponent(dir));
}

absl::StatusOr<std::unique_ptr<HfCheckpoint>> HfCheckpoint::Open(const std::string& dir) {
  auto ckpt = std::unique_ptr<HfCheckpoint>(new HfCheckpoint());
  ckpt->dir_ = dir;
  MOESERVE_ASSIGN_OR_RETURN(ckpt->config_, ReadHfModelConfig(dir));

  const std::string index_path = JoinPath(dir, kIndexFile);
  const std::string single_path = JoinPath(dir, kSingleFile);
  if (IsFile(index_path)) {
    MOESERVE_ASSIGN_OR_RETURN(const std::string text, ReadFile(index_path));
    MOESERVE_ASSIGN_OR_RETURN(const nlohmann::json index, ParseJsonObject(text, index_path));
    const auto wm = index.find("weight_map");
    if (wm == index.end() || !wm->is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat(index_path, ": missing object 'weight_map' (tensor name -> file)"));
    }
    std::map<std::string, std::string> tensor_file;
    for (const auto& [tensor, file] : wm->items()) {
      if (!file.is_string()) {
        return absl::InvalidArgumentError(
            absl::StrCat(index_path, ": weight_map['", tensor, "'] is not a file name"));
      }
      const std::string f = file.get<std::string>();
      // Shards live in the checkpoint directory; refuse paths that leave it, and a NUL, which
      // the file system would take as the end of the name (another file would be opened).
      if (f.find('\0') != std::string::npos) {
        return absl::InvalidArgumentError(
            absl::StrCat(index_path, ": weight_map['", absl::CHexEscape(tensor), "'] = '",
                         absl::CHexEscape(f), "' contains a NUL byte; expected a file name"));
      }
      if (f.empty() || f[0] == '/' || absl::StrContains(f, "..")) {
        return absl::InvalidArgumentError(absl::StrCat(
            index_path, ": weight_map['", tensor, "'] = '", f, "' is not a file in the directory"));
      }
      tensor_file[tensor] = JoinPath(dir, f);
    }
    for (const auto& [tensor, path] : tensor_file) {
      auto it = ckpt->files_.find(path);
      if (it == ckpt->files_.end()) {
        if (!IsFile(path)) {
          return absl::NotFoundError(absl::StrCat(index_path, " maps tensor '", tensor, "' to ",
                                                  path, ", which does not exist"));
        }
        MOESERVE_ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(path));
        it = ckpt->files_.emplace(path, std::move(file)).first;
      }
      if (!it->second->Contains(tensor)) {
        return absl::DataLossError(absl::StrCat(index_path, " maps tensor '", tensor, "' to ", path,
                                                ", which does not contain it"));
      }
      ckpt->where_[tensor] = it->second.get();
    }
  } else if (IsFile(single_path)) {
    MOESERVE_ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(single_path));
    for (const std::string& name : file->TensorNames()) ckpt->where_[name] = file.get();
    ckpt->files_.emplace(single_path, std::move(file));
  } else {
    return absl::NotFoundError(
        absl::StrCat("checkpoint ", dir, " has neither ", kSingleFile, " nor ", kIndexFile));
  }

  bool mixtral = false, mlp = false;
  for (const auto& [name, file] : ckpt->where_) {
    mixtral = mixtral || absl::StrContains(name, ".block_sparse_moe.experts.");
    mlp = mlp || absl::StrContains(name, ".mlp.experts.");
  }
  if (mixtral == mlp) {
    const ExpertTensorNames a = ExpertTensorNamesFor(ExpertNaming::kMlpExperts, 0, 0);
    const ExpertTensorNames b = ExpertTensorNamesFor(ExpertNaming::kMixtral, 0, 0);
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint ", dir, (mixtral ? " mixes both" : " has neither"),
                     " of the supported expert tensor namings: '", a.gate,
                     "' (Qwen-MoE, DeepSeek) or '", b.gate, "' (Mixtral)"));
  }
  ckpt->naming_ = mixtral ? ExpertNaming::kMixtral : ExpertNaming::kMlpExperts;
  return ckpt;
}

std::vector<std::string> HfCheckpoint::files() const {
  std::vector<std::string> out;
  for (const auto& [path, file] : files_) out.push_back(path);
  return out;
}

absl::StatusOr<SafetensorsTensor> HfCheckpoint::Find(const std::string& name) const {
  const auto it = where_.find(name);
  if (it == where_.end()) {
    return absl::NotFoundError(
        absl::StrCat("checkpoint ", dir_, ": tensor '", name, "' is missing"));
  }
  return it->second->Get(name);
}

}  // namespace moeserve::checkpoint
