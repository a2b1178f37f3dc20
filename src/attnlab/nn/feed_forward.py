"""The position-wise feed-forward network.

    FFN(x) = max(0, x W_1 + b_1) W_2 + b_2          (Vaswani §3.3; Agarwal Def. 6.5)

"Applied to each of the output value vectors (i.e. row vectors) independently and identically"
(Li's slides, "Feed-forward network"). GELU replaces the ReLU in BERT-family models.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.kernels import Dropout, dropout, linear_kernel

__all__ = ["PositionwiseFeedForward", "ACTIVATIONS"]

ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": partial(F.gelu, approximate="tanh"),
}
"""Registry of activations between the two linear maps."""


class PositionwiseFeedForward(nn.Module):
    """FFN(x) = act(x W_1 + b_1) W_2 + b_2, the same for every position.

    Args:
        d_model: input and output width.
        d_ff: hidden width.
        activation: a name in :data:`ACTIVATIONS` (``relu`` as in the paper, ``gelu`` for BERT).
        dropout: dropout on the hidden activations during training (not in Vaswani et al., whose
            dropout is on sub-layer outputs; BART calls it ``activation_dropout``).
        linear: GEMM kernel of W_1 and W_2, a name in :data:`attnlab.kernels.LINEAR_KERNELS` or ``auto``.

    Shape:
        x: (B, T, d_model) -> (B, T, d_model).
    """

    def __init__(
        self, d_model: int, d_ff: int, *, activation: str = "relu", dropout: float = 0.0, linear: str = "auto"
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation: unknown {activation!r}; allowed: {', '.join(sorted(ACTIVATIONS))}")
        self.activation_name = activation
        self.activation = ACTIVATIONS[activation]
        self.linear1 = nn.Linear(d_model, d_ff)
        self.linear2 = nn.Linear(d_ff, d_model)
        self.dropout = Dropout(dropout)
        self._linear = linear_kernel(linear)

    def forward(self, x: Tensor) -> Tensor:
        # The kernel on the sub-modules' parameters: same maps, without three sub-module calls.
        first, second = self.linear1, self.linear2
        hidden = dropout(self.activation(self._linear(x, first.weight, first.bias)), self.dropout.p, self.training)
        return self._linear(hidden, second.weight, second.bias)

    def extra_repr(self) -> str:
        return f"activation={self.activation_name}"
