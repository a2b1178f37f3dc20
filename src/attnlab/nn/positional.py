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

``rope``, ``alibi`` and ``relative`` act inside attention (:mod:`attnlab.nn.rotary`,
:mod:`attnlab.nn.position_bias`); here they are ``none``.

Every encoding also takes explicit per-row positions, ``forward(x, offset, positions)`` with
positions (B, T): the randomized positions of Ruoss et al. 2023 (:func:`randomized_positions`),
an ordered random subset of [0, M) per training sequence instead of 0..T-1.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch
from torch import Tensor, nn

from attnlab.errors import AttnlabWarning  # a leaf module: importing it keeps nn's imports pointing down

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
    "randomized_positions",
    "RANDOMIZABLE",
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

    def at(self, positions: Tensor) -> Tensor:
        """The rows at ``positions`` (B, T) -> (B, T, dim); from the formula past ``max_len``."""
        top = int(positions.max()) + 1 if positions.numel() else 0
        if top <= self.max_len:
            return self.table[positions]
        table = sinusoidal_table(top, self.dim, device=self.table.device, dtype=self.table.dtype)
        return table[positions]

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 (nn.Module's signature)
        # `.double()`, `.half()` and `.to(...)` cast the stored table; recompute it from the formula
        # in its new dtype, so a float64 model has float64-accurate positions, not widened float32.
        super()._apply(fn, recurse)
        self.table = sinusoidal_table(self.max_len, self.dim, device=self.table.device, dtype=self.table.dtype)
        return self


class LearnedTable(nn.Module):
    """A trained vector per absolute position 0..max_len-1, and a record of how many were trained.

    A row that no training sequence reached keeps its random initialisation, so a model trained on
    lengths <= L and evaluated at L+1..2L reads noise there. The table therefore records, in the
    persistent buffer ``trained_positions`` (saved with the weights), the longest prefix of
    positions its training forward passes used; evaluating past it warns once per table with an
    :class:`attnlab.errors.AttnlabWarning` that names the untrained positions (1-based, as lengths
    are counted). Positions past ``max_len`` are an error, as before. Weights saved before the
    record existed load with it 0: unknown, no warning.

    Attributes:
        weight: (max_len, dim).
        trained_positions: () int64, the largest position count seen in training (0: unknown).
    """

    optional_state = ("trained_positions",)
    """State that older weights lack: loaded as 0 when missing (:func:`attnlab.nn.optional_state_keys`)."""

    def __init__(self, dim: int, max_len: int) -> None:
        super().__init__()
        self.dim, self.max_len = dim, max_len
        self.weight = nn.Parameter(torch.randn(max_len, dim) * 0.02)  # (max_len, dim)
        self.reset_buffers()
        self._warned = False

    def reset_buffers(self) -> None:
        """An empty record (0: unknown); loading weights that have one replaces it."""
        self.register_buffer("trained_positions", torch.zeros((), dtype=torch.long))

    def forward(self, length: int, offset: int = 0) -> Tensor:
        _check_length(offset + length, self.max_len, "learned positions")
        self._note(offset + length)
        return self.weight[offset : offset + length]

    def at(self, positions: Tensor) -> Tensor:
        """The rows at ``positions`` (B, T) -> (B, T, dim)."""
        top = int(positions.max()) + 1 if positions.numel() else 0
        _check_length(top, self.max_len, "learned positions")
        self._note(top)
        return self.weight[positions]

    def _note(self, needed: int) -> None:
        """Training: extend the record to ``needed`` positions. Evaluation: warn once past it."""
        if self.training:
            self.trained_positions.clamp_(min=needed)
            return
        if self._warned:
            return
        trained = int(self.trained_positions)
        if 0 < trained < needed:
            self._warned = True
            warnings.warn(
                f"learned positions {trained + 1}..{needed} were never trained (training reached "
                f"{trained} positions): their vectors are still random",
                AttnlabWarning,
                stacklevel=2,
            )

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors):  # noqa: ANN001, PLR0913 (nn.Module's signature)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors)
        key = prefix + "trained_positions"
        if key in missing_keys:  # weights saved before the record existed: unknown
            missing_keys.remove(key)
            self.trained_positions.zero_()


class AddPositions(PositionalEncoding):
    """f(v_i, p_i) = v_i + p_i (Vaswani §3.5; Li's slides: "word embedding(x_t) + PE(t)")."""

    def __init__(self, table: nn.Module, d_model: int) -> None:
        super().__init__()
        self.table, self.token_dim, self.d_model = table, d_model, d_model

    def forward(self, x: Tensor, offset: int = 0, positions: Tensor | None = None) -> Tensor:
        return x + self.added(x, offset, positions)

    def added(self, x: Tensor, offset: int = 0, positions: Tensor | None = None) -> Tensor:
        """p_i for every position of ``x``: (T, d_model), or (B, T, d_model) with ``positions``."""
        table = self.table(x.shape[1], offset) if positions is None else self.table.at(positions)
        return table.to(x.dtype)


