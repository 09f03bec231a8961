#include "moeserve/v1/channel_args.h"

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace moeserve::v1wire {

absl::StatusOr<std::vector<std::pair<std::string, int>>> ParseChannelArgs(absl::string_view spec) {
  std::vector<std::pair<std::string, int>> args;
  for (absl::string_view item : absl::StrSplit(spec, ',', absl::SkipEmpty())) {
    const std::vector<absl::string_view> kv = absl::StrSplit(item, absl::MaxSplits('=', 1));
    int value = 0;
    if (kv.size() != 2 || !absl::StartsWith(kv[0], "grpc.") || !absl::SimpleAtoi(kv[1], &value)) {
      return absl::InvalidArgumentError(
          absl::StrCat("got '", item, "', expected grpc.NAME=INTEGER"));
    }
    args.emplace_back(std::string(kv[0]), value);
  }
  return args;
}

}  // namespace moeserve::v1wire
