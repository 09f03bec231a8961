#!/usr/bin/env python3
"""Server-side routing on real checkpoint layouts, against an independent numpy router.

For a Mixtral-like, two Qwen3-MoE-like (norm_topk_prob true / false) and a DeepSeek-V3-like
checkpoint (sigmoid scores, e_score_correction_bias, 4 groups keeping 2, routed_scaling_factor
2.5), written by scripts/make_test_checkpoint.py with the `safetensors` package, this starts the
real server on each, calls Forward without topk_ids / topk_weights and with return_routing, and
checks:
  * the chosen ids equal numpy's (computed here in float64 from the gate tensors read back with
    safetensors.numpy and the semantics of each model's Hugging Face implementation),
  * the weights match within 1e-4 relative (the server computes the gate in FP32),
  * the output matches a numpy forward of the checkpoint's experts with numpy's routing (relative
    L2 < 1e-2: BF16 hidden states and output),
  * calling again with the returned routing sent by the client answers the same bytes.
And the refusals: only one of topk_ids / topk_weights (INVALID_ARGUMENT), a dense layer
(INVALID_ARGUMENT), a checkpoint without gates (ModelInfo.server_routing false,
FAILED_PRECONDITION).

Inputs are random (N(0, 1) hidden states, gates of std 1/sqrt(hidden)), so exact ties are
improbable; a token whose top-k (or kept-group) boundary is closer than 1e-4 in numpy is left out
of the id comparison (at most 2 per layer allowed; typically none).

  server_routing_test.py --server BUILD/bin/moeserve --cli BUILD/bin/moeserve-cli --source-dir REPO
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file

HIDDEN = 80
TOKENS = 64
MARGIN = 1e-4

CASES = [
    ("mixtral", ["--scheme", "mixtral", "--layers", "2", "--experts", "8", "--topk", "2",
                 "--seed", "21"]),
    ("qwen3_norm", ["--scheme", "qwen3-moe", "--layers", "3", "--experts", "12", "--topk", "3",
                    "--norm-topk-prob", "true", "--seed", "22"]),
    ("qwen3_no_norm", ["--scheme", "qwen3-moe", "--layers", "2", "--experts", "12", "--topk",
                       "3", "--norm-topk-prob", "false", "--seed", "23"]),
    ("deepseek_v3", ["--scheme", "deepseek-v3", "--layers", "3", "--experts", "16", "--topk",
                     "4", "--n-group", "4", "--topk-group", "2", "--routed-scaling-factor",
                     "2.5", "--correction-bias", "--seed", "24"]),
]


def log(msg):
    print(f"[server_routing] {msg}", flush=True)


def model_routing(config):
    """The routing of a Hugging Face config.json, read here independently of the server."""
    t = config["model_type"]
    if t == "mixtral":
        return dict(scoring="softmax", renormalize=True, n_group=1, topk_group=1, scale=1.0)
    if t in ("qwen2_moe", "qwen3_moe"):
        return dict(scoring="softmax", renormalize=config.get("norm_topk_prob", False),
                    n_group=1, topk_group=1, scale=1.0)
    if t == "deepseek_v3":
        return dict(scoring=config.get("scoring_func", "sigmoid"),
                    renormalize=config.get("norm_topk_prob", True),
                    n_group=config.get("n_group", 8), topk_group=config.get("topk_group", 4),
                    scale=config.get("routed_scaling_factor", 2.5))
    raise ValueError(t)


def numpy_route(x, gate, bias, topk, r):
    """x [M, H], gate [E, H], bias [E] or None, float64. Returns ids [M, K], weights [M, K] and
    each token's decision margin (the smallest gap at a top-k or kept-group boundary)."""
    logits = x @ gate.T
    if r["scoring"] == "softmax":
        z = np.exp(logits - logits.max(axis=1, keepdims=True))
        scores = z / z.sum(axis=1, keepdims=True)
    else:
        scores = 1.0 / (1.0 + np.exp(-logits))
    choice = scores + bias if bias is not None else scores.copy()
    m, e = choice.shape
    margin = np.full(m, np.inf)
    if r["n_group"] > 1:
        per = e // r["n_group"]
        grouped = choice.reshape(m, r["n_group"], per)
        group_score = np.sort(grouped, axis=2)[:, :, -2:].sum(axis=2)  # top-2 sum per group
        order = np.argsort(-group_score, axis=1, kind="stable")
        kept = order[:, :r["topk_group"]]
        sorted_gs = np.take_along_axis(group_score, order, axis=1)
        margin = np.minimum(margin, sorted_gs[:, r["topk_group"] - 1] -
                            sorted_gs[:, r["topk_group"]])
        mask = np.zeros((m, r["n_group"]), bool)
        np.put_along_axis(mask, kept, True, axis=1)
        choice = np.where(np.repeat(mask, per, axis=1), choice, -np.inf)
    order = np.argsort(-choice, axis=1, kind="stable")
    ids = order[:, :topk]
    sorted_choice = np.take_along_axis(choice, order, axis=1)
    margin = np.minimum(margin, sorted_choice[:, topk - 1] - sorted_choice[:, topk])
    weights = np.take_along_axis(scores, ids, axis=1)
    if r["renormalize"]:
        weights = weights / weights.sum(axis=1, keepdims=True)
    return ids, weights * r["scale"], margin


