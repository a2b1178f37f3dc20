"""The position-wise feed-forward network.

    FFN(x) = max(0, x W_1 + b_1) W_2 + b_2          (Vaswani §3.3; Agarwal Def. 6.5)

"Applied to each of the output value vectors (i.e. row vectors) independently and identically"
(Li's slides, "Feed-forward network"). GELU replaces the ReLU in BERT-family models. Llama-family
models use a gated unit, SwiGLU (Shazeer 2020, "GLU Variants Improve Transformer", Eq. 6):

    FFN_SwiGLU(x) = (Swish(x W_gate) * (x W_up)) W_2,        Swish(z) = SiLU(z) = z sigmoid(z)

Gemma's GeGLU (Shazeer 2020, Eq. 5, with the tanh approximation of GELU, ``gelu_pytorch_tanh``)
gates with GELU instead:

    FFN_GeGLU(x) = (GELU_tanh(x W_gate) * (x W_up)) W_2

A gated activation takes the two maps' outputs side by side, so its W_1 is [W_gate; W_up]
(2 d_ff rows) and one GEMM computes both.

Named sites (:mod:`attnlab.nn.hooks`): ``pre`` = x W_1 + b_1 (B, T, d_ff) before the activation,
or for a gated unit ``gate`` = x W_gate and ``up`` = x W_up (B, T, d_ff) each; ``hidden``, the
activation's output; ``out``, the FFN's. Hooking ``pre``, ``gate`` or ``up`` applies the activation
to the hooked parts (act(pre), or act(gate) * up) instead of the fused kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.kernels import Dropout, calibration, dropout, fused_swiglu_applies, linear_kernel
from attnlab.kernels import swiglu as fused_swiglu
from attnlab.nn.hooks import Hook, run_hooks

__all__ = ["PositionwiseFeedForward", "ACTIVATIONS", "GATED", "swiglu", "geglu"]


def swiglu(hidden: Tensor) -> Tensor:
    """SiLU(gate) * up, from [x W_gate, x W_up] side by side; in one pass by attnlab's kernel
    where it applies (no gradient wanted: :mod:`attnlab.kernels.gated`) and was measured faster
    than PyTorch's two for this shape class (:mod:`attnlab.kernels.calibration`).

    Shape:
        hidden: (..., 2 d_ff) -> (..., d_ff).
    """
    if fused_swiglu_applies(hidden):
        key = ("swiglu", calibration.bucket(hidden.numel() // hidden.shape[-1]), hidden.shape[-1])
        choice = calibration.chosen(key) or calibration.choose(
            key, {"native": lambda: fused_swiglu(hidden), "torch": lambda: _swiglu_by_ops(hidden)}
        )
        if choice == "native":
            return fused_swiglu(hidden)
    return _swiglu_by_ops(hidden)


def _swiglu_by_ops(hidden: Tensor) -> Tensor:
    gate, up = hidden.chunk(2, dim=-1)
    return F.silu(gate) * up


def geglu(hidden: Tensor) -> Tensor:
    """GELU_tanh(gate) * up, from [x W_gate, x W_up] side by side (Gemma).

    Shape:
        hidden: (..., 2 d_ff) -> (..., d_ff).
    """
    gate, up = hidden.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": partial(F.gelu, approximate="tanh"),
    "swiglu": swiglu,
    "geglu": geglu,
}
"""Registry of activations between the two linear maps."""

GATED: dict[str, Callable[[Tensor], Tensor]] = {"swiglu": F.silu, "geglu": partial(F.gelu, approximate="tanh")}
"""Activations that take two d_ff-wide inputs (a gate and a value), so W_1 has 2 d_ff rows: name ->
the function of the gate (act(gate) * up is the hidden layer)."""


class PositionwiseFeedForward(nn.Module):
    """FFN(x) = act(x W_1 + b_1) W_2 + b_2, the same for every position.

    Args:
        d_model: input and output width.
        d_ff: hidden width.
        activation: a name in :data:`ACTIVATIONS` (``relu`` as in the paper, ``gelu`` for BERT).
        dropout: dropout on the hidden activations during training (not in Vaswani et al., whose
            dropout is on sub-layer outputs; BART calls it ``activation_dropout``).
        bias: biases b_1, b_2 (Llama has none).

    Shape:
        x: (B, T, d_model) -> (B, T, d_model).
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        activation: str = "relu",
        dropout: float = 0.0,
        bias: bool = True,
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation: unknown {activation!r}; allowed: {', '.join(sorted(ACTIVATIONS))}")
        self.activation_name = activation
        self.activation = ACTIVATIONS[activation]
        self.linear1 = nn.Linear(d_model, 2 * d_ff if activation in GATED else d_ff, bias=bias)  # W_1
        self.linear2 = nn.Linear(d_ff, d_model, bias=bias)  # W_2
        self.dropout = Dropout(dropout)
        self._linear = linear_kernel()  # x W^T + b by the runtime setting ATTNLAB_LINEAR
        # Chosen once: the sites before the activation, the gate and up parts or the one pre-activation.
        self._gate = GATED.get(activation)
        self.site_points = ("gate", "up", "hidden", "out") if self._gate is not None else ("pre", "hidden", "out")
        self.hooks: dict[str, list[Hook]] = {}  # sites of site_points (attnlab.nn.hooks)

    def forward(self, x: Tensor) -> Tensor:
        # The kernel on the sub-modules' parameters: same maps, without three sub-module calls.
        first, second = self.linear1, self.linear2
        if not self.hooks:
            hidden = self.activation(self._linear(x, first.weight, first.bias))  # (B, T, d_ff)
        else:
            hidden = run_hooks(self.hooks, "hidden", self._hooked_activation(self._linear(x, first.weight, first.bias)))
        hidden = dropout(hidden, self.dropout.p, self.training)
        output = self._linear(hidden, second.weight, second.bias)
        return output if not self.hooks else run_hooks(self.hooks, "out", output)

    def _hooked_activation(self, pre: Tensor) -> Tensor:
        """act(pre), or act(gate) * up, through the ``pre`` or ``gate`` and ``up`` sites when hooked.

        Shape:
            pre: (B, T, d_ff) or (B, T, 2 d_ff) for a gated unit -> (B, T, d_ff).
        """
        hooks = self.hooks
        if self._gate is None:
            return self.activation(pre if "pre" not in hooks else run_hooks(hooks, "pre", pre))
        if "gate" not in hooks and "up" not in hooks:
            return self.activation(pre)
        gate, up = pre.chunk(2, dim=-1)
        return self._gate(run_hooks(hooks, "gate", gate)) * run_hooks(hooks, "up", up)

    def extra_repr(self) -> str:
        return f"activation={self.activation_name}"
