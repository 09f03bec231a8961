// A moeserve process from start to exit: ports first, weights in the background, then serving.
//
//  1. Resolve the model (a checkpoint's config.json is read here) and the message limits
//     (server/limits.h), so the largest valid request fits in a gRPC message.
//  2. Bind: the leader (or a single process) binds gRPC (moeserve.v1, KServe v2, health,
//     reflection when asked; TLS and tokens as ServerOptions say) and /metrics with health
//     NOT_SERVING; a follower binds its health server (the same TLS) and /metrics.
//  3. Load on a background thread: multi-process bootstrap, then Engine::Create, with progress
//     on stderr and /metrics (server/load_progress.h). Calls meanwhile get UNAVAILABLE saying how
//     far the load is.
//  4. Serve: attach the engine, health SERVING, write the ready file.
//  5. SIGTERM / SIGINT: stop accepting, let in-flight calls finish, exit 0. A signal during the
//     load stops it within one layer (or gives up waiting after kLoadStopWait) and exits 0.
// Any failure to build the engine ends the process with exit code 1: never serve wrong weights.
#ifndef MOESERVE_SERVER_STARTUP_H_
#define MOESERVE_SERVER_STARTUP_H_

#include <cstdint>
#include <string>

#include "absl/time/time.h"
#include "core/engine_plan.h"
#include "server/internal_bootstrap.h"
#include "server/server.h"

namespace moeserve {

struct ProcessOptions {
  EngineOptions engine;  // model not yet resolved against a checkpoint
  // 0: derived from the model and engine.max_tokens_per_request (server/limits.h).
  int64_t max_message_bytes = 0;
  ServerOptions server;             // its message limits are filled in from the resolved ones
  MultiProcessFlags multi_process;  // local_ranks is taken from engine.num_ranks
  // The multi-process bootstrap's listen address, TLS and token (server/internal_bootstrap.h).
  BootstrapOptions bootstrap;
  absl::Duration bootstrap_timeout = absl::Seconds(300);
  // If set, once serving: "HOST:PORT" (first listen address, bound port) and, with metrics on,
  // "metrics HOST:PORT", written atomically.
  std::string ready_file;
  // Sleep after each loaded layer shard (tests and demonstrations of the startup; 0: off).
  int64_t load_delay_ms = 0;
};

inline constexpr absl::Duration kLoadStopWait = absl::Seconds(10);

// Runs the process until it is told to stop; returns its exit code (0 clean, 1 failure).
// Installs SIGTERM / SIGINT handlers and ignores SIGPIPE. Call once, from main.
int RunMoeserveProcess(ProcessOptions options);

}  // namespace moeserve

#endif  // MOESERVE_SERVER_STARTUP_H_
