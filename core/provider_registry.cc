#include "core/provider_registry.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace moeserve {
namespace {

template <typename P>
bool Named(const P& p, absl::string_view name) {
  return p.name == name || std::find(p.aliases.begin(), p.aliases.end(), name) != p.aliases.end();
}

template <typename P>
absl::Status CheckNew(const std::deque<P>& existing, const P& p) {
  if (p.name.empty() || !p.create) {
    return absl::InvalidArgumentError("a provider needs a name and a factory");
  }
  for (const P& q : existing) {
    if (Named(q, p.name)) return absl::AlreadyExistsError(absl::StrCat(p.name, " is registered"));
    for (const std::string& a : p.aliases) {
      if (Named(q, a)) {
        return absl::AlreadyExistsError(absl::StrCat("alias ", a, " is taken by ", q.name));
      }
    }
  }
  return absl::OkStatus();
}

// "a, b or c".
std::string OrList(const std::vector<std::string>& items) {
  if (items.size() <= 1) return absl::StrJoin(items, "");
  return absl::StrCat(absl::StrJoin(std::vector<std::string>(items.begin(), items.end() - 1), ", "),
                      " or ", items.back());
}

// The providers usable on `backend`: its own, and the CPU ones, whose names are the portable
// spellings (ResolveEngineConfig substitutes the backend's provider of the same format).
template <typename P>
absl::StatusOr<const P*> Lookup(const std::deque<P>& all, absl::string_view option,
                                absl::string_view name, Backend backend) {
  std::vector<std::string> aliases, names;
  const P* found = nullptr;
  for (const P& p : all) {
    if (p.backend != backend && p.backend != Backend::kCpu) continue;
    if (Named(p, name)) found = &p;
    aliases.insert(aliases.end(), p.aliases.begin(), p.aliases.end());
    names.push_back(p.name);
  }
  if (found != nullptr) return found;
  return absl::InvalidArgumentError(
      absl::StrCat(option, ": got '", name, "', expected ", OrList(aliases),
                   " (or a class name: ", absl::StrJoin(names, ", "), ")"));
}

absl::Status CommonSupports(absl::string_view name, Backend backend, bool supports_ep,
                            const std::function<absl::Status(const EnginePlan&)>& extra,
                            const EnginePlan& plan) {
  if (backend != plan.backend) {
    return absl::InvalidArgumentError(absl::StrCat(name, " runs on backend ", BackendName(backend),
                                                   ", not ", BackendName(plan.backend)));
  }
  if (!supports_ep && plan.world_size > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " serves a single rank, but there are ", plan.world_size, " ranks"));
  }
  return extra ? extra(plan) : absl::OkStatus();
}

}  // namespace

absl::Status PrepareFinalizeProvider::Supports(const EnginePlan& plan) const {
  return CommonSupports(name, backend, supports_ep, supports, plan);
}

absl::Status ExpertsProvider::Supports(const EnginePlan& plan) const {
  // An Experts without an expert map still serves one rank of many when it holds every expert,
  // which never happens here (experts are partitioned): refused under EP by the pair check.
  return CommonSupports(name, backend, /*supports_ep=*/true, supports, plan);
}

ProviderRegistry& ProviderRegistry::Global() {
  static ProviderRegistry* registry = [] {
    auto* r = new ProviderRegistry();
    RegisterCpuBackend(*r);
    return r;
  }();
  return *registry;
}

absl::Status ProviderRegistry::Register(PrepareFinalizeProvider provider) {
  std::lock_guard<std::mutex> lock(mu_);
  if (absl::Status s = CheckNew(pfs_, provider); !s.ok()) return s;
  pfs_.push_back(std::move(provider));
  return absl::OkStatus();
}

absl::Status ProviderRegistry::Register(ExpertsProvider provider) {
  std::lock_guard<std::mutex> lock(mu_);
  if (absl::Status s = CheckNew(experts_, provider); !s.ok()) return s;
  experts_.push_back(std::move(provider));
  return absl::OkStatus();
}

absl::Status ProviderRegistry::Register(BackendProvider provider) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!provider.create_rank_group) {
    return absl::InvalidArgumentError("a backend needs a rank group factory");
  }
  for (const BackendProvider& b : backends_) {
    if (b.backend == provider.backend) {
      return absl::AlreadyExistsError(
          absl::StrCat("backend ", BackendName(provider.backend), " is registered"));
    }
  }
  backends_.push_back(std::move(provider));
  return absl::OkStatus();
}

const PrepareFinalizeProvider* ProviderRegistry::FindPrepareFinalize(absl::string_view name) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& p : pfs_) {
    if (Named(p, name)) return &p;
  }
  return nullptr;
}

const ExpertsProvider* ProviderRegistry::FindExperts(absl::string_view name) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& p : experts_) {
    if (Named(p, name)) return &p;
  }
  return nullptr;
}

const BackendProvider* ProviderRegistry::FindBackend(Backend backend) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& b : backends_) {
    if (b.backend == backend) return &b;
  }
  return nullptr;
}

absl::StatusOr<const PrepareFinalizeProvider*> ProviderRegistry::LookupPrepareFinalize(
    absl::string_view name, Backend backend) const {
  std::lock_guard<std::mutex> lock(mu_);
  return Lookup(pfs_, "prepare_finalize", name, backend);
}

absl::StatusOr<const ExpertsProvider*> ProviderRegistry::LookupExperts(absl::string_view name,
                                                                       Backend backend) const {
  std::lock_guard<std::mutex> lock(mu_);
  return Lookup(experts_, "experts", name, backend);
}

std::vector<const PrepareFinalizeProvider*> ProviderRegistry::prepare_finalizes() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<const PrepareFinalizeProvider*> out;
  for (const auto& p : pfs_) out.push_back(&p);
  return out;
}

std::vector<const ExpertsProvider*> ProviderRegistry::experts() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<const ExpertsProvider*> out;
  for (const auto& p : experts_) out.push_back(&p);
  return out;
}

absl::Status CheckProvidersCompatible(const PrepareFinalizeProvider& pf,
                                      const ExpertsProvider& experts, const EnginePlan& plan) {
  if (pf.format != experts.format) {
    return absl::InvalidArgumentError(
        absl::StrCat(pf.name, " produces ", ActivationFormatName(pf.format), " activations but ",
                     experts.name, " expects ", ActivationFormatName(experts.format)));
  }
  if (plan.world_size > 1 && !experts.supports_ep) {
    return absl::InvalidArgumentError(
        absl::StrCat(experts.name, " does not support an expert map, which ", pf.name,
                     " needs with ", plan.world_size, " ranks"));
  }
  return absl::OkStatus();
}

}  // namespace moeserve
