"""Which heads a multi-head attention has and keeps: the cap on heads, grouped-query attention's
query -> key/value head map, and the state of a module restricted to some of its heads (Michel §2.3:
a module with heads pruned computes what the full one computes with their xi_h = 0). ``attention``
below is a :class:`attnlab.nn.multi_head.MultiHeadAttention` (which imports this module).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnlab.errors import ConfigError
from attnlab.limits import MAX_HEADS, describe_int

__all__ = ["check_heads_cap", "uniform_kv_index", "check_kv_index", "head_subset_state", "kept_kv_index"]


def check_heads_cap(name: str, value: int | None) -> None:
    """Refuse more than :data:`attnlab.limits.MAX_HEADS` heads before anything is built per head.

    Raises:
        ConfigError: ``value`` is above the cap; names ``name``.
    """
    if value is not None and value > MAX_HEADS:
        raise ConfigError(
            f"{name}: {describe_int(value)} heads, more than the cap of {MAX_HEADS:,} (attnlab.limits.MAX_HEADS)"
        )


def uniform_kv_index(heads: int, kv_heads: int) -> list[int]:
    """The query -> key/value head map of grouped-query attention: h -> h // (heads / kv_heads)."""
    return [h // (heads // kv_heads) for h in range(heads)] if kv_heads else []


def check_kv_index(kv_index: list[int], heads: int) -> int:
    """The number of key/value heads of an explicit map; every one must serve some query head."""
    if len(kv_index) != heads or any(not isinstance(j, int) or j < 0 for j in kv_index):
        raise ValueError(f"kv_index: expected {heads} key/value head indices >= 0, got {kv_index}")
    kv_heads = max(kv_index, default=-1) + 1
    if set(kv_index) != set(range(kv_heads)):
        raise ValueError(f"kv_index: every key/value head 0..{kv_heads - 1} must serve a query head, got {kv_index}")
    return kv_heads


def head_subset_state(attention: Any, keep: list[int]) -> dict[str, Tensor]:
    """The state dict of ``attention`` restricted to heads ``keep`` (in that order): the rows of
    W^Q, W^K, W^V and the columns of W^O that belong to them, their score parameters, and the
    q/k norms' gains (for ``qk_norm = "full"``, the kept heads' entries of them).

    Load it into a ``MultiHeadAttention`` built with ``heads=len(keep)``, the same d_k, d_v and
    ``kv_index=kept_kv_index(attention, keep)``: its output equals ``attention``'s with every other
    head masked (Michel §2.3). With grouped-query attention a key/value head's rows of W^K and
    W^V stay while any query head of its group is kept, and go with the last one.
    """
    if sorted(set(keep)) != sorted(keep) or any(not 0 <= h < attention.heads for h in keep):
        raise ValueError(f"keep: head indices must be distinct and in [0, {attention.heads}), got {keep}")
    kv_keep = _kept_kv_heads(attention, keep)
    d_k, d_v = attention.d_k, attention.d_v
    qk, kv_k = attention.heads * d_k, attention.kv_heads * d_k
    q_rows = [h * d_k + i for h in keep for i in range(d_k)]
    k_rows = [qk + j * d_k + i for j in kv_keep for i in range(d_k)]
    v_rows = [qk + kv_k + j * d_v + i for j in kv_keep for i in range(d_v)]
    rows = torch.tensor(q_rows + k_rows + v_rows, dtype=torch.long)
    columns = torch.tensor([h * d_v + i for h in keep for i in range(d_v)], dtype=torch.long)
    index = torch.tensor(keep, dtype=torch.long)
    state = {
        "in_proj_weight": attention.in_proj_weight.detach()[rows],
        "out_proj.weight": attention.out_proj.weight.detach()[:, columns],
    }
    if attention.in_proj_bias is not None:
        state["in_proj_bias"] = attention.in_proj_bias.detach()[rows]
    if attention.out_proj.bias is not None:
        state["out_proj.bias"] = attention.out_proj.bias.detach().clone()
    q_norm_rows = torch.tensor(q_rows, dtype=torch.long)
    k_norm_rows = torch.tensor([j * d_k + i for j in kv_keep for i in range(d_k)], dtype=torch.long)
    for name, norm, norm_rows in (("q_norm", attention.q_norm, q_norm_rows), ("k_norm", attention.k_norm, k_norm_rows)):
        for key, parameter in [] if norm is None else norm.named_parameters():  # a whole norm: its heads' rows
            state[f"{name}.{key}"] = attention.qk_norm.subset(parameter, norm_rows)
    for name, parameter in attention.score.named_parameters():  # score parameters: head axis first
        state[f"score.{name}"] = parameter.detach()[index]
    if attention.position_bias is not None:  # ALiBi's slopes per head; Shaw's tables shared by all
        for name, tensor in attention.position_bias.head_subset_state(index).items():
            state[f"position_bias.{name}"] = tensor
    return state


def _kept_kv_heads(attention: Any, keep: list[int]) -> list[int]:
    """The key/value heads that some query head of ``keep`` reads, in their order."""
    return sorted({attention.kv_index[h] for h in keep})


def kept_kv_index(attention: Any, keep: list[int]) -> list[int]:
    """The query -> key/value head map of the module :func:`head_subset_state` describes: kept
    query head i reads the kept key/value head that ``keep[i]`` read, renumbered."""
    kv_keep = _kept_kv_heads(attention, keep)
    return [kv_keep.index(attention.kv_index[h]) for h in keep]
