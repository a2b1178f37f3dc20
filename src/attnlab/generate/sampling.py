"""Sampling: the distribution a token is drawn from, reshaped as Hugging Face's logits warpers do,
in their order: temperature, then top-k, then top-p (nucleus; Holtzman et al. 2020).

:func:`attnlab.generate.search.sample_search` draws from :func:`warp_logits`'s logits.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from attnlab.errors import UsageError
from attnlab.limits import MAX_SEED, MAX_TEMPERATURE, MAX_VOCAB_SIZE

__all__ = ["SamplingOptions", "warp_logits", "top_k_filter", "top_p_filter"]


@dataclass(frozen=True)
class SamplingOptions:
    """How to draw tokens instead of taking the most probable one (Hugging Face's warpers).

    Attributes:
        temperature: logits are divided by it before the softmax; 0 means greedy (argmax, the
            other options unused).
        top_k: keep only the k most probable tokens; 0 = no limit.
        top_p: keep the smallest set of most probable tokens whose probabilities sum to at least
            ``top_p`` (always at least one token); 1 = no limit.
        seed: seeds the ``torch.Generator`` the draws come from (None: a fresh random seed).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        """Raises UsageError naming the option outside its range (the command line's ranges)."""
        if not _is_number(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise UsageError(
                f"temperature: must lie in [0, {MAX_TEMPERATURE:g}] (0 = greedy), got {self.temperature!r}"
            )
        if not _is_int(self.top_k) or not 0 <= self.top_k <= MAX_VOCAB_SIZE:
            raise UsageError(
                f"top_k: must be an integer in [1, {MAX_VOCAB_SIZE:,}], or 0 for no limit, got {self.top_k!r}"
            )
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise UsageError(f"top_p: must lie in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise UsageError(f"seed: must be an integer in [0, {MAX_SEED}], or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def top_k_filter(logits: Tensor, k: int) -> Tensor:
    """Set every logit below the k-th largest of its row to -inf (ties with it stay); 0 = no-op.

    Shape:
        logits: (R, V);  returns (R, V).
    """
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = logits.topk(k, dim=-1).values[:, -1:]  # (R, 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: Tensor, p: float) -> Tensor:
    """Nucleus filter (Holtzman et al. 2020), with Hugging Face's ``TopPLogitsWarper`` semantics:
    keep the smallest set of most probable tokens whose probabilities sum to at least ``p``, and
    always the most probable one; set the rest to -inf. ``p = 1`` is a no-op.

    Shape:
        logits: (R, V);  returns (R, V).
    """
    if p >= 1:
        return logits
    ascending, order = logits.sort(dim=-1)
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= 1 - p  # the least probable tokens whose total stays within 1 - p
    drop[:, -1] = False  # the most probable token always stays
    return logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))


def warp_logits(logits: Tensor, sampling: SamplingOptions) -> Tensor:
    """Temperature, then top-k, then top-p: the logits tokens are drawn from (Hugging Face's order).

    Shape:
        logits: (R, V) float;  returns (R, V).
    """
    logits = logits / sampling.temperature
    return top_p_filter(top_k_filter(logits, sampling.top_k), sampling.top_p)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    """A real number (an int or a float; NaN fails every range check above)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)
