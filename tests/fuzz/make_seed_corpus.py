#!/usr/bin/env python3
"""Writes the seed corpora of tests/fuzz (corpus/<target>/seed_*): a few valid inputs of each
kind plus the malformed ones issue 14 found. Deterministic; re-run after changing it and commit
the result:  python3 tests/fuzz/make_seed_corpus.py
"""
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def varint(v):
    v &= (1 << 64) - 1
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def tag(number, wire):
    return varint(number << 3 | wire)


def ln(number, body):
    return tag(number, 2) + varint(len(body)) + body


def tensor(dtype, shape, data, packed=True):
    body = tag(1, 0) + varint(dtype) if dtype else b""
    if packed:
        body += ln(2, b"".join(varint(d) for d in shape))
    else:
        body += b"".join(tag(2, 0) + varint(d) for d in shape)
    return body + ln(3, data)


BF16, FP16, FP32, INT32, INT64 = 1, 2, 3, 4, 5
HIDDEN, TOPK, EXPERTS = 4, 2, 4  # the fuzz target's model


def request(m, layer=0, hidden_dtype=FP32, ids_dtype=INT32, request_id=b"", timings=False,
            weights=None, packed=True, ids=None):
    item = {BF16: 2, FP16: 2, FP32: 4}[hidden_dtype]
    hidden = bytes((i * 37 + 11) % 256 for i in range(m * HIDDEN * item))
    if hidden_dtype == FP32:
        hidden = b"".join(struct.pack("<f", 0.25 * ((i % 7) - 3)) for i in range(m * HIDDEN))
    if ids is None:
        ids = [(t + k) % EXPERTS for t in range(m) for k in range(TOPK)]
    ids_bytes = b"".join(struct.pack("<i" if ids_dtype == INT32 else "<q", i) for i in ids)
    if weights is None:
        weights = [0.5] * (m * TOPK)
    w_bytes = b"".join(struct.pack("<f", w) for w in weights)
    out = (tag(1, 0) + varint(layer)) if layer else b""
    out += ln(2, tensor(hidden_dtype, [m, HIDDEN], hidden, packed))
    out += ln(3, tensor(ids_dtype, [m, TOPK], ids_bytes, packed))
    out += ln(4, tensor(FP32, [m, TOPK], w_bytes, packed))
    if request_id:
        out += ln(5, request_id)
    if timings:
        out += tag(6, 0) + varint(1)
    return out


def forward_request_seeds():
    seeds = {
        "valid_fp32_m3": request(3),
        "valid_bf16_int64_layer1": request(2, layer=1, hidden_dtype=BF16, ids_dtype=INT64,
                                           request_id=b"req-7", timings=True),
        "valid_fp16_unpacked": request(1, hidden_dtype=FP16, packed=False),
        "valid_m0": request(0),
        "layer_2_pow_40": request(1) + tag(1, 0) + varint(1 << 40),
        "layer_negative": request(1, layer=-1),
        "dtype_2_pow_32_plus_3": ln(2, tag(1, 0) + varint((1 << 32) + 3) + ln(3, b"abcd")),
        "request_id_bad_utf8": request(1, request_id=b"\xff\xfe"),
        "request_id_overlong_utf8": request(1, request_id=b"\xc0\x80"),
        "weight_3e38": request(2, weights=[0.5, 3e38, 0.5, 0.5]),
        "weight_nan": request(1, weights=[float("nan"), 0.5]),
        "expert_out_of_range": request(1, ids=[1, EXPERTS]),
        "truncated_by_one": request(1)[:-1],
        "shape_zero_huge": ln(2, tensor(FP32, [0, 1 << 62, 1 << 62], b"")),
        "shape_overflow": ln(2, tensor(FP32, [1 << 62, 1 << 62], b"")),
        "truncated": request(2)[:-5],
        "group_unterminated": tag(7, 3) + tag(1, 0) + varint(1),
        "length_over_2gib": tag(2, 2) + b"\xff\xff\xff\xff\x7f",
        "empty": b"",
    }
    # The first byte of every input says how the bytes are cut into slices.
    return {name: bytes([i % 17]) + body for i, (name, body) in enumerate(seeds.items())}


def safetensors_file(tensors, metadata=None, header_len=None):
    header = {}
    data = b""
    for name, (dtype, shape, payload) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [len(data), len(data) + len(payload)]}
        data += payload
    if metadata is not None:
        header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text) if header_len is None else header_len) + text + data


