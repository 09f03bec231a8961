// Releases of memory that may wait for the whole device, run on one background thread instead of
// the thread that lets go of the memory.
//
// Why: cudaFree, cudaFreeHost and cudaHostUnregister each wait until every stream of the device
// is idle (scripts/gpu/alloc_wait_probe.cu on an H100, 2026-12-05: each blocked for as long as an
// unrelated stream was held, 16 KiB or 64 MiB alike). The threads that let go of memory are
// serving threads: the one answering a Unregister RPC or a region's last call, the one decoding
// the next request. Here they go on at once.
//
// What this does not spare: while one thread waits in such a call, every other thread's CUDA
// calls wait too (a launch and sync on another stream, a 14 KB copy, cudaMalloc,
// cudaHostRegister: the same probe, --concurrent_only). So a release still stalls the device's
// serving until the work in flight drains; memory released often on a serving path should not
// be released at all (PooledBuffer keeps its page-locked buffers; GrowOnlyBuffer grows).
//
// ReleaseInBackground queues `release`; a single thread (started by the first call, never
// stopped: buffers are let go during process exit too) runs the releases in the order they were
// queued. A release must not need the caller's locks, and must own what it frees: the memory is
// no longer used by anyone when it is handed over.
//
// Thread-safe. Nothing here includes CUDA; callers pass the closure that calls it.
#ifndef MOESERVE_CORE_BACKGROUND_RELEASE_H_
#define MOESERVE_CORE_BACKGROUND_RELEASE_H_

#include <cstdint>
#include <functional>

namespace moeserve {

// Queues `release` to run on the background release thread (after every release queued before
// it). Never blocks on the device; never runs `release` on the calling thread.
void ReleaseInBackground(std::function<void()> release);

// Blocks until every release queued before this call has run (tests, and a shutdown that wants
// the memory back). Must not be called from a release.
void FlushBackgroundReleases();

// Releases queued and run so far (a statistic; both monotonic).
struct BackgroundReleaseCounts {
  uint64_t queued = 0;
  uint64_t done = 0;
};
BackgroundReleaseCounts GetBackgroundReleaseCounts();

}  // namespace moeserve

#endif  // MOESERVE_CORE_BACKGROUND_RELEASE_H_
