// Shared-memory regions with the CUDA engine, end to end: this test is the frontend. It starts
// the moeserve binary (--backend cuda --enable_shared_memory, a unix socket), allocates device
// memory, exports a cudaIpcMemHandle_t (a handle is opened by another process, so the server
// must be one), registers it, runs Forward calls whose inputs and answer live in that memory,
// and checks the answers against a CPU reference engine with the same synthetic weights. Also:
// a system shm region on the CUDA engine (page-locked by the server), and the GPU-side refusals.
// Skips where no GPU exists.
#include <cuda_runtime.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "clients/cpp/moeserve_client.h"
#include "core/engine.h"
#include "core/model_config.h"
#include "kernels/cpu/dtype_convert.h"
#include "tests/testing/shm_util.h"
#include "tests/testing/test_util.h"

namespace moeserve {
namespace {

using ::moeserve::client::ForwardRegionArgs;
using ::moeserve::client::MakeRegionRef;
using ::moeserve::client::MoeClient;
using ::moeserve::testing::ShmObject;
using ::testing::HasSubstr;

// The CUDA engine computes with BF16 activations whatever the wire dtype: relative L2 against
// the FP32-accumulating CPU reference.
constexpr double kTolerance = 1e-2;
constexpr int kHidden = 256, kIntermediate = 128, kExperts = 8, kTopk = 3, kLayers = 2;
constexpr uint64_t kSeed = 21;

int GpuCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

class ServerProcess {
 public:
  explicit ServerProcess(std::vector<std::string> args) {
    // $MOESERVE_BINARY overrides the build tree's path (binaries bundled for a GPU machine).
    const char* binary = std::getenv("MOESERVE_BINARY");
    args.insert(args.begin(), binary != nullptr && *binary != '\0' ? binary : MOESERVE_BINARY);
    pid_ = fork();
    if (pid_ == 0) {
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
  }
  ~ServerProcess() {
    if (pid_ > 0) {
      kill(pid_, SIGTERM);
      for (int i = 0; i < 500; ++i) {
        if (waitpid(pid_, nullptr, WNOHANG) == pid_) return;
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  bool Running() const { return pid_ > 0 && waitpid(pid_, nullptr, WNOHANG) == 0; }

 private:
  pid_t pid_ = -1;
};

ModelConfig TestModel() {
  ModelConfig model = ModelPreset("tiny").value();
  ModelOverrides o;
  o.num_layers = kLayers;
  o.num_experts = kExperts;
  o.topk = kTopk;
  o.hidden = kHidden;
  o.intermediate = kIntermediate;
  return ApplyOverrides(model, o).value();
}

// One request's inputs, encoded, and the reference answer as floats.
struct Case {
  int layer = 0;
  int64_t m = 0;
  v1::DType dtype = v1::DTYPE_BF16;
  std::string hidden;  // [m, kHidden] in dtype
  std::vector<int32_t> ids;
  std::vector<float> weights;
  std::vector<float> expected;
};

std::vector<float> DecodeHidden(const void* data, int64_t n, v1::DType dtype) {
  std::vector<float> out(n);
  if (dtype == v1::DTYPE_FP32) {
    std::memcpy(out.data(), data, n * 4);
  } else if (dtype == v1::DTYPE_BF16) {
    kernels::ConvertBf16ToFp32Ref(static_cast<const uint16_t*>(data), out.data(), n);
  } else {
    kernels::ConvertFp16ToFp32Ref(static_cast<const uint16_t*>(data), out.data(), n);
  }
  return out;
}

class SharedMemoryCudaTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (GpuCount() == 0) return;
    socket_ = ::testing::TempDir() + "/moeserve_shm_cuda." + std::to_string(getpid());
    ready_ = socket_ + ".ready";
    std::remove(ready_.c_str());
    server_ = new ServerProcess(
        {"--backend=cuda", "--ranks=1", "--enable_shared_memory", "--model=tiny",
         "--num_layers=" + std::to_string(kLayers), "--num_experts=" + std::to_string(kExperts),
         "--topk=" + std::to_string(kTopk), "--hidden=" + std::to_string(kHidden),
         "--intermediate=" + std::to_string(kIntermediate), "--seed=" + std::to_string(kSeed),
         "--listen=unix:" + socket_, "--metrics_address=", "--ready_file=" + ready_,
         // 64 KiB: this small model's larger calls take the upload (4 MiB by default)
         "--upload_min_bytes=65536"});
    EngineOptions options;
    options.model = TestModel();
    options.seed = kSeed;
    options.backend = "cpu";
    options.experts = "reference";
    options.num_threads = 2;
    reference_ = Engine::Create(options).value().release();
  }
  static void TearDownTestSuite() {
    delete server_;
    delete reference_;
    std::remove(ready_.c_str());
  }

  void SetUp() override {
    if (GpuCount() == 0) GTEST_SKIP() << "no CUDA device";
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(180);
    while (!std::ifstream(ready_) && server_->Running() && std::chrono::steady_clock::now() < end) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ASSERT_TRUE(std::ifstream(ready_)) << "the server did not become ready";
    client::MoeClientOptions options;
    options.wait_for_ready = true;
    client_ = MoeClient::Create("unix:" + socket_, options).value();
    auto info = client_->GetModelInfo();
    ASSERT_TRUE(info.ok()) << info.status();
    ASSERT_EQ(info->backend(), "cuda");
  }
  void TearDown() override {
    if (client_ != nullptr) {
      EXPECT_TRUE(client_->UnregisterSharedMemory("").ok());
    }
  }

  Case Random(int64_t m, v1::DType dtype, int layer) {
    Case c;
    c.layer = layer;
    c.m = m;
    c.dtype = dtype;
    std::normal_distribution<float> normal(0.f, 1.f);
    std::vector<float> x(m * kHidden);
    for (float& v : x) v = normal(rng_);
    const size_t itemsize = dtype == v1::DTYPE_FP32 ? 4 : 2;
    c.hidden.resize(x.size() * itemsize);
    if (dtype == v1::DTYPE_FP32) {
      std::memcpy(c.hidden.data(), x.data(), c.hidden.size());
    } else if (dtype == v1::DTYPE_BF16) {
      kernels::ConvertFp32ToBf16Ref(x.data(), reinterpret_cast<uint16_t*>(c.hidden.data()),
                                    m * kHidden);
    } else {
      kernels::ConvertFp32ToFp16Ref(x.data(), reinterpret_cast<uint16_t*>(c.hidden.data()),
                                    m * kHidden);
    }
    std::uniform_real_distribution<float> uniform(0.05f, 1.f);
    for (int64_t t = 0; t < m; ++t) {
      std::vector<int> perm(kExperts);
      for (int e = 0; e < kExperts; ++e) perm[e] = e;
      std::shuffle(perm.begin(), perm.end(), rng_);
      float sum = 0;
      for (int k = 0; k < kTopk; ++k) {
        c.ids.push_back(perm[k]);
        c.weights.push_back(uniform(rng_));
        sum += c.weights.back();
      }
      for (int k = 0; k < kTopk; ++k) c.weights[t * kTopk + k] /= sum;
    }
    const DType core = dtype == v1::DTYPE_FP32   ? DType::kFP32
                       : dtype == v1::DTYPE_BF16 ? DType::kBF16
                                                 : DType::kFP16;
    ForwardInput in;
    in.layer = layer;
    in.hidden_states = TensorView(static_cast<const void*>(c.hidden.data()), core, {m, kHidden});
    in.topk_ids = TensorView(static_cast<const void*>(c.ids.data()), DType::kINT32, {m, kTopk});
    in.topk_weights =
        TensorView(static_cast<const void*>(c.weights.data()), DType::kFP32, {m, kTopk});
    Tensor out = Tensor::Empty(core, {m, kHidden});
    const absl::Status s = reference_->Forward(in, out.view());
    EXPECT_TRUE(s.ok()) << s;
    c.expected = DecodeHidden(out.data<char>(), m * kHidden, dtype);
    return c;
  }

  // Offsets of a case's tensors in one region from `base`, 256-byte aligned, and of its answer.
  struct Layout {
    int64_t hidden = 0, ids = 0, weights = 0, out = 0, end = 0;
  };
  static Layout LayoutAt(const Case& c, int64_t base) {
    const auto up = [](int64_t n) { return (n + 255) / 256 * 256; };
    Layout l;
    l.hidden = base;
    l.ids = l.hidden + up(c.hidden.size());
    l.weights = l.ids + up(c.ids.size() * 4);
    l.out = l.weights + up(c.weights.size() * 4);
    l.end = l.out + up(c.hidden.size());
    return l;
  }
  static ForwardRegionArgs Args(const Case& c, const std::string& region, const Layout& l) {
    ForwardRegionArgs a;
    a.layer = c.layer;
    a.hidden_dtype = c.dtype;
    a.num_tokens = c.m;
    a.hidden = kHidden;
    a.topk = kTopk;
    a.hidden_states = MakeRegionRef(region, l.hidden, c.hidden.size());
    a.topk_ids = MakeRegionRef(region, l.ids, c.ids.size() * 4);
    a.topk_weights = MakeRegionRef(region, l.weights, c.weights.size() * 4);
    a.output = MakeRegionRef(region, l.out, c.hidden.size());
    a.return_timings = true;
    return a;
  }

  static ServerProcess* server_;
  static Engine* reference_;
  static std::string socket_, ready_;
  std::unique_ptr<MoeClient> client_;
  std::mt19937 rng_{std::random_device{}()};
};

ServerProcess* SharedMemoryCudaTest::server_ = nullptr;
Engine* SharedMemoryCudaTest::reference_ = nullptr;
std::string SharedMemoryCudaTest::socket_;
std::string SharedMemoryCudaTest::ready_;

// Device memory of this process, freed on scope exit.
struct DeviceBuffer {
  explicit DeviceBuffer(size_t bytes) : bytes(bytes) {
    if (cudaMalloc(&ptr, bytes) != cudaSuccess) ptr = nullptr;
  }
  ~DeviceBuffer() {
    if (ptr != nullptr) cudaFree(ptr);
  }
  std::string Handle() const {
    cudaIpcMemHandle_t h;
    if (cudaIpcGetMemHandle(&h, ptr) != cudaSuccess) return "";
    return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
  }
  void* ptr = nullptr;
  size_t bytes = 0;
};

TEST_F(SharedMemoryCudaTest, CudaRegionInAndOutMatchesReference) {
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  DeviceBuffer buf(32 << 20);
  ASSERT_NE(buf.ptr, nullptr);
  const std::string handle = buf.Handle();
  ASSERT_EQ(handle.size(), 64u);
  absl::Status s = client_->RegisterCudaSharedMemory("gpu0", handle, 0, buf.bytes);
  ASSERT_TRUE(s.ok()) << s;
  auto status = client_->SharedMemoryStatus("gpu0");
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->regions(0).kind(), "cuda");
  EXPECT_EQ(status->regions(0).device_id(), 0);
  EXPECT_EQ(status->regions(0).byte_size(), static_cast<int64_t>(buf.bytes));

  int64_t base = 0;
  for (v1::DType dtype : {v1::DTYPE_BF16, v1::DTYPE_FP16, v1::DTYPE_FP32}) {
    // Each size twice with fresh inputs: the first call captures the step's CUDA graph (device
    // input and output), the second replays it and must read the new inputs.
    for (int64_t m : {1, 1, 16, 16, 64, 64, 300}) {
      const Case c = Random(m, dtype, static_cast<int>(m % kLayers));
      const Layout l = LayoutAt(c, base);
      ASSERT_LE(l.end, static_cast<int64_t>(buf.bytes));
      auto* d = static_cast<char*>(buf.ptr);
      ASSERT_EQ(cudaMemcpy(d + l.hidden, c.hidden.data(), c.hidden.size(), cudaMemcpyDefault),
                cudaSuccess);
      ASSERT_EQ(cudaMemcpy(d + l.ids, c.ids.data(), c.ids.size() * 4, cudaMemcpyDefault),
                cudaSuccess);
      ASSERT_EQ(
          cudaMemcpy(d + l.weights, c.weights.data(), c.weights.size() * 4, cudaMemcpyDefault),
          cudaSuccess);
      ASSERT_EQ(cudaMemset(d + l.out, 0x7f, c.hidden.size()), cudaSuccess);
      auto result = client_->Forward(Args(c, "gpu0", l));
      ASSERT_TRUE(result.ok()) << result.status();
      EXPECT_TRUE(result->output.data().empty());
      std::string got(c.hidden.size(), '\0');
      ASSERT_EQ(cudaMemcpy(got.data(), d + l.out, got.size(), cudaMemcpyDefault), cudaSuccess);
      const double err =
          testing::RelativeL2Error(DecodeHidden(got.data(), m * kHidden, dtype), c.expected);
      EXPECT_LT(err, kTolerance) << v1::DType_Name(dtype) << " M=" << m;
      std::printf(
          "cuda region %s M=%lld: relative_l2=%.3g server total_us=%.1f round trip "
          "us=%.1f\n",
          v1::DType_Name(dtype).c_str(), static_cast<long long>(m), err, result->timings.total_us(),
          absl::ToDoubleMicroseconds(result->latency));
      base = l.end;
    }
  }
  EXPECT_TRUE(client_->UnregisterSharedMemory("gpu0").ok());
}

// gRPC bytes of hidden_states from --upload_min_bytes on go to the device while they are
// gathered (the rest through page-locked memory): both sides of it, every wire dtype, sizes
// twice (a CUDA graph's replay must read the new bytes), against the reference.
TEST_F(SharedMemoryCudaTest, GrpcBytesUploadedWhileGatheredMatchReference) {
  for (v1::DType dtype : {v1::DTYPE_BF16, v1::DTYPE_FP16, v1::DTYPE_FP32}) {
    // 8 KB .. 4 MB of hidden states: one chunk, then several (one part per gather thread).
    for (int64_t m : {16, 300, 300, 1024, 1024, 4096, 4096}) {
      const Case c = Random(m, dtype, static_cast<int>(m % kLayers));
      client::ForwardArgs a;
      a.layer = c.layer;
      a.hidden_dtype = c.dtype;
      a.num_tokens = m;
      a.hidden = kHidden;
      a.hidden_bytes = c.hidden;
      a.topk = kTopk;
      a.topk_ids = c.ids;
      a.topk_weights = c.weights;
      a.return_timings = true;
      auto result = client_->Forward(a);
      ASSERT_TRUE(result.ok()) << result.status();
      ASSERT_EQ(result->output.data().size(), c.hidden.size());
      const double err = testing::RelativeL2Error(
          DecodeHidden(result->output.data().data(), m * kHidden, dtype), c.expected);
      EXPECT_LT(err, kTolerance) << v1::DType_Name(dtype) << " M=" << m;
      std::printf("grpc bytes %s M=%lld: relative_l2=%.3g server total_us=%.1f prepare_us=%.1f\n",
                  v1::DType_Name(dtype).c_str(), static_cast<long long>(m), err,
                  result->timings.total_us(), result->timings.prepare_us());
    }
  }
}

TEST_F(SharedMemoryCudaTest, SystemRegionOnTheCudaEngineMatchesReference) {
  ShmObject shm(32 << 20);
  ASSERT_TRUE(shm.ok());
  ASSERT_TRUE(client_->RegisterSystemSharedMemory("host0", shm.key(), 0, shm.size()).ok());
  int64_t base = 0;
  for (v1::DType dtype : {v1::DTYPE_BF16, v1::DTYPE_FP32}) {
    for (int64_t m : {1, 1, 64, 64, 1024}) {  // twice: capture, then replay (page-locked I/O)
      const Case c = Random(m, dtype, 1);
      const Layout l = LayoutAt(c, base);
      ASSERT_LE(l.end, static_cast<int64_t>(shm.size()));
      shm.Write(l.hidden, c.hidden.data(), c.hidden.size());
      shm.Write(l.ids, c.ids.data(), c.ids.size() * 4);
      shm.Write(l.weights, c.weights.data(), c.weights.size() * 4);
      auto result = client_->Forward(Args(c, "host0", l));
      ASSERT_TRUE(result.ok()) << result.status();
      const double err = testing::RelativeL2Error(
          DecodeHidden(shm.data() + l.out, m * kHidden, dtype), c.expected);
      EXPECT_LT(err, kTolerance) << v1::DType_Name(dtype) << " M=" << m;
      std::printf(
          "system region %s M=%lld: relative_l2=%.3g server total_us=%.1f round trip "
          "us=%.1f\n",
          v1::DType_Name(dtype).c_str(), static_cast<long long>(m), err, result->timings.total_us(),
          absl::ToDoubleMicroseconds(result->latency));
      base = l.end;
    }
  }
}

TEST_F(SharedMemoryCudaTest, Refusals) {
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  DeviceBuffer buf(1 << 20);
  ASSERT_NE(buf.ptr, nullptr);
  const std::string handle = buf.Handle();
  // Larger than the allocation (the server reads the allocation's size).
  absl::Status s = client_->RegisterCudaSharedMemory("g", handle, 0, (64 << 20));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("exceeds the"));
  // A device the server does not see, a handle of the wrong length, a handle CUDA cannot open.
  s = client_->RegisterCudaSharedMemory("g", handle, GpuCount() + 3, buf.bytes);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  s = client_->RegisterCudaSharedMemory("g", handle.substr(0, 32), 0, buf.bytes);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  s = client_->RegisterCudaSharedMemory("g", std::string(64, '\x5a'), 0, buf.bytes);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("cudaIpcOpenMemHandle"));
  // The same allocation under two names shares one mapping; an output overlapping an input
  // through the other name is refused.
  ASSERT_TRUE(client_->RegisterCudaSharedMemory("g1", handle, 0, buf.bytes).ok());
  s = client_->RegisterCudaSharedMemory("g2", handle, 0, buf.bytes / 2);
  ASSERT_TRUE(s.ok()) << s;
  const Case c = Random(4, v1::DTYPE_BF16, 0);
  const Layout l = LayoutAt(c, 0);
  auto* d = static_cast<char*>(buf.ptr);
  ASSERT_EQ(cudaMemcpy(d + l.hidden, c.hidden.data(), c.hidden.size(), cudaMemcpyDefault),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d + l.ids, c.ids.data(), c.ids.size() * 4, cudaMemcpyDefault), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d + l.weights, c.weights.data(), c.weights.size() * 4, cudaMemcpyDefault),
            cudaSuccess);
  ForwardRegionArgs a = Args(c, "g1", l);
  a.output = MakeRegionRef("g2", l.hidden, c.hidden.size());
  auto result = client_->Forward(a);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument) << result.status();
  EXPECT_THAT(result.status().message(), HasSubstr("overlap hidden_states"));
  // Out of the registered range of g2.
  a.output = MakeRegionRef("g2", buf.bytes / 2 - 8, c.hidden.size());
  result = client_->Forward(a);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument) << result.status();
  // And served through either name.
  a.output = MakeRegionRef("g2", l.out, c.hidden.size());
  result = client_->Forward(a);
  ASSERT_TRUE(result.ok()) << result.status();
  std::string got(c.hidden.size(), '\0');
  ASSERT_EQ(cudaMemcpy(got.data(), d + l.out, got.size(), cudaMemcpyDefault), cudaSuccess);
  EXPECT_LT(
      testing::RelativeL2Error(DecodeHidden(got.data(), 4 * kHidden, v1::DTYPE_BF16), c.expected),
      kTolerance);
  // Routing in a CUDA region is checked on the device: a bad id or weight is refused in the
  // host check's words, and the next call is served.
  const int32_t bad_id = 1000;
  ASSERT_EQ(cudaMemcpy(d + l.ids + 4 * 5, &bad_id, 4, cudaMemcpyDefault), cudaSuccess);
  result = client_->Forward(a);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument) << result.status();
  EXPECT_THAT(result.status().message(),
              HasSubstr(absl::StrCat("topk_ids: value 1000 at [", 5 / kTopk, ", ", 5 % kTopk,
                                     "] is outside [0, ")));
  ASSERT_EQ(cudaMemcpy(d + l.ids, c.ids.data(), c.ids.size() * 4, cudaMemcpyDefault), cudaSuccess);
  const float nan = std::nanf("");
  ASSERT_EQ(cudaMemcpy(d + l.weights + 4 * 3, &nan, 4, cudaMemcpyDefault), cudaSuccess);
  result = client_->Forward(a);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument) << result.status();
  EXPECT_THAT(result.status().message(), HasSubstr("topk_weights: value nan"));
  ASSERT_EQ(cudaMemcpy(d + l.weights, c.weights.data(), c.weights.size() * 4, cudaMemcpyDefault),
            cudaSuccess);
  result = client_->Forward(a);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_TRUE(client_->UnregisterSharedMemory("").ok());
}

