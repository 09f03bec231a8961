// SubPieces: the pieces holding a byte range of a concatenation (core/device_upload.h).
#include "core/device_upload.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

namespace moeserve {
namespace {

// Every range of a concatenation with an empty piece and a one-byte piece inside.
TEST(SubPiecesTest, TrimsTheFirstAndLastPiece) {
  const uint8_t a[5] = {0, 1, 2, 3, 4}, b[1] = {5}, c[4] = {6, 7, 8, 9};
  const HostPieces pieces = {{a, 5}, {b, 0}, {b, 1}, {c, 4}};
  for (size_t off = 0; off <= 10; ++off) {
    for (size_t n = 0; off + n <= 10; ++n) {
      std::vector<uint8_t> got;
      for (const auto& p : SubPieces(pieces, off, n)) got.insert(got.end(), p.begin(), p.end());
      ASSERT_EQ(got.size(), n) << off << "+" << n;
      for (size_t i = 0; i < n; ++i) EXPECT_EQ(got[i], off + i) << off << "+" << n;
    }
  }
}

}  // namespace
}  // namespace moeserve
