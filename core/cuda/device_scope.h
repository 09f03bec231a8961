// Makes a CUDA device current for a scope and restores the caller's after (internal to
// core/cuda: CUDA types).
#ifndef MOESERVE_CORE_CUDA_DEVICE_SCOPE_H_
#define MOESERVE_CORE_CUDA_DEVICE_SCOPE_H_

#include <cuda_runtime.h>

namespace moeserve {

class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) {
      cudaGetLastError();
      previous_ = -1;
    }
    status_ = cudaSetDevice(device);
  }
  ~DeviceScope() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  // cudaSetDevice's result.
  cudaError_t status() const { return status_; }

 private:
  int previous_ = -1;
  cudaError_t status_ = cudaSuccess;
};

}  // namespace moeserve

#endif  // MOESERVE_CORE_CUDA_DEVICE_SCOPE_H_