def gate_names(config, layer):
    if config["model_type"] == "mixtral":
        return f"model.layers.{layer}.block_sparse_moe.gate.weight", None
    p = f"model.layers.{layer}.mlp.gate."
    return p + "weight", p + "e_score_correction_bias"


def load_tensors(ckpt):
    tensors = {}
    for name in os.listdir(ckpt):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(ckpt, name)))
    return tensors


def experts_of(ckpt, info, layer):
    e, h, i = info["num_experts"], info["hidden"], info["intermediate"]
    ref = os.path.join(ckpt, "reference")
    w13 = np.fromfile(os.path.join(ref, f"layer{layer}_w13.bf16.bin"), ml_dtypes.bfloat16)
    w2 = np.fromfile(os.path.join(ref, f"layer{layer}_w2.bf16.bin"), ml_dtypes.bfloat16)
    w13 = w13.astype(np.float32).reshape(e, 2 * i, h)
    w2 = w2.astype(np.float32).reshape(e, h, i)
    return {x: (w13[x], w2[x]) for x in range(e)}


def check(cond, msg):
    if not cond:
        raise AssertionError(msg)


def run_case(name, opts, args, workdir, mc, grpc, Server, Cli):
    ckpt = os.path.join(workdir, name)
    subprocess.run([sys.executable, os.path.join(args.source_dir, "scripts",
                                                  "make_test_checkpoint.py"), ckpt,
                    "--hidden", str(HIDDEN), "--gate-std", str(1 / np.sqrt(HIDDEN))] + opts,
                   check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(ckpt, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(ckpt, "reference", "info.json")) as f:
        info = json.load(f)
    routing = model_routing(config)
    tensors = load_tensors(ckpt)
    cli = Cli(args.cli)
    rundir = os.path.join(workdir, name + "_run")
    os.makedirs(rundir)
    with Server(args.server, rundir, ["--checkpoint", ckpt]) as server:
        server.wait_ready(cli)
        with mc.MoeClient(server.target) as client:
            minfo = client.info()
            check(minfo.server_routing, f"{name}: ModelInfo.server_routing is false")
            log(f"{name}: router {minfo.router!r}")
            rng = np.random.default_rng(len(name))
            for layer in info["moe_layers"]:
                x = rng.standard_normal((TOKENS, HIDDEN)).astype(ml_dtypes.bfloat16)
                res = client.forward_full(x, layer=layer, return_routing=True)
                gname, bname = gate_names(config, layer)
                gate = tensors[gname].astype(np.float64)
                bias = tensors[bname].astype(np.float64) if bname in tensors else None
                ids, weights, margin = numpy_route(x.astype(np.float64), gate, bias,
                                                   info["topk"], routing)
                clear = margin > MARGIN
                check((~clear).sum() <= 2, f"{name} layer {layer}: {(~clear).sum()} near ties")
                check(res.topk_ids.shape == ids.shape and res.topk_ids.dtype == np.int32,
                      f"topk_ids {res.topk_ids.dtype} {res.topk_ids.shape}")
                bad = np.nonzero((res.topk_ids != ids).any(axis=1) & clear)[0]
                check(len(bad) == 0, f"{name} layer {layer}: ids differ for tokens {bad[:5]}: "
                      f"server {res.topk_ids[bad[:2]]} numpy {ids[bad[:2]]}")
                np.testing.assert_allclose(res.topk_weights[clear], weights[clear], rtol=1e-4,
                                           atol=1e-6, err_msg=f"{name} layer {layer} weights")
                expected = mc.reference_forward(x.astype(np.float32), ids, weights,
                                                experts_of(ckpt, info, layer))
                err = mc.relative_l2_error(res.output.astype(np.float32)[clear],
                                           expected[clear])
                check(err < 1e-2, f"{name} layer {layer}: output relative L2 {err}")
                again = client.forward(x, res.topk_ids, res.topk_weights, layer=layer)
                check(np.array_equal(again.view(np.uint16), res.output.view(np.uint16)),
                      f"{name} layer {layer}: client-routed answer differs")
                log(f"{name} layer {layer}: ids equal on {clear.sum()}/{TOKENS} tokens, "
                    f"output relative L2 {err:.2e}, route_us {res.timings['route_us']:.0f}")
            # FP32 hidden states route too (their own values, not rounded).
            layer = info["moe_layers"][-1]
            x32 = rng.standard_normal((5, HIDDEN)).astype(np.float32)
            res = client.forward_full(x32, layer=layer, return_routing=True)
            gname, bname = gate_names(config, layer)
            ids, _, margin = numpy_route(x32.astype(np.float64),
                                         tensors[gname].astype(np.float64),
                                         tensors[bname].astype(np.float64)
                                         if bname in tensors else None,
                                         info["topk"], routing)
            check(np.array_equal(res.topk_ids[margin > MARGIN], ids[margin > MARGIN]),
                  f"{name}: fp32 ids differ")
            # Refusals.
            x = rng.standard_normal((2, HIDDEN)).astype(np.float32)
            try:
                client._stub.Forward(mc.client.pb.ForwardRequest(
                    layer=layer, hidden_states=mc.client._tensor(x, 3, np.dtype("<f4")),
                    topk_ids=mc.client._tensor(np.zeros((2, info["topk"]), np.int32), 4,
                                               np.dtype("<i4"))))
                check(False, "only topk_ids was accepted")
            except grpc.RpcError as e:
                check(e.code() == grpc.StatusCode.INVALID_ARGUMENT and
                      "topk_weights" in e.details(), f"only topk_ids: {e.code()} {e.details()}")
            dense = [l for l in range(info["num_layers"]) if l not in info["moe_layers"]]
            if dense:
                try:
                    client.forward(x, layer=dense[0])
                    check(False, "dense layer accepted")
                except grpc.RpcError as e:
                    check(e.code() == grpc.StatusCode.INVALID_ARGUMENT and "dense" in e.details(),
                          f"dense layer: {e.code()} {e.details()}")
        server.terminate_and_check(30)


def run_no_gates(args, workdir, mc, grpc, Server, Cli):
    ckpt = os.path.join(workdir, "no_gates")
    subprocess.run([sys.executable, os.path.join(args.source_dir, "scripts",
                                                  "make_test_checkpoint.py"), ckpt,
                    "--scheme", "qwen3-moe", "--layers", "2", "--no-gates", "--seed", "25"],
                   check=True, stdout=subprocess.DEVNULL)
    cli = Cli(args.cli)
    rundir = os.path.join(workdir, "no_gates_run")
    os.makedirs(rundir)
    with Server(args.server, rundir, ["--checkpoint", ckpt]) as server:
        server.wait_ready(cli)
        with mc.MoeClient(server.target) as client:
            minfo = client.info()
            check(not minfo.server_routing and minfo.router == "", f"no gates: {minfo.router!r}")
            x = np.ones((2, minfo.hidden), np.float32)
            try:
                client.forward(x, layer=0)
                check(False, "server routing without gates was accepted")
            except grpc.RpcError as e:
                check(e.code() == grpc.StatusCode.FAILED_PRECONDITION and
                      "no router gates" in e.details(), f"no gates: {e.code()} {e.details()}")
                log(f"no gates: FAILED_PRECONDITION: {e.details()}")
        server.terminate_and_check(30)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server", required=True)
    p.add_argument("--cli", required=True)
    p.add_argument("--source-dir", required=True)
    args = p.parse_args()
    sys.path.insert(0, os.path.join(args.source_dir, "tests", "integration"))
    sys.path.insert(0, os.path.join(args.source_dir, "clients", "python"))
    import grpc
    import moeserve_client as mc
    import moeserve_client.client  # noqa: F401  (mc.client below)
    from run_integration import Cli, Server
    with tempfile.TemporaryDirectory(prefix="moeserve_routing_") as workdir:
        for name, opts in CASES:
            run_case(name, opts, args, workdir, mc, grpc, Server, Cli)
        run_no_gates(args, workdir, mc, grpc, Server, Cli)
    print("server_routing: 5 passed, 0 failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
