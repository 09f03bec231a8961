#!/usr/bin/env python3
"""Writes small Mixture-of-Experts checkpoints in real Hugging Face layout, for moeserve's tests.

The weights are written with the `safetensors` package from PyPI (safetensors.numpy.save_file),
never with a writer of our own, so the files are what Hugging Face tooling produces. Next to
config.json and the *.safetensors the script writes reference/ with the expert weights in
moeserve's layout, computed here with numpy (independently of the C++ loader):

  reference/layer{L}_w13.bf16.bin  BF16 [E, 2I, H]  rows [0, I) = gate, [I, 2I) = up
  reference/layer{L}_w2.bf16.bin   BF16 [E, H, I]   down
  reference/layer{L}_{w13,w2}.{q,scale}.bin  (pre-quantized MXFP8 only) the E4M3 codes and E8M0
                                   scale codes, [E, rows, K] and [E, rows, ceil(K/32)]
  reference/layer{L}_gate.f32.bin  the router gate [E, H] as float32 (the stored values widened)
  reference/layer{L}_gate_bias.f32.bin  (--correction-bias) e_score_correction_bias [E]
  reference/info.json              sizes, MoE layers, scheme, dtype, corruption

BF16 reference values are what the checkpoint holds, rounded to BF16 (round to nearest even)
for F32 checkpoints, and dequantized (exactly) for pre-quantized MXFP8 ones.

Schemes: qwen3-moe (mlp.experts.E.gate_proj/up_proj/down_proj; dense layers via
mlp_only_layers), deepseek-v3 (same naming; first_k_dense_replace dense layers first),
mixtral (block_sparse_moe.experts.E.w1/w3/w2; every layer MoE).

Pre-quantized MXFP8 (--mxfp8): each expert weight is F8_E4M3 with its E8M0 scales, one per 32
consecutive values of a row, in "<weight name>_scale" (U8, [rows, ceil(K/32)]).

Usage:
  make_test_checkpoint.py OUT --scheme qwen3-moe [--shards 3] [--dtype bf16|f16|f32] [--mxfp8]
                          [--seed 0] [--layers 4] [--experts 8] [--topk 2] [--hidden 80]
                          [--intermediate 48] [--dense 1] [--corrupt KIND]
  make_test_checkpoint.py --suite OUT   # every checkpoint tests/checkpoint uses, in OUT/<name>

Router options (--gate-std, --no-gates, --norm-topk-prob, --n-group, --topk-group,
--routed-scaling-factor, --scoring-func, --correction-bias) shape the gates and config.json's
routing keys for the server-side routing tests; the defaults write what they always did.

Corruptions (--corrupt), each applied to expert 1's up weight of the first MoE layer:
  truncated          the file holding it loses its last bytes
  header_past_end    the 8-byte header length points past the end of that file
  offsets_past_end   its data_offsets point past the end of the data section
  unknown_dtype      its dtype is "Q7"
  missing_expert     it is not written (nor listed in the index)
  shape_mismatch     it is written transposed ([hidden, intermediate]), unlike config.json
  nan_weight         one of its values is NaN
  f64_weight         it is F64, which moeserve does not load
  huge_weight        one BF16 value is 0x7F7F (finite, 3.39e38): loads as bf16, but quantized
                     to MXFP8 it rounds to 2^128 (Inf in FP32), so serving it as mxfp8 refuses
  mxfp8_overflow     (with --mxfp8) one value is 0x7e (1.75) in a block of scale 2^127 (the
                     block's other values 0): Inf in FP32
Packages: numpy, safetensors, ml_dtypes (for BF16 and F8_E4M3 numpy dtypes).
"""

import argparse
import json
import os
import shutil
import struct
import sys

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

CORRUPTIONS = ("truncated", "header_past_end", "offsets_past_end", "unknown_dtype",
               "missing_expert", "shape_mismatch", "nan_weight", "f64_weight", "huge_weight",
               "mxfp8_overflow")
SCHEMES = ("qwen3-moe", "deepseek-v3", "mixtral")
VOCAB = 64


def expert_names(scheme, layer, expert):
    if scheme == "mixtral":
        p = f"model.layers.{layer}.block_sparse_moe.experts.{expert}."
        return p + "w1.weight", p + "w3.weight", p + "w2.weight"
    p = f"model.layers.{layer}.mlp.experts.{expert}."
    return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"


