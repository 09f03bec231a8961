"""numpy reference for checking Forward answers from the client side.

For every token t:  out[t] = sum_k w[t, k] * w2_e @ (silu(gate_e @ x_t) * (up_e @ x_t)),
e = topk_ids[t, k], where w13_e [2I, H] holds gate rows [0, I) then up rows [I, 2I) and
w2_e is [H, I], exactly as GetExpertWeights returns them. Computed in float64.
"""

import numpy as np


def reference_forward(hidden, topk_ids, topk_weights, experts):
    """hidden [M, H] float, topk_ids / topk_weights [M, K], experts {id: (w13, w2)} float.

    Negative ids are unrouted slots and skipped. Returns [M, H] float64.
    """
    x = np.asarray(hidden, dtype=np.float64)
    ids = np.asarray(topk_ids)
    w = np.asarray(topk_weights, dtype=np.float64)
    out = np.zeros_like(x)
    for e in np.unique(ids):
        if e < 0:
            continue
        if int(e) not in experts:
            raise KeyError(f"no weights for expert {int(e)}")
        w13, w2 = (np.asarray(a, dtype=np.float64) for a in experts[int(e)])
        inter = w13.shape[0] // 2
        tokens, slots = np.nonzero(ids == e)
        xs = x[tokens]
        gate = xs @ w13[:inter].T
        up = xs @ w13[inter:].T
        act = gate / (1.0 + np.exp(-gate)) * up
        y = act @ w2.T
        np.add.at(out, tokens, w[tokens, slots][:, None] * y)
    return out


def relative_l2_error(actual, expected):
    """||actual - expected|| / ||expected|| in float64."""
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    norm = np.linalg.norm(e)
    diff = np.linalg.norm(a - e)
    if norm == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return float(diff / norm)


def random_inputs(num_tokens, hidden, num_experts, topk, seed=0):
    """hidden ~ N(0, 1) float32 [M, H]; per token `topk` distinct uniform experts (int32);
    weights = softmax of N(0, 1) logits (float32)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((num_tokens, hidden), dtype=np.float32)
    ids = np.stack([rng.choice(num_experts, size=topk, replace=False)
                    for _ in range(num_tokens)]).astype(np.int32).reshape(num_tokens, topk)
    logits = rng.standard_normal((num_tokens, topk))
    weights = np.exp(logits - logits.max(axis=1, keepdims=True))
    weights = (weights / weights.sum(axis=1, keepdims=True)).astype(np.float32)
    return x, ids, weights