def safetensors_seeds():
    w = bytes(range(16))
    return {
        "valid_two_tensors": safetensors_file(
            {"a.weight": ("BF16", [2, 2], w[:8]), "b.weight": ("F32", [2], w[8:16])},
            metadata={"format": "pt"}),
        "valid_fp8_scales": safetensors_file(
            {"x.weight": ("F8_E4M3", [2, 4], w[:8]), "x.weight_scale": ("U8", [2, 1], w[8:10])}),
        "valid_empty_object": struct.pack("<Q", 2) + b"{}",
        "zero_dim": safetensors_file({"z": ("F32", [0, 1 << 62], b"")}),
        "shape_overflow": safetensors_file({"o": ("F32", [1 << 62, 1 << 62], b"")}),
        "offsets_overlap": struct.pack("<Q", 98) + json.dumps(
            {"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
             "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}}).encode()[:98] + w[:6],
        "header_past_end": struct.pack("<Q", 1 << 40) + b"{}",
        "not_json": struct.pack("<Q", 4) + b"{{{{",
        "metadata_not_string": safetensors_file({}, metadata={"k": 1}),
        "short": b"\x01\x00",
    }


def hf_config_seeds():
    qwen = {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8, "num_experts_per_tok": 2,
            "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 4,
            "decoder_sparse_step": 1, "mlp_only_layers": [0]}
    deepseek = {"n_routed_experts": 16, "num_experts_per_tok": 4, "hidden_size": 128,
                "moe_intermediate_size": 64, "num_hidden_layers": 5, "first_k_dense_replace": 1,
                "moe_layer_freq": 1}
    mixtral = {"num_local_experts": 8, "num_experts_per_tok": 2, "hidden_size": 64,
               "intermediate_size": 128, "num_hidden_layers": 2}
    huge = dict(mixtral, hidden_size=1 << 30, intermediate_size=1 << 30)
    return {
        "qwen3": json.dumps(qwen).encode(),
        "deepseek": json.dumps(deepseek).encode(),
        "mixtral": json.dumps(mixtral).encode(),
        "sizes_2_pow_30": json.dumps(huge).encode(),
        "sizes_int64_max": json.dumps(dict(mixtral, hidden_size=(1 << 63) - 1)).encode(),
        "negative_topk": json.dumps(dict(mixtral, num_experts_per_tok=-1)).encode(),
        "no_moe_layer": json.dumps(dict(deepseek, first_k_dense_replace=99)).encode(),
        "mlp_only_layers_string": json.dumps(dict(qwen, mlp_only_layers="0")).encode(),
        "float_size": json.dumps(dict(mixtral, hidden_size=64.5)).encode(),
        "truncated": json.dumps(qwen).encode()[:40],
        "not_object": b"[1, 2]",
    }


def mxfp8_seeds():
    seeds = {}
    # Decode (second byte even): k = 1 + b0 % 96, then rows x k codes and rows x ceil(k/32)
    # scales.
    k = 40
    codes = bytes((i * 29) % 256 for i in range(2 * k))
    scales = bytes([0, 127, 254, 255])
    seeds["decode_k40_nan_and_extreme_scales"] = bytes([k - 1, 0]) + codes + scales
    seeds["decode_k32_all_nan_codes"] = bytes([31, 2]) + bytes([0x7F, 0xFF] * 16) + bytes([127])
    # Encode (second byte odd): rows x k BF16 values.
    def bf16(x):
        return struct.pack("<f", x)[2:]
    vals = [0.0, -0.0, 1.0, -2.5, 448.0, 1e-3, 3.3e38, -3.3e38, 1e-40, 7.0] * 4
    seeds["encode_k40_mixed"] = bytes([39, 1]) + b"".join(bf16(v) for v in vals)
    seeds["encode_k8_with_inf"] = bytes([7, 3]) + b"".join(
        bf16(v) for v in [1.0, 2.0, float("inf"), 4.0, 5.0, 6.0, 7.0, 8.0])
    seeds["encode_k1_zero"] = bytes([0, 1]) + bf16(0.0)
    return seeds


def main():
    for target, seeds in [("forward_request", forward_request_seeds()),
                          ("safetensors", safetensors_seeds()),
                          ("hf_config", hf_config_seeds()), ("mxfp8", mxfp8_seeds())]:
        d = os.path.join(HERE, "corpus", target)
        os.makedirs(d, exist_ok=True)
        for name, body in seeds.items():
            with open(os.path.join(d, "seed_" + name), "wb") as f:
                f.write(body)
        print(f"{target}: {len(seeds)} seeds in {d}")


if __name__ == "__main__":
    main()