def moe_layers(scheme, layers, dense):
    if scheme == "mixtral":
        return list(range(layers))
    if scheme == "deepseek-v3":
        return [l for l in range(layers) if l >= dense]
    # qwen3-moe: the last `dense` layers are listed in mlp_only_layers.
    return [l for l in range(layers) if l < layers - dense]


def make_config(a, moe):
    common = {
        "hidden_size": a.hidden,
        "num_hidden_layers": a.layers,
        "num_experts_per_tok": a.topk,
        "vocab_size": VOCAB,
        "rms_norm_eps": 1e-6,
        "torch_dtype": {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}[a.dtype],
    }
    if a.scheme == "mixtral":
        return dict(common, architectures=["MixtralForCausalLM"], model_type="mixtral",
                    num_local_experts=a.experts, intermediate_size=a.intermediate,
                    num_attention_heads=4, num_key_value_heads=2)
    routing = {}
    if a.norm_topk_prob is not None:
        routing["norm_topk_prob"] = a.norm_topk_prob == "true"
    if a.scheme == "deepseek-v3":
        if a.routed_scaling_factor is not None:
            routing["routed_scaling_factor"] = a.routed_scaling_factor
        if a.scoring_func is not None:
            routing["scoring_func"] = a.scoring_func
        return dict(common, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
                    n_routed_experts=a.experts, n_shared_experts=1,
                    moe_intermediate_size=a.intermediate, intermediate_size=3 * a.intermediate,
                    first_k_dense_replace=a.dense, moe_layer_freq=1, n_group=a.n_group,
                    topk_group=a.topk_group, topk_method="noaux_tc", num_attention_heads=4,
                    **routing)
    dense = [l for l in range(a.layers) if l not in moe]
    return dict(common, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                num_experts=a.experts, moe_intermediate_size=a.intermediate,
                intermediate_size=3 * a.intermediate, decoder_sparse_step=1,
                mlp_only_layers=dense, num_attention_heads=4, num_key_value_heads=2, **routing)


def mxfp8_quantize(x):
    """x float32 [rows, k] -> (E4M3 codes as float8_e4m3fn [rows, k], E8M0 codes uint8)."""
    rows, k = x.shape
    blocks = (k + 31) // 32
    padded = np.zeros((rows, blocks * 32), np.float32)
    padded[:, :k] = x
    amax = np.abs(padded.reshape(rows, blocks, 32)).max(axis=2).astype(np.float64)
    # ceil(log2(amax / 448)) exactly: frexp gives amax/448 = m * 2^e, m in [0.5, 1).
    m, e = np.frexp(amax / 448.0)
    ceil_log2 = np.where(m == 0.5, e - 1, e)
    code = np.where(amax == 0, 0, np.clip(ceil_log2 + 127, 0, 254)).astype(np.uint8)
    scale = np.ldexp(1.0, code.astype(np.int32) - 127)
    scaled = padded.reshape(rows, blocks, 32) / scale[:, :, None]
    q = np.clip(scaled, -448.0, 448.0).reshape(rows, blocks * 32)[:, :k]
    return q.astype(ml_dtypes.float8_e4m3fn), code


def mxfp8_dequantize(q, code):
    rows, k = q.shape
    scale = np.ldexp(1.0, code.astype(np.int32) - 127).astype(np.float64)
    full = np.repeat(scale, 32, axis=1)[:, :k]
    return (q.astype(np.float64) * full).astype(np.float32)


def np_dtype(name):
    return {"bf16": ml_dtypes.bfloat16, "f16": np.float16, "f32": np.float32}[name]


def write_header(path, header, data):
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)


