"""How a built model runs, chosen once: its attention implementation and its kernel choices.

Everything that picks an implementation for a model ends here, when the model is built or loaded,
never per call: ``[runtime]`` of a config (``attnlab train``), ``attnlab.load(..., attention=,
kernels=)`` and the command line's ``--attention`` / ``--kernels``::

    [runtime]
    attention = "auto"     # auto | sdpa | explicit | native (| decode | short, attnlab's two kernels)
    kernels = "fixed"      # fixed | measured

* ``attention`` (:data:`attnlab.nn.attention_backends.BACKEND_SETTINGS`): soft attention's
  implementation, set on every attention module (:meth:`TransformerModel.use_attention`): ``auto``
  takes the kernel choice below among the implementations that apply to a call; ``sdpa`` PyTorch's
  fused kernel; ``explicit`` the formula step by step; ``native`` attnlab's C++ kernels (a decoding
  step's or short heads') where they apply. A named one falls back to one that applies where it
  cannot take a call (the weights of a hooked pattern are computed explicitly).
* ``kernels`` (:data:`attnlab.kernels.calibration.KERNEL_MODES`): how ``auto`` choices are made,
  shape class by shape class, in the model's :class:`~attnlab.kernels.calibration.KernelRecord`:
  ``fixed`` takes each caller's stated preference, never timed, so two runs of one config and seed
  on one machine give the same weights bit for bit whatever else the machine does (a training
  run's default); ``measured`` takes the fastest on this machine, timed at first use (the default
  of a model loaded for study: ``attnlab.load``). A run records its choices (``kernels.json``) and
  whoever resumes, evaluates or loads it, or trains ``--like`` it, reuses them.

The environment variables ``ATTNLAB_BACKEND`` (an attention setting) and ``ATTNLAB_CALIBRATE=0``
(nothing timed) are documented overrides, read once: when a module is built and when the kernels
are imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from attnlab.errors import ConfigError, check_field_types
from attnlab.kernels.calibration import KERNEL_MODES, KernelRecord
from attnlab.nn.attention_backends import BACKEND_SETTINGS

__all__ = ["RuntimeConfig", "apply_runtime", "KERNEL_MODES", "BACKEND_SETTINGS"]


@dataclass(frozen=True)
class RuntimeConfig:
    """The ``[runtime]`` section: how a model runs (see the module docstring).

    Attributes:
        attention: soft attention's implementation, one of :data:`BACKEND_SETTINGS`.
        kernels: ``fixed`` (reproducible, never timed) or ``measured`` (the fastest here).
    """

    attention: str = "auto"
    kernels: str = "fixed"

    def __post_init__(self) -> None:
        try:
            check_field_types(self)
        except ValueError as error:
            raise ConfigError(f"runtime.{error}") from None
        if self.attention not in BACKEND_SETTINGS:
            raise ConfigError(f"runtime.attention: unknown {self.attention!r}; allowed: {', '.join(BACKEND_SETTINGS)}")
        if self.kernels not in KERNEL_MODES:
            raise ConfigError(f"runtime.kernels: unknown {self.kernels!r}; allowed: {', '.join(KERNEL_MODES)}")

    @classmethod
    def from_dict(cls, data: Any) -> RuntimeConfig:
        """The section from a config's table; an unknown key is a ConfigError naming it."""
        if not isinstance(data, dict):
            raise ConfigError(f"runtime: expected a [runtime] table, got {type(data).__name__} {data!r}")
        allowed = ("attention", "kernels")
        unknown = sorted(set(data) - set(allowed))
        if unknown:
            raise ConfigError(f"runtime.{unknown[0]}: unknown key; allowed: {', '.join(allowed)}")
        return cls(**data)


def apply_runtime(model: nn.Module, runtime: RuntimeConfig, record: KernelRecord | None = None) -> KernelRecord:
    """Set ``model``'s attention implementation and kernel record, once, as it is built or loaded.

    Args:
        model: an attnlab model (:class:`attnlab.nn.models.TransformerModel`, bridged ones included).
        runtime: the settings.
        record: choices recorded earlier (a run's ``kernels.json``); None: a new, empty record in
            ``runtime.kernels``'s mode.

    Returns:
        The record the model now answers its kernel choices from.
    """
    model.use_attention(runtime.attention)
    model.kernel_record = KernelRecord(runtime.kernels) if record is None else record
    return model.kernel_record
