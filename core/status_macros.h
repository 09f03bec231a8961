// The one set of error-propagation macros used across moeserve.
//
// MOESERVE_CUDA_RETURN_IF_ERROR and MOESERVE_NCCL_RETURN_IF_ERROR only reference CUDA/NCCL
// symbols when expanded, so this header compiles without CUDA.
#ifndef MOESERVE_CORE_STATUS_MACROS_H_
#define MOESERVE_CORE_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

#define MOESERVE_STATUS_CONCAT_INNER_(a, b) a##b
#define MOESERVE_STATUS_CONCAT_(a, b) MOESERVE_STATUS_CONCAT_INNER_(a, b)

// Returns from the enclosing function if `expr` (an absl::Status) is not OK.
#define MOESERVE_RETURN_IF_ERROR(expr)                   \
  do {                                                   \
    ::absl::Status _moeserve_status = (expr);            \
    if (!_moeserve_status.ok()) return _moeserve_status; \
  } while (0)

// `lhs = value of rexpr` where rexpr is an absl::StatusOr<T>; returns its status on error.
#define MOESERVE_ASSIGN_OR_RETURN(lhs, rexpr)                                                  \
  MOESERVE_ASSIGN_OR_RETURN_IMPL_(MOESERVE_STATUS_CONCAT_(_moeserve_statusor_, __LINE__), lhs, \
                                  rexpr)
// (lhs may be a declaration and statusor is a name: neither can be parenthesized.)
// NOLINTBEGIN(bugprone-macro-parentheses)
#define MOESERVE_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                                    \
  if (!statusor.ok()) return std::move(statusor).status();    \
  lhs = std::move(statusor).value()
// NOLINTEND(bugprone-macro-parentheses)

// For cudaError_t-returning calls (CUDA runtime and our LaunchFoo launchers). The error is
// returned as the Status, so it is cleared from the thread's "last error" (cudaGetLastError):
// left there, a failed cudaMalloc would fail the next launcher that returns
// cudaGetLastError() on this thread (sticky device errors stay regardless).
#define MOESERVE_CUDA_RETURN_IF_ERROR(expr)                                                  \
  do {                                                                                       \
    const cudaError_t _moeserve_cuda_err = (expr);                                           \
    if (_moeserve_cuda_err != cudaSuccess) {                                                 \
      (void)cudaGetLastError();                                                              \
      return ::absl::InternalError(                                                          \
          ::absl::StrCat(#expr, " failed: ", cudaGetErrorString(_moeserve_cuda_err), " at ", \
                         __FILE__, ":", __LINE__));                                          \
    }                                                                                        \
  } while (0)

// For ncclResult_t-returning calls; includes ncclGetLastError() detail.
#define MOESERVE_NCCL_RETURN_IF_ERROR(expr, comm)                                          \
  do {                                                                                     \
    const ncclResult_t _moeserve_nccl_res = (expr);                                        \
    if (_moeserve_nccl_res != ncclSuccess && _moeserve_nccl_res != ncclInProgress) {       \
      return ::absl::InternalError(                                                        \
          ::absl::StrCat(#expr, " failed: ", ncclGetErrorString(_moeserve_nccl_res), " (", \
                         ncclGetLastError(comm), ") at ", __FILE__, ":", __LINE__));       \
    }                                                                                      \
  } while (0)

#endif  // MOESERVE_CORE_STATUS_MACROS_H_
