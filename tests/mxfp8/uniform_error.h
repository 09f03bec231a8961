// The expected MXFP8 rounding error of uniformly distributed values, shared by the tests.
#ifndef MOESERVE_TESTS_MXFP8_UNIFORM_ERROR_H_
#define MOESERVE_TESTS_MXFP8_UNIFORM_ERROR_H_

#include <cmath>

namespace moeserve::testing_mxfp8 {

// Expected relative L2 error of round-to-nearest on E4M3's grid for x uniform in [0, a] (so
// also [-a, a]), exactly, ignoring E4M3 subnormals (elements 2^14 below the block amax, a share
// of 2^-14 of the values). Power-of-two block scales keep the grid aligned with x's own
// binades: in binade [2^e, 2^(e+1)) grid points are h = 2^(e-3) apart, and each whole interval
// between grid points adds h^3 / 12 to the integral of the squared error; the top binade is
// cut at a. Ranges from 2.36% (a a power of two) to 2.88% (a ~ 1.215 * 2^E).
inline double UniformRelativeL2(double a) {
  const int top = std::ilogb(a);
  double integral = 0;
  for (int e = top - 1; e > top - 60; --e) integral += 8 * std::pow(std::ldexp(1.0, e - 3), 3) / 12;
  const double h = std::ldexp(1.0, top - 3), x0 = std::ldexp(1.0, top);
  const double whole = std::floor((a - x0) / h);
  integral += whole * h * h * h / 12;
  const double d = a - x0 - whole * h;  // the partial last interval [g, g + d)
  integral +=
      d <= h / 2 ? d * d * d / 3 : h * h * h / 24 + (std::pow(h / 2, 3) - std::pow(h - d, 3)) / 3;
  return std::sqrt(integral / a / (a * a / 3));
}

}  // namespace moeserve::testing_mxfp8

#endif  // MOESERVE_TESTS_MXFP8_UNIFORM_ERROR_H_