// Ids in a CUDA region with weights in a system region: both read as host copies, same answer.
TEST_F(SharedMemoryCudaTest, RoutingSplitAcrossRegionKinds) {
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  DeviceBuffer buf(4 << 20);
  ASSERT_NE(buf.ptr, nullptr);
  ShmObject shm(4 << 20);
  ASSERT_TRUE(shm.ok());
  ASSERT_TRUE(client_->RegisterCudaSharedMemory("gs", buf.Handle(), 0, buf.bytes).ok());
  ASSERT_TRUE(client_->RegisterSystemSharedMemory("hs", shm.key(), 0, shm.size()).ok());
  for (int64_t m : {1, 40, 300}) {
    const Case c = Random(m, v1::DTYPE_BF16, 1);
    const Layout l = LayoutAt(c, 0);
    auto* d = static_cast<char*>(buf.ptr);
    ASSERT_EQ(cudaMemcpy(d + l.hidden, c.hidden.data(), c.hidden.size(), cudaMemcpyDefault),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpy(d + l.ids, c.ids.data(), c.ids.size() * 4, cudaMemcpyDefault),
              cudaSuccess);
    shm.Write(l.weights, c.weights.data(), c.weights.size() * 4);
    ForwardRegionArgs a = Args(c, "gs", l);
    a.topk_weights = MakeRegionRef("hs", l.weights, c.weights.size() * 4);
    auto result = client_->Forward(a);
    ASSERT_TRUE(result.ok()) << result.status();
    std::string got(c.hidden.size(), '\0');
    ASSERT_EQ(cudaMemcpy(got.data(), d + l.out, got.size(), cudaMemcpyDefault), cudaSuccess);
    EXPECT_LT(
        testing::RelativeL2Error(DecodeHidden(got.data(), m * kHidden, v1::DTYPE_BF16), c.expected),
        kTolerance)
        << "M=" << m;
  }
  EXPECT_TRUE(client_->UnregisterSharedMemory("").ok());
}

}  // namespace
}  // namespace moeserve