class ConcatPositions(PositionalEncoding):
    """f(v_i, p_i) = [v_i; p_i] (Hahn §3): token_dim + positional width = d_model."""

    def __init__(self, table: nn.Module, d_model: int, positional_dim: int) -> None:
        super().__init__()
        self.table, self.d_model, self.token_dim = table, d_model, d_model - positional_dim

    def forward(self, x: Tensor, offset: int = 0, positions: Tensor | None = None) -> Tensor:
        batch, length, _ = x.shape
        table = self.table(length, offset) if positions is None else self.table.at(positions)
        return torch.cat([x, table.to(x.dtype).expand(batch, length, -1)], dim=-1)  # (B, T, d + d_pos)


class NoPositions(PositionalEncoding):
    """f(v_i, p_i) = v_i: no order information at all."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.token_dim = self.d_model = d_model

    def forward(self, x: Tensor, offset: int = 0, positions: Tensor | None = None) -> Tensor:
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

    def forward(self, x: Tensor, offset: int = 0, positions: Tensor | None = None) -> Tensor:
        positions = _positions(x, offset, self.max_len, positions)
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

    def forward(self, x: Tensor, offset: int = 0, positions: Tensor | None = None) -> Tensor:
        positions = _positions(x, offset, self.max_len, positions)
        return self.w_zx(torch.relu(self.w_x(x))) + self.w_ze(torch.relu(self.w_e(positions)))


def _check_length(needed: int, max_len: int, what: str) -> None:
    if needed > max_len:
        raise ValueError(f"sequence of length {needed} exceeds max_len={max_len} of the {what}")


def _positions(x: Tensor, offset: int, max_len: int, positions: Tensor | None = None) -> Tensor:
    if positions is not None:
        _check_length(int(positions.max()) + 1 if positions.numel() else 0, max_len, "one-hot positions")
        return positions  # (B, T)
    _check_length(offset + x.shape[1], max_len, "one-hot positions")
    return torch.arange(offset, offset + x.shape[1], device=x.device)  # (T,)


RANDOMIZABLE = ("sinusoidal", "learned", "rope", "alibi", "relative")
"""The encodings randomized positions apply to: those defined at any position in [0, M)."""


def randomized_positions(is_token: Tensor, limit: int, *, generator: torch.Generator | None = None) -> Tensor:
    """Randomized positions (Ruoss et al. 2023, §3): for each row, an ordered random subset of [0, M).

    Row b with n_b real tokens draws n_b distinct positions uniformly from [0, M) without
    replacement (the first n_b of a random permutation) and gives them, sorted, to its tokens in
    order; a padding column takes the position of the token before it (the first token's if
    none), as :func:`attnlab.nn.rotary.positions_of_tokens` does: its key is masked anyway.
    The draw uses ``generator`` (default: torch's global one, which the trainer seeds).

    Args:
        is_token: (B, T) bool, True at real tokens.
        limit: M, the number of positions to draw from (>= T).

    Raises:
        ValueError: naming ``randomized_positions`` when a sequence is longer than M.

    Shape:
        returns (B, T) int64, strictly increasing over each row's real tokens, all < M.
    """
    batch, length = is_token.shape
    if length > limit:
        raise ValueError(
            f"randomized_positions: M={limit} is smaller than a training sequence of {length} positions; "
            f"set it to at least the longest sequence"
        )
    device = is_token.device
    draws = torch.rand(batch, limit, generator=generator, device=device if generator is None else generator.device)
    chosen = draws.to(device).argsort(dim=-1)[:, :length].to(torch.float64)  # (B, T): distinct, random order
    count = is_token.sum(dim=-1, keepdim=True)  # (B, 1)
    unused = torch.arange(length, device=device).unsqueeze(0) >= count  # columns past each row's n_b
    ordered = chosen.masked_fill(unused, math.inf).sort(dim=-1).values  # (B, T): n_b sorted, then inf
    rank = (is_token.long().cumsum(dim=-1) - 1).clamp(min=0)  # (B, T): k-th real token -> k
    rank = torch.minimum(rank, (count - 1).clamp(min=0))
    return ordered.gather(-1, rank).nan_to_num(posinf=0.0).long()


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
    # Rotary positions act inside attention, on queries and keys (attnlab.nn.rotary), and ALiBi and
    # Shaw et al.'s relative positions on its scores (attnlab.nn.position_bias): none here.
    "rope": lambda *, d_model, **_: NoPositions(d_model),
    "alibi": lambda *, d_model, **_: NoPositions(d_model),
    "relative": lambda *, d_model, **_: NoPositions(d_model),
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
