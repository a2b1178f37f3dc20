"""Positional encodings: how a position p_i joins a token vector v_i.

Self-attention alone is permutation-equivariant (Li's slides, "Permutation equivariant"; Agarwal
§6.3), so order has to be injected into the input. Hahn §3 writes Layer 0 as

    y_i^(0) = f(v_i, p_i)              "combined (e.g., via addition or concatenation)"

Every encoding here is a module with that signature: ``forward(x, offset)`` maps the token vectors
x = (v_1, ..., v_T) of width ``token_dim`` to y^(0) of width ``d_model``. The registry
:data:`POSITIONAL` holds:

* ``sinusoidal``: p_{n,2i} = sin(n / 10000^{2i/d}), p_{n,2i+1} = cos(n / 10000^{2i/d})
  (Vaswani §3.5; Li's slides; Agarwal §6.3), added or concatenated;
* ``learned``: one trained vector per absolute position (Li's slides: "can either be learned"),
  added or concatenated;
* ``none``: y^(0) = v, for the permutation-equivariance experiments;
* ``gehring_joint``: z_n = ReLU(x_n W_x + e_n W_e) W_z, with e_n the one-hot position (Agarwal §6.3,
  first approach of Gehring et al.);
* ``gehring_sum``: z_n = ReLU(x_n W_x) W_zx + ReLU(e_n W_e) W_ze (Agarwal §6.3, second approach).

e_n W_e is row n of W_e, so the one-hot vector is never built: it is an embedding lookup.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

__all__ = [
    "PositionalEncoding",
    "SinusoidalTable",
    "LearnedTable",
    "AddPositions",
    "ConcatPositions",
    "NoPositions",
    "GehringJoint",
    "GehringSum",
    "POSITIONAL",
    "COMBINES",
    "make_positional",
    "sinusoidal_table",
]


def sinusoidal_table(
    length: int,
    dim: int,
    *,
    offset: int = 0,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """P[n, 2i] = sin(n / 10000^{2i/dim}), P[n, 2i+1] = cos(n / 10000^{2i/dim}), n = offset..offset+length-1.

    Computed in float64 and rounded once to ``dtype``.

    Shape:
        returns (length, dim).
    """
    position = torch.arange(offset, offset + length, dtype=torch.float64, device=device).unsqueeze(1)  # (T, 1)
    even = torch.arange(0, dim, 2, dtype=torch.float64, device=device)  # 2i
    angle = position / torch.pow(10000.0, even / dim)  # (T, ceil(dim/2))
    table = torch.zeros(length, dim, dtype=torch.float64, device=device)
    table[:, 0::2] = torch.sin(angle)
    table[:, 1::2] = torch.cos(angle[:, : dim // 2])
    return table.to(dtype)


class PositionalEncoding(nn.Module):
    """Interface: ``forward(x, offset=0)`` with x (B, T, token_dim) -> (B, T, d_model).

    ``offset`` is the absolute position of x[:, 0] (non-zero when decoding with a KV cache).
    """

    token_dim: int
    d_model: int


class SinusoidalTable(nn.Module):
    """The fixed sinusoidal table; computed from the formula past ``max_len`` (it extrapolates)."""

    def __init__(self, dim: int, max_len: int) -> None:
        super().__init__()
        self.dim, self.max_len = dim, max_len
        self.register_buffer("table", sinusoidal_table(max_len, dim), persistent=False)  # (max_len, dim)

    def forward(self, length: int, offset: int = 0) -> Tensor:
        if offset + length <= self.max_len:
            return self.table[offset : offset + length]
        return sinusoidal_table(length, self.dim, offset=offset, device=self.table.device, dtype=self.table.dtype)

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 (nn.Module's signature)
        # `.double()`, `.half()` and `.to(...)` cast the stored table; recompute it from the formula
        # in its new dtype, so a float64 model has float64-accurate positions, not widened float32.
        super()._apply(fn, recurse)
        self.table = sinusoidal_table(self.max_len, self.dim, device=self.table.device, dtype=self.table.dtype)
        return self


class LearnedTable(nn.Module):
    """A trained vector per absolute position 0..max_len-1."""

    def __init__(self, dim: int, max_len: int) -> None:
        super().__init__()
        self.dim, self.max_len = dim, max_len
        self.weight = nn.Parameter(torch.randn(max_len, dim) * 0.02)  # (max_len, dim)

    def forward(self, length: int, offset: int = 0) -> Tensor:
        _check_length(offset + length, self.max_len, "learned positions")
        return self.weight[offset : offset + length]


class AddPositions(PositionalEncoding):
    """f(v_i, p_i) = v_i + p_i (Vaswani §3.5; Li's slides: "word embedding(x_t) + PE(t)")."""

    def __init__(self, table: nn.Module, d_model: int) -> None:
        super().__init__()
        self.table, self.token_dim, self.d_model = table, d_model, d_model

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        return x + self.table(x.shape[1], offset).to(x.dtype)


class ConcatPositions(PositionalEncoding):
    """f(v_i, p_i) = [v_i; p_i] (Hahn §3): token_dim + positional width = d_model."""

    def __init__(self, table: nn.Module, d_model: int, positional_dim: int) -> None:
        super().__init__()
        self.table, self.d_model, self.token_dim = table, d_model, d_model - positional_dim

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        batch, length, _ = x.shape
        positions = self.table(length, offset).to(x.dtype).expand(batch, length, -1)  # (B, T, d_pos)
        return torch.cat([x, positions], dim=-1)


class NoPositions(PositionalEncoding):
    """f(v_i, p_i) = v_i: no order information at all."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.token_dim = self.d_model = d_model

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        return x


class GehringJoint(PositionalEncoding):
    """z_n = ReLU(x_n W_x + e_n W_e) W_z  (Agarwal §6.3, after Gehring et al.).

    Attributes:
        w_x: Linear(d_model -> k);  w_e: Embedding(max_len, k), row n = e_n W_e;  w_z: Linear(k -> d_model).
    """

    def __init__(self, d_model: int, max_len: int, hidden: int) -> None:
        super().__init__()
        self.token_dim = self.d_model = d_model
        self.max_len = max_len
        self.w_x = nn.Linear(d_model, hidden, bias=False)
        self.w_e = nn.Embedding(max_len, hidden)
        self.w_z = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        positions = _positions(x, offset, self.max_len)
        return self.w_z(torch.relu(self.w_x(x) + self.w_e(positions)))


class GehringSum(PositionalEncoding):
    """z_n = ReLU(x_n W_x) W_zx + ReLU(e_n W_e) W_ze  (Agarwal §6.3, after Gehring et al.)."""

    def __init__(self, d_model: int, max_len: int, hidden: int) -> None:
        super().__init__()
        self.token_dim = self.d_model = d_model
        self.max_len = max_len
        self.w_x = nn.Linear(d_model, hidden, bias=False)
        self.w_zx = nn.Linear(hidden, d_model, bias=False)
        self.w_e = nn.Embedding(max_len, hidden)
        self.w_ze = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        positions = _positions(x, offset, self.max_len)
        return self.w_zx(torch.relu(self.w_x(x))) + self.w_ze(torch.relu(self.w_e(positions)))


def _check_length(needed: int, max_len: int, what: str) -> None:
    if needed > max_len:
        raise ValueError(f"sequence of length {needed} exceeds max_len={max_len} of the {what}")


def _positions(x: Tensor, offset: int, max_len: int) -> Tensor:
    _check_length(offset + x.shape[1], max_len, "one-hot positions")
    return torch.arange(offset, offset + x.shape[1], device=x.device)  # (T,)


def _table_encoding(table_cls: type[nn.Module]) -> Callable[..., PositionalEncoding]:
    def build(*, d_model: int, max_len: int, combine: str, positional_dim: int, hidden: int) -> PositionalEncoding:
        if combine == "add":
            return AddPositions(table_cls(d_model, max_len), d_model)
        return ConcatPositions(table_cls(positional_dim, max_len), d_model, positional_dim)

    return build


POSITIONAL: dict[str, Callable[..., PositionalEncoding]] = {
    "sinusoidal": _table_encoding(SinusoidalTable),
    "learned": _table_encoding(LearnedTable),
    "none": lambda *, d_model, **_: NoPositions(d_model),
    # Rotary positions act inside attention, on queries and keys (attnlab.nn.rotary): none here.
    "rope": lambda *, d_model, **_: NoPositions(d_model),
    "gehring_joint": lambda *, d_model, max_len, hidden, **_: GehringJoint(d_model, max_len, hidden),
    "gehring_sum": lambda *, d_model, max_len, hidden, **_: GehringSum(d_model, max_len, hidden),
}
"""Registry of positional encodings: name -> builder taking the keywords of :func:`make_positional`."""

COMBINES = ("add", "concat")
"""How ``sinusoidal`` and ``learned`` positions join the token vector (Hahn §3)."""


def make_positional(
    name: str,
    *,
    d_model: int,
    max_len: int,
    combine: str = "add",
    positional_dim: int | None = None,
    hidden: int | None = None,
) -> PositionalEncoding:
    """Build the encoding ``name`` of :data:`POSITIONAL`.

    Args:
        combine: ``add`` or ``concat`` (only ``sinusoidal`` and ``learned`` use it).
        positional_dim: width of p_i when concatenating; default d_model // 2.
        hidden: width k of the Gehring hidden layer; default d_model.
    """
    if name not in POSITIONAL:
        raise ValueError(f"positional: unknown {name!r}; allowed: {', '.join(sorted(POSITIONAL))}")
    if combine not in COMBINES:
        raise ValueError(f"positional_combine: unknown {combine!r}; allowed: {', '.join(COMBINES)}")
    positional_dim = d_model // 2 if positional_dim is None else positional_dim
    if combine == "concat" and not 0 < positional_dim < d_model:
        raise ValueError(f"positional_dim must lie in (0, d_model={d_model}) to concatenate, got {positional_dim}")
    return POSITIONAL[name](
        d_model=d_model,
        max_len=max_len,
        combine=combine,
        positional_dim=positional_dim,
        hidden=d_model if hidden is None else hidden,
    )
