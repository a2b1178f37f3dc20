"""Float64 NumPy references, written from the papers' formulas, independent of attnlab's code.

Scores (per head, q: (T_q, d), k: (T_k, d)):
    scaled_dot  q k^T / sqrt(d)         (Vaswani Eq. 1)
    dot         q k^T
    bilinear    q W k^T / sqrt(d)       (Luong; Michel §2.1)
    additive    w . tanh(q_i + k_j)     (Bahdanau; Li's slides)
Normalizers: softmax over allowed keys; hardmax = one-hot on the first argmax (Hahn §3 fn. 1).
A row with no allowed key gives zeros.
"""

from __future__ import annotations

import math

import numpy as np


def scores(kind: str, q: np.ndarray, k: np.ndarray, extra: np.ndarray | None = None) -> np.ndarray:
    d = q.shape[-1]
    if kind == "scaled_dot":
        return q @ k.T / math.sqrt(d)
    if kind == "dot":
        return q @ k.T
    if kind == "bilinear":
        return q @ extra @ k.T / math.sqrt(d)
    if kind == "additive":
        return np.tanh(q[:, None, :] + k[None, :, :]) @ extra
    raise ValueError(kind)


def normalize(kind: str, s: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """Row-wise weights (T_q, T_k) from scores and a bool ``allowed`` matrix."""
    weights = np.zeros_like(s, dtype=np.float64)
    for i in range(s.shape[0]):
        keys = np.flatnonzero(allowed[i])
        if keys.size == 0:
            continue
        row = s[i, keys]
        if kind == "softmax":
            e = np.exp(row - row.max())
            weights[i, keys] = e / e.sum()
        else:
            weights[i, keys[int(np.argmax(row))]] = 1.0  # np.argmax: first maximum
    return weights


def attention(q, k, v, allowed, *, score="scaled_dot", normalizer="softmax", extra=None):
    """Single-head attention in float64. Returns (output (T_q, d_v), weights (T_q, T_k))."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    allowed = np.broadcast_to(np.asarray(allowed, dtype=bool), (q.shape[0], k.shape[0]))
    w = normalize(normalizer, scores(score, q, k, None if extra is None else np.asarray(extra, np.float64)), allowed)
    return w @ v, w


def batched_attention(q, k, v, allowed, **kw):
    """Apply :func:`attention` over all leading dims of q, k, v (and broadcast ``allowed``)."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    lead = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    t_q, t_k = q.shape[-2], k.shape[-2]
    allowed = np.broadcast_to(np.asarray(allowed, dtype=bool), (*lead, t_q, t_k))
    q = np.broadcast_to(q, (*lead, *q.shape[-2:]))
    k = np.broadcast_to(k, (*lead, *k.shape[-2:]))
    v = np.broadcast_to(v, (*lead, *v.shape[-2:]))
    out = np.zeros((*lead, t_q, v.shape[-1]))
    weights = np.zeros((*lead, t_q, t_k))
    for index in np.ndindex(*lead):
        out[index], weights[index] = attention(q[index], k[index], v[index], allowed[index], **kw)
    return out, weights


def multi_head(module, query, key=None, allowed=None, head_mask=None):
    """Michel §2.2-2.3: sum_h xi_h W_o^h Att_h, from the module's weights, in float64.

    query: (T_q, d_model); key: (T_k, d_model) or None (self-attention); returns (T_q, d_model).
    """
    params = {name: p.detach().double().numpy() for name, p in module.named_parameters()}
    h, d_k, d_v = module.heads, module.d_k, module.d_v
    w_in, b_in = params["in_proj_weight"], params.get("in_proj_bias", np.zeros(params["in_proj_weight"].shape[0]))
    w_q, w_k, w_v = np.split(w_in, [h * d_k, 2 * h * d_k])
    b_q, b_k, b_v = np.split(b_in, [h * d_k, 2 * h * d_k])
    x = np.asarray(query, np.float64)
    mem = x if key is None else np.asarray(key, np.float64)
    allowed = np.ones((x.shape[0], mem.shape[0]), bool) if allowed is None else allowed
    w_o = params["out_proj.weight"]
    out = np.zeros((x.shape[0], module.d_model)) + params.get("out_proj.bias", 0.0)
    score = {
        "ScaledDotScore": "scaled_dot",
        "DotScore": "dot",
        "BilinearScore": "bilinear",
        "AdditiveScore": "additive",
    }[type(module.score).__name__]
    for i in range(h):
        qi = x @ w_q[i * d_k : (i + 1) * d_k].T + b_q[i * d_k : (i + 1) * d_k]
        ki = mem @ w_k[i * d_k : (i + 1) * d_k].T + b_k[i * d_k : (i + 1) * d_k]
        vi = mem @ w_v[i * d_v : (i + 1) * d_v].T + b_v[i * d_v : (i + 1) * d_v]
        extra = params["score.weight"][i] if "score.weight" in params else None
        head, _ = attention(qi, ki, vi, allowed, score=score, normalizer=module.normalizer, extra=extra)
        xi = 1.0 if head_mask is None else float(head_mask[i])
        out += xi * head @ w_o[:, i * d_v : (i + 1) * d_v].T
    return out
