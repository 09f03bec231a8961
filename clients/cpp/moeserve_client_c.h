/* A C interface to the C++ client's Forward, for callers that cannot link C++ (the Python torch
 * client loads it with ctypes: clients/python/moeserve_client/native.py).
 *
 * Why: a Forward through Python's grpcio costs ~100 us more than the same call through the C++
 * client (tests/benchmarks/transport/RESULTS.md); through this library a Python caller pays
 * one foreign call. Tensor bytes are not copied on the way out: the request's slices point at
 * the caller's memory (which must stay valid and unchanged until the call is answered); the
 * answer is copied once, into the caller's `out`.
 *
 * Codes: every call returns a gRPC status code (0 OK, 3 INVALID_ARGUMENT, 4 DEADLINE_EXCEEDED,
 * 14 UNAVAILABLE, ...) and writes the message, NUL-terminated and cut to fit, into `err`
 * (`err_len` bytes; NULL / 0: none). Dtypes are moeserve.v1.DType values (1 BF16, 2 FP16,
 * 3 FP32, 4 INT32, 5 INT64).
 *
 * Thread-safety: a client may be used from any number of threads at once; a call object by one
 * thread at a time. No function keeps a pointer to its arguments after it returns, except the
 * tensor bytes of a submitted call, referenced until moeserve_call_wait or moeserve_call_free
 * has returned. */
#ifndef MOESERVE_CLIENTS_CPP_MOESERVE_CLIENT_C_H_
#define MOESERVE_CLIENTS_CPP_MOESERVE_CLIENT_C_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MOESERVE_CLIENT_C_ABI_VERSION 3

/* The library is built with hidden visibility: only these functions are exported (the C++
 * client, gRPC's C++ layer and the proto stubs stay private to it). */
#if defined(__GNUC__)
#define MOESERVE_C_API __attribute__((visibility("default")))
#else
#define MOESERVE_C_API
#endif

typedef struct MoeserveClient MoeserveClient;
typedef struct MoeserveCall MoeserveCall;

/* MOESERVE_CLIENT_C_ABI_VERSION of the library (a loader checks it before binding). */
MOESERVE_C_API int moeserve_client_abi_version(void);

/* How a client connects. Zero-initialize it, then set what you need: 0 / NULL fields take the
 * defaults named. Strings are copied (files are read) by moeserve_client_create. */
typedef struct MoeserveClientOptions {
  int64_t max_message_bytes; /* largest message either way; 0: 256 MiB */
  double timeout_s;          /* each call's default deadline; 0: 30 s */
  int64_t spin_us;           /* a blocking call polls this long before it sleeps; 0: none */
  const char* auth_token;    /* sent as "authorization: Bearer <token>" on every call */
  int32_t use_tls;           /* TLS (also on when any tls_* file is set) */
  const char* tls_ca_file;   /* PEM roots that verify the server (NULL: the system's) */
  const char* tls_cert_file; /* this client's certificate and key (mutual TLS), together */
  const char* tls_key_file;
  const char* tls_server_name; /* the name the server's certificate carries, if not the host */
  int32_t wait_for_ready;      /* calls wait for the channel to connect instead of failing */
} MoeserveClientOptions;

/* A client for `target` (HOST:PORT, unix:/path or any gRPC target). options: NULL for the
 * defaults. Does not contact the server. NULL on a bad argument or an unreadable TLS file.
 * The first call turns Abseil's mutex deadlock detection off for the process (gRPC's per-call
 * locks pay for its lock-order graph where the Abseil in use was built with it on). */
MOESERVE_C_API MoeserveClient* moeserve_client_create(const char* target,
                                                      const MoeserveClientOptions* options,
                                                      char* err, size_t err_len);
MOESERVE_C_API void moeserve_client_destroy(MoeserveClient* client);

/* One layer's inputs. hidden_states: [num_tokens, hidden] in hidden_dtype (BF16/FP16/FP32),
 * row-major. topk_ids: [num_tokens, topk] INT32 or INT64 (ids_dtype), topk_weights:
 * [num_tokens, topk] FP32; both NULL (and topk 0) for routing on the server. request_id: NULL or
 * a NUL-terminated string. return_timings: 0 none, 2 the host clock's stages and total only
 * (return_host_timings: the step runs untimed; since ABI 3), any other value the stage timings.
 * timeout_s <= 0: the client's. */
typedef struct MoeserveForwardArgs {
  int32_t layer;
  int32_t hidden_dtype;
  int64_t num_tokens;
  int64_t hidden;
  const void* hidden_states;
  int32_t ids_dtype;
  int64_t topk;
  const void* topk_ids;
  const float* topk_weights;
  const char* request_id;
  int32_t return_timings;
  int32_t return_routing;
  double timeout_s;
} MoeserveForwardArgs;

/* What a finished call gives back. out: the answer's bytes go here (out_bytes must equal the
 * answer's: num_tokens * hidden * itemsize of hidden_dtype; an answer written to an output
 * region has none and leaves out untouched). The answer must have hidden_dtype and shape
 * [num_tokens, hidden] (expect_*; expect_num_tokens < 0: not checked), else INTERNAL. header:
 * when not NULL, the ForwardResponse without the output's bytes (request_id, timings, routing),
 * serialized, written if it fits `header_cap` (else RESOURCE_EXHAUSTED); its size in
 * *header_len. */
typedef struct MoeserveResult {
  void* out;
  int64_t out_bytes;
  int32_t expect_dtype;
  int64_t expect_num_tokens;
  int64_t expect_hidden;
  char* header;
  size_t header_cap;
  size_t* header_len;
} MoeserveResult;

/* A blocking Forward built from `args`. */
MOESERVE_C_API int moeserve_forward(MoeserveClient* client, const MoeserveForwardArgs* args,
                                    const MoeserveResult* result, char* err, size_t err_len);

/* A blocking Forward of a ready-made request: the serialized moeserve.v1.ForwardRequest is the
 * concatenation of `num_parts` byte ranges (e.g. headers around tensor bytes), sent in place. */
MOESERVE_C_API int moeserve_forward_parts(MoeserveClient* client, int num_parts,
                                          const void* const* parts, const int64_t* part_bytes,
                                          double timeout_s, const MoeserveResult* result, char* err,
                                          size_t err_len);

/* The same, started and returned at once: *call gets the call (NULL on error), whose inputs
 * must stay valid until moeserve_call_wait or moeserve_call_free returns. */
MOESERVE_C_API int moeserve_submit(MoeserveClient* client, const MoeserveForwardArgs* args,
                                   MoeserveCall** call, char* err, size_t err_len);
MOESERVE_C_API int moeserve_submit_parts(MoeserveClient* client, int num_parts,
                                         const void* const* parts, const int64_t* part_bytes,
                                         double timeout_s, MoeserveCall** call, char* err,
                                         size_t err_len);

/* Whether the call has its answer (1) or not yet (0). */
MOESERVE_C_API int moeserve_call_done(const MoeserveCall* call);

/* Waits for the call's answer (its deadline bounds the wait) and finishes it as the blocking
 * forms do. Once per call. */
MOESERVE_C_API int moeserve_call_wait(MoeserveCall* call, const MoeserveResult* result, char* err,
                                      size_t err_len);

/* Frees the call; one still in flight is waited for first (its deadline bounds the wait). */
MOESERVE_C_API void moeserve_call_free(MoeserveCall* call);

#ifdef __cplusplus
}  // extern "C"
#endif

#endif /* MOESERVE_CLIENTS_CPP_MOESERVE_CLIENT_C_H_ */
