"""Learning-rate schedules, as multipliers of ``train.lr``, in a registry.

``noam`` is the schedule of Vaswani §5.3,

    lrate = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5),

rescaled so that its peak, reached at ``step = warmup``, equals ``train.lr``:
multiplier = min(step / warmup, sqrt(warmup / step)). The paper's base model corresponds to
``train.lr = 512^-0.5 * 4000^-0.5 ≈ 7.0e-4`` with ``warmup = 4000``.

``constant`` ramps linearly over ``warmup`` steps then stays at 1; ``cosine`` ramps, then decays
to 0 at ``total`` steps along half a cosine.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

__all__ = ["SCHEDULES", "make_scheduler", "multiplier"]


def _ramp(step: int, warmup: int) -> float:
    return 1.0 if warmup <= 0 else min(1.0, step / warmup)


def _noam(step: int, warmup: int, total: int) -> float:
    if warmup <= 0:
        return 1.0 / math.sqrt(step)
    return min(step / warmup, math.sqrt(warmup / step))


def _constant(step: int, warmup: int, total: int) -> float:
    return _ramp(step, warmup)


def _cosine(step: int, warmup: int, total: int) -> float:
    if step <= warmup:
        return _ramp(step, warmup)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


SCHEDULES: dict[str, Callable[[int, int, int], float]] = {
    "noam": _noam,
    "constant": _constant,
    "cosine": _cosine,
}
"""Registry: name -> multiplier(step, warmup, total), with step counted from 1."""


def multiplier(name: str, step: int, *, warmup: int, total: int) -> float:
    """The multiplier of ``train.lr`` at optimizer step ``step`` (1-based)."""
    return SCHEDULES[name](max(1, step), warmup, total)


def make_scheduler(
    optimizer: torch.optim.Optimizer, name: str, *, warmup: int, total: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR whose k-th ``step()`` sets the rate for optimizer step k+1."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule: unknown {name!r}; allowed: {', '.join(sorted(SCHEDULES))}")
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda index: multiplier(name, index + 1, warmup=warmup, total=total)
    )
