#include "core/device_upload.h"

#include <algorithm>

namespace moeserve {

HostPieces SubPieces(const HostPieces& pieces, size_t offset, size_t bytes) {
  HostPieces out;
  size_t start = 0;  // offset of the current piece in the concatenation
  for (const absl::Span<const uint8_t>& piece : pieces) {
    if (bytes == 0) break;
    const size_t end = start + piece.size();
    if (end > offset) {
      const size_t skip = offset > start ? offset - start : 0;
      const size_t take = std::min(piece.size() - skip, bytes);
      out.push_back(piece.subspan(skip, take));
      offset += take;
      bytes -= take;
    }
    start = end;
  }
  return out;
}

}  // namespace moeserve