def read_header(path):
    with open(path, "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def build(a):
    """Writes one checkpoint into a.out; returns info about it."""
    if os.path.exists(a.out):
        shutil.rmtree(a.out)
    os.makedirs(os.path.join(a.out, "reference"))
    rng = np.random.default_rng(a.seed)
    moe = moe_layers(a.scheme, a.layers, a.dense)
    H, I, E = a.hidden, a.intermediate, a.experts
    dt = np_dtype(a.dtype)
    tensors = {}  # insertion order = write order
    victim_layer = moe[0]
    victim = expert_names(a.scheme, victim_layer, 1)[1]

    def small(*shape):
        return (rng.standard_normal(shape) * 0.02).astype(np.float32).astype(dt)

    tensors["model.embed_tokens.weight"] = small(VOCAB, H)
    for l in range(a.layers):
        p = f"model.layers.{l}."
        tensors[p + "input_layernorm.weight"] = np.ones(H, np.float32).astype(dt)
        tensors[p + "self_attn.q_proj.weight"] = small(H, H)
        if l not in moe:  # a dense MLP, which moeserve leaves to the frontend
            for n, shape in (("gate_proj", (3 * I, H)), ("up_proj", (3 * I, H)),
                             ("down_proj", (H, 3 * I))):
                tensors[p + f"mlp.{n}.weight"] = small(*shape)
            continue
        router = "block_sparse_moe.gate.weight" if a.scheme == "mixtral" else "mlp.gate.weight"
        # The same draw as small() (so the other tensors do not change), at the gate's scale.
        gate = (rng.standard_normal((E, H)) * a.gate_std).astype(np.float32).astype(dt)
        refdir = os.path.join(a.out, "reference")
        first_moe = l == moe[0]
        if a.gate_corrupt == "nan" and first_moe:
            gate = gate.copy()
            gate[1, 2] = np.nan
        if not a.no_gates and not (a.gate_corrupt == "missing" and first_moe):
            tensors[p + router] = gate
            gate.astype(np.float32).tofile(os.path.join(refdir, f"layer{l}_gate.f32.bin"))
        if a.correction_bias:  # DeepSeek-V3's e_score_correction_bias, F32 as released
            brng = np.random.default_rng(a.seed + 7919 + l)
            bias = (brng.standard_normal(E) * 0.1).astype(np.float32)
            tensors[p + "mlp.gate.e_score_correction_bias"] = bias
            bias.tofile(os.path.join(refdir, f"layer{l}_gate_bias.f32.bin"))
        if a.scheme == "deepseek-v3":
            for n, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                tensors[p + f"mlp.shared_experts.{n}.weight"] = small(*shape)
        w13_ref = np.zeros((E, 2 * I, H), np.float32)
        w2_ref = np.zeros((E, H, I), np.float32)
        q_ref = {"w13": np.zeros((E, 2 * I, H), np.uint8), "w2": np.zeros((E, H, I), np.uint8)}
        s_ref = {"w13": np.zeros((E, 2 * I, (H + 31) // 32), np.uint8),
                 "w2": np.zeros((E, H, (I + 31) // 32), np.uint8)}
        for e in range(E):
            names = expert_names(a.scheme, l, e)
            for role, (name, rows, k) in enumerate(zip(names, (I, I, H), (H, H, I))):
                x = (rng.uniform(-1, 1, (rows, k)) * np.sqrt(3.0 / k)).astype(np.float32)
                if a.mxfp8:
                    q, code = mxfp8_quantize(x)
                    tensors[name] = q
                    tensors[name + "_scale"] = code
                    ref = mxfp8_dequantize(q, code)
                    which = "w2" if role == 2 else "w13"
                    dst = q_ref[which][e] if role == 2 else \
                        q_ref[which][e, role * I:(role + 1) * I]
                    dst[...] = q.view(np.uint8)
                    sdst = s_ref[which][e] if role == 2 else \
                        s_ref[which][e, role * I:(role + 1) * I]
                    sdst[...] = code
                else:
                    stored = x.astype(dt)
                    tensors[name] = stored
                    ref = stored.astype(np.float32)
                if role == 2:
                    w2_ref[e] = ref
                else:
                    w13_ref[e, role * I:(role + 1) * I] = ref
        refdir = os.path.join(a.out, "reference")
        w13_ref.astype(ml_dtypes.bfloat16).tofile(os.path.join(refdir, f"layer{l}_w13.bf16.bin"))
        w2_ref.astype(ml_dtypes.bfloat16).tofile(os.path.join(refdir, f"layer{l}_w2.bf16.bin"))
        if a.mxfp8:
            for which in ("w13", "w2"):
                q_ref[which].tofile(os.path.join(refdir, f"layer{l}_{which}.q.bin"))
                s_ref[which].tofile(os.path.join(refdir, f"layer{l}_{which}.scale.bin"))
    tensors["model.norm.weight"] = np.ones(H, np.float32).astype(dt)
    tensors["lm_head.weight"] = small(VOCAB, H)

    # Corruptions that change what is written.
    if a.corrupt == "missing_expert":
        del tensors[victim]
    elif a.corrupt == "shape_mismatch":
        tensors[victim] = np.ascontiguousarray(tensors[victim].T)
    elif a.corrupt == "nan_weight":
        t = tensors[victim].copy()
        t[2, 3] = np.nan
        tensors[victim] = t
    elif a.corrupt == "f64_weight":
        tensors[victim] = tensors[victim].astype(np.float64)
    elif a.corrupt == "huge_weight":
        t = tensors[victim].copy()
        t.view(np.uint16)[2, 3] = 0x7F7F
        tensors[victim] = t
    elif a.corrupt == "mxfp8_overflow":
        if not a.mxfp8:
            raise SystemExit("--corrupt mxfp8_overflow needs --mxfp8")
        q = tensors[victim].copy()
        q.view(np.uint8)[2, :32] = 0  # the block's other values stay finite at that scale
        q.view(np.uint8)[2, 3] = 0x7E
        tensors[victim] = q
        code = tensors[victim + "_scale"].copy()
        code[2, 0] = 254
        tensors[victim + "_scale"] = code

    # Shards: consecutive tensors, about equal bytes each.
    names = list(tensors)
    shards = [[] for _ in range(a.shards)]
    total = sum(tensors[n].nbytes for n in names)
    acc = 0
    for n in names:
        shards[min(a.shards - 1, acc * a.shards // max(total, 1))].append(n)
        acc += tensors[n].nbytes
    files = {}
    metadata = {"format": "pt"}
    if a.shards == 1:
        save_file(tensors, os.path.join(a.out, "model.safetensors"), metadata=metadata)
        files = {n: "model.safetensors" for n in names}
    else:
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{a.shards:05d}.safetensors"
            save_file({n: tensors[n] for n in shard}, os.path.join(a.out, fname),
                      metadata=metadata)
            files.update({n: fname for n in shard})
        index = {"metadata": {"total_size": int(total)}, "weight_map": files}
        with open(os.path.join(a.out, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(make_config(a, moe), f, indent=2)

    # Corruptions of the file bytes.
    victim_file = files.get(victim, files[names[-1]])
    path = os.path.join(a.out, victim_file)
    # The tensor a loader's error should name: the one corrupted, except that truncation
    # breaks the file's last tensor, and a bad header length leaves no tensor to name.
    error_tensor = victim
    if a.corrupt == "truncated":
        header, _ = read_header(path)
        error_tensor = max((v["data_offsets"][1], k) for k, v in header.items()
                           if k != "__metadata__")[1]
    elif a.corrupt == "header_past_end":
        error_tensor = ""
    if a.corrupt == "truncated":
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            f.truncate(size - 7)
    elif a.corrupt == "header_past_end":
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            f.write(struct.pack("<Q", size))
    elif a.corrupt in ("offsets_past_end", "unknown_dtype"):
        header, data = read_header(path)
        if a.corrupt == "unknown_dtype":
            header[victim]["dtype"] = "Q7"
        else:
            b, e = header[victim]["data_offsets"]
            header[victim]["data_offsets"] = [b + len(data), e + len(data)]
        write_header(path, header, data)

    info = {"scheme": a.scheme, "dtype": "mxfp8" if a.mxfp8 else a.dtype, "shards": a.shards,
            "seed": a.seed, "num_layers": a.layers, "num_experts": E, "topk": a.topk,
            "hidden": H, "intermediate": I, "moe_layers": moe,
            "corrupt": a.corrupt or "", "victim_tensor": victim, "victim_file": victim_file,
            "victim_layer": victim_layer, "victim_expert": 1, "error_tensor": error_tensor}
    with open(os.path.join(a.out, "reference", "info.json"), "w") as f:
        json.dump(info, f, indent=2)
    return info


def parser():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="output directory (replaced)")
    p.add_argument("--suite", action="store_true",
                   help="write every checkpoint the tests use, in OUT/<name>")
    p.add_argument("--scheme", choices=SCHEMES, default="qwen3-moe")
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--dtype", choices=("bf16", "f16", "f32"), default="bf16")
    p.add_argument("--mxfp8", action="store_true", help="pre-quantized MXFP8 expert weights")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--hidden", type=int, default=80)
    p.add_argument("--intermediate", type=int, default=48)
    p.add_argument("--dense", type=int, default=1,
                   help="dense layers (deepseek-v3: first_k_dense_replace; qwen3-moe: the last "
                        "ones, in mlp_only_layers; mixtral: ignored)")
    p.add_argument("--corrupt", choices=CORRUPTIONS)
    # The router (mlp.gate), for server-side routing tests.
    p.add_argument("--gate-std", type=float, default=0.02,
                   help="standard deviation of the gate weights (1/sqrt(hidden) gives logits of "
                        "std about 1 for N(0, 1) hidden states)")
    p.add_argument("--no-gates", action="store_true", help="write no router gate tensors")
    p.add_argument("--norm-topk-prob", choices=("true", "false"),
                   help="config.json norm_topk_prob (qwen3-moe, deepseek-v3); default: absent")
    p.add_argument("--n-group", type=int, default=1, help="deepseek-v3 n_group")
    p.add_argument("--topk-group", type=int, default=1, help="deepseek-v3 topk_group")
    p.add_argument("--routed-scaling-factor", type=float,
                   help="deepseek-v3 routed_scaling_factor; default: absent")
    p.add_argument("--scoring-func", help="deepseek-v3 scoring_func; default: absent (sigmoid)")
    p.add_argument("--correction-bias", action="store_true",
                   help="write mlp.gate.e_score_correction_bias (F32 [experts]) per MoE layer")
    p.add_argument("--gate-corrupt", choices=("nan", "missing"),
                   help="the first MoE layer's gate has a NaN at [1, 2] / is not written")
    return p


# name -> options of the checkpoints tests/checkpoint reads.
SUITE = {
    "qwen3_bf16": ["--scheme", "qwen3-moe", "--seed", "1"],
    "qwen3_bf16_sharded": ["--scheme", "qwen3-moe", "--shards", "3", "--seed", "2"],
    "deepseek_bf16_sharded": ["--scheme", "deepseek-v3", "--shards", "4", "--seed", "3"],
    "deepseek_f32": ["--scheme", "deepseek-v3", "--dtype", "f32", "--seed", "4"],
    "deepseek_f16": ["--scheme", "deepseek-v3", "--dtype", "f16", "--seed", "10"],
    "mixtral_bf16": ["--scheme", "mixtral", "--layers", "2", "--seed", "5"],
    "mixtral_f32_sharded": ["--scheme", "mixtral", "--layers", "2", "--dtype", "f32",
                            "--shards", "2", "--seed", "6"],
    "qwen3_mxfp8": ["--scheme", "qwen3-moe", "--mxfp8", "--seed", "7"],
    "deepseek_mxfp8_sharded": ["--scheme", "deepseek-v3", "--mxfp8", "--shards", "2",
                               "--seed", "8"],
    **{f"corrupt_{c}": ["--scheme", "qwen3-moe", "--shards", "2", "--seed", "9", "--corrupt", c]
       for c in CORRUPTIONS if c != "mxfp8_overflow"},
    "corrupt_mxfp8_overflow": ["--scheme", "qwen3-moe", "--mxfp8", "--seed", "9", "--corrupt",
                               "mxfp8_overflow"],
    # Routers: DeepSeek-V3 with groups and the correction bias; broken gates.
    "deepseek_router": ["--scheme", "deepseek-v3", "--experts", "16", "--topk", "4",
                        "--n-group", "4", "--topk-group", "2", "--routed-scaling-factor", "2.5",
                        "--correction-bias", "--gate-std", "0.1", "--seed", "11"],
    "router_nan_gate": ["--scheme", "mixtral", "--layers", "2", "--gate-corrupt", "nan",
                        "--seed", "12"],
    "router_missing_gate": ["--scheme", "qwen3-moe", "--gate-corrupt", "missing",
                            "--seed", "13"],
    "router_no_gates": ["--scheme", "qwen3-moe", "--no-gates", "--seed", "14"],
}


def main(argv):
    a = parser().parse_args(argv)
    if not a.suite:
        info = build(a)
        print(f"wrote {a.out}: {info['scheme']} {info['dtype']} shards={info['shards']}"
              + (f" corrupt={info['corrupt']}" if info["corrupt"] else ""))
        return 0
    os.makedirs(a.out, exist_ok=True)
    for name, opts in SUITE.items():
        sub = parser().parse_args([os.path.join(a.out, name)] + opts)
        build(sub)
    with open(os.path.join(a.out, "suite.json"), "w") as f:
        json.dump(sorted(SUITE), f)
    print(f"wrote {len(SUITE)} checkpoints under {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
