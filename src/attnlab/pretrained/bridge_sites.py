"""The parts of a transformers model that own attnlab's sites on the bridge (:mod:`attnlab.pretrained.bridge`).

Each part holds a ``hooks`` table (point -> hooks, :mod:`attnlab.nn.hooks`) and installs one
PyTorch module hook on the transformers module it stands for, which runs the table's hooks on the
site's tensor and costs one truth test while the table is empty:

* :class:`BridgedAttention`: ``attn.q/k/v/scores/pattern/z`` (run by attnlab's attention function,
  :mod:`attnlab.pretrained.bridge_attention`) and ``attn.result/out`` at W^O;
* :class:`BridgedFeedForward`: ``ffn.hidden`` (the input of the FFN's map back to d_model),
  ``ffn.out``, and for a mixture of experts ``ffn.router`` and ``ffn.experts``;
* :class:`BridgedLayer`: ``resid_pre``, ``resid_mid``, ``resid_post``;
* :class:`BridgedEmbedding` (``embed``) and :class:`BridgedStack` (``final_norm``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from attnlab.errors import ConfigError
from attnlab.nn.hooks import ATTENTION_POINTS, run_hooks
from attnlab.pretrained.bridge_attention import SITE_ATTRIBUTE

__all__ = [
    "BRIDGE_POINTS",
    "BridgedAttention",
    "BridgedEmbedding",
    "BridgedFeedForward",
    "BridgedLayer",
    "BridgedStack",
    "BRIDGED_ATTENTION_SETTINGS",
    "use_bridged_attention",
]

BRIDGE_POINTS = tuple(point for point in ATTENTION_POINTS if point not in ("q_pre", "k_pre"))
"""The attention sites of a bridged module: rotary positions are applied inside transformers'
module, before attnlab's function sees the queries and keys, so there is no ``q_pre`` / ``k_pre``."""


class _NoNorm:
    """A norm the bridge does not split into sites (transformers' norms run as they are)."""

    site_points = {0: (), 1: ()}


class BridgedAttention:
    """The sites of one transformers attention module: its hook table, its heads, its W^O.

    Attributes:
        hooks: point -> hooks (:mod:`attnlab.nn.hooks`), run by attnlab's attention function
            (``q``, ``k``, ``v``, ``scores``, ``pattern``, ``z``) and by W^O's module hook
            (``result``, ``out``).
        heads, kv_heads, d_v: the query heads, key/value heads and value width seen by the probe.
        site_points: the points this module has (no ``result``/``out`` without a found W^O).
        adds_to_input: whether its output is what the layer adds to its input (``resid_mid``):
            a self-attention's, not a cross-attention's.
    """

    def __init__(
        self,
        module: nn.Module,
        layer: BridgedLayer,
        heads: int,
        kv_heads: int,
        d_v: int,
        output: nn.Module | None,
        *,
        adds_to_input: bool = True,
    ) -> None:
        self.module = module
        self.adds_to_input = adds_to_input
        self.layer = layer
        self.heads, self.kv_heads, self.d_v = heads, kv_heads, d_v
        self.hooks: dict[str, list[Any]] = {}
        self.probe: Any = None
        self.explicit = False  # the attention setting "explicit": scores and pattern always computed
        self.output = output
        self.site_points = BRIDGE_POINTS if self.output is not None else BRIDGE_POINTS[:-2]
        setattr(module, SITE_ATTRIBUTE, self)
        if self.output is not None:
            self.output.register_forward_hook(self._on_output)

    def _on_output(self, projection: nn.Module, inputs: tuple[Any, ...], out: Tensor) -> Tensor | None:
        """W^O's output with the ``result`` and ``out`` sites (and ``resid_mid``, where it is a sum)."""
        mid = self.layer.hooks.get("resid_mid") if self.layer.resid_mid and self.adds_to_input else None
        if not self.hooks and not mid:
            return None
        if "result" in self.hooks:
            result = self._result(projection, inputs[0])  # (B, H, T, d_model)
            result = run_hooks(self.hooks, "result", result)
            bias = getattr(projection, "bias", None)
            out = result.sum(1) if bias is None else result.sum(1) + bias
        if "out" in self.hooks:
            out = run_hooks(self.hooks, "out", out)
        if mid:
            before = self.layer.resid_in
            summed = before + out
            edited = run_hooks(self.layer.hooks, "resid_mid", summed)
            if edited is not summed:  # an edit of the stream after attention is an edit of what attention adds
                out = edited - before
        return out

    def _result(self, projection: nn.Module, x: Tensor) -> Tensor:
        """result_h = z_h W_O^h: each head's term of W^O's product, (B, H, T, d_model)."""
        weight = projection.weight  # Linear: (d_model, H d_v); GPT-2's Conv1D: (H d_v, d_model)
        if not isinstance(projection, nn.Linear):
            weight = weight.t()
        z = x.unflatten(-1, (self.heads, self.d_v))  # (B, T, H, d_v)
        return torch.einsum("bthd,mhd->bhtm", z, weight.unflatten(1, (self.heads, self.d_v)))


def out_width(module: nn.Module) -> int | None:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, Tensor) or weight.dim() != 2 or isinstance(module, nn.Embedding):
        return None
    return weight.shape[0] if isinstance(module, nn.Linear) else weight.shape[1]


def in_width(module: nn.Module) -> int | None:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        return None
    return weight.shape[1] if isinstance(module, nn.Linear) else weight.shape[0]


class BridgedFeedForward:
    """The sites of a layer's feed-forward module.

    * ``ffn.hidden`` (B, T, d_ff): the input of its map back to d_model, act(x W_1) or
      act(x W_gate) * x W_up, where the module has exactly one such map among its children;
    * ``ffn.router`` (B, T, E): a mixture of experts' router logits, as computed: the routing was
      decided from them already, so an edit here changes what is cached only;
    * ``ffn.experts`` (B, T, E): each token's routing weight for every expert, 0 for the experts
      not chosen (the top k of transformers' router): y = sum_e w_e FFN_e(x). An edit of a chosen
      expert's weight reaches the output (0 ablates the expert for that token: :func:`attnlab.nn.masking_experts`);
      a weight given to an expert the router did not choose is not computed;
    * ``ffn.out`` (B, T, d_model): the module's output.

    The router is the child ``gate`` or ``router`` beside a child ``experts`` that returns
    (logits, top-k weights, top-k indices), transformers' convention for its mixtures since v5;
    the probe pass finds the number of experts E (:attr:`experts`, 0 for none).
    """

    def __init__(self, module: nn.Module, d_model: int) -> None:
        self.hooks: dict[str, list[Any]] = {}
        self.experts = 0
        self._rows: tuple[int, ...] = ()
        down = [child for child in module.children() if out_width(child) == d_model]
        self._hidden = len(down) == 1
        if self._hidden:
            down[0].register_forward_pre_hook(self._on_hidden)
        router = next(
            (getattr(module, n) for n in ("gate", "router") if isinstance(getattr(module, n, None), nn.Module)), None
        )
        if router is not None and isinstance(getattr(module, "experts", None), nn.Module):
            module.register_forward_pre_hook(self._on_input)
            router.register_forward_hook(self._on_route)
        module.register_forward_hook(self._on_output)

    @property
    def site_points(self) -> tuple[str, ...]:
        return ("hidden",) * self._hidden + ("router", "experts") * bool(self.experts) + ("out",)

    def _on_input(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if args and isinstance(args[0], Tensor):
            self._rows = tuple(args[0].shape[:-1])  # (B, T): the router sees B T rows

    def _on_route(self, module: nn.Module, inputs: tuple[Any, ...], out: Any) -> Any:
        if not self.experts:  # the probe pass: is it (logits, top-k weights, top-k indices)?
            if _routing(out):
                self.experts = int(out[0].shape[-1])
            return None
        if "router" not in self.hooks and "experts" not in self.hooks:
            return None
        logits, weights, index = out
        if "router" in self.hooks:
            logits = run_hooks(self.hooks, "router", logits.reshape(*self._rows, -1)).reshape(logits.shape)
        if "experts" in self.hooks:
            dense = weights.new_zeros(weights.shape[0], self.experts).scatter(1, index, weights)
            dense = run_hooks(self.hooks, "experts", dense.reshape(*self._rows, -1)).reshape(dense.shape)
            weights = dense.gather(1, index)
        return logits, weights, index

    def _on_hidden(self, module: nn.Module, args: tuple[Any, ...]) -> Any:
        if "hidden" not in self.hooks:
            return None
        return (run_hooks(self.hooks, "hidden", args[0]), *args[1:])

    def _on_output(self, module: nn.Module, inputs: tuple[Any, ...], out: Any) -> Any:
        if "out" not in self.hooks:
            return None
        if isinstance(out, tuple):  # a mixture of experts returns (states, router logits)
            return (run_hooks(self.hooks, "out", out[0]), *out[1:])
        return run_hooks(self.hooks, "out", out)


def _routing(out: Any) -> bool:
    """Whether a router returned (logits (N, E), weights (N, k), indices (N, k))."""
    return (
        isinstance(out, tuple)
        and len(out) == 3
        and all(isinstance(t, Tensor) for t in out)
        and out[0].dim() == 2
        and out[1].shape == out[2].shape
        and out[1].dim() == 2
        and not out[2].is_floating_point()
    )


class BridgedLayer:
    """The residual-stream sites of one transformers decoder layer.

    Attributes:
        hooks: ``resid_pre``, ``resid_mid``, ``resid_post``.
        self_attn: its :class:`BridgedAttention`, or None for a layer without attention (a hybrid's).
        cross_attn: an encoder-decoder's decoder layer's cross-attention (set only there: the
            sites ``decoder.L.cross.*``).
        feed_forward: its :class:`BridgedFeedForward` (``ffn.out``), or None where none was found.
        resid_mid: whether the layer adds W^O's output to its input as it is (then resid_mid is
            that sum, and its edits reach the rest of the layer).
    """

    site_norms = (_NoNorm(), _NoNorm())
    ffn_norm = _NoNorm()
    attn_norm = None

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.hooks: dict[str, list[Any]] = {}
        self.self_attn: BridgedAttention | None = None
        self.feed_forward: BridgedFeedForward | _NoFeedForward = _NoFeedForward()
        self.resid_mid = False
        self.resid_in: Tensor | None = None
        module.register_forward_pre_hook(self._on_input, with_kwargs=True)
        module.register_forward_hook(self._on_output)

    @property
    def residual_points(self) -> tuple[str, ...]:
        return ("resid_pre", "resid_mid", "resid_post") if self.resid_mid else ("resid_pre", "resid_post")

    def _on_input(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self.hooks:
            return None
        positional = bool(args)
        x = args[0] if positional else kwargs["hidden_states"]
        if "resid_pre" in self.hooks:
            x = run_hooks(self.hooks, "resid_pre", x)
        self.resid_in = x
        if positional:
            return (x, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": x}

    def _on_output(self, module: nn.Module, inputs: tuple[Any, ...], out: Any) -> Any:
        self.resid_in = None
        if "resid_post" not in self.hooks:
            return None
        if isinstance(out, tuple):
            return (run_hooks(self.hooks, "resid_post", out[0]), *out[1:])
        return run_hooks(self.hooks, "resid_post", out)


class _NoFeedForward:
    site_points: tuple[str, ...] = ()
    hooks: dict[str, list[Any]] = {}


class BridgedEmbedding:
    """The site ``embed``: the token embedding module's output (before any scale or position the
    model adds after it)."""

    adds_positions = False
    norm_points: tuple[str, ...] = ()

    def __init__(self, module: nn.Module) -> None:
        self.hooks: dict[str, list[Any]] = {}
        module.register_forward_hook(self._on_output)

    def _on_output(self, module: nn.Module, inputs: tuple[Any, ...], out: Tensor) -> Tensor | None:
        return run_hooks(self.hooks, "embed", out) if self.hooks else None


class BridgedStack:
    """A stack (the decoder; an encoder-decoder's encoder too) as :func:`attnlab.nn.hooks.model_sites` reads it.

    Attributes:
        embedding, layers: the parts above.
        final_norm: transformers' final norm module (the logit lens applies it), or None.
        hooks: the site ``final_norm``: the input of ``head`` (the unembedding), or the output of
            the stack module ``output_of`` (an encoder's, the memory cross-attention reads).
    """

    final_norm_points: tuple[str, ...] = ()

    def __init__(
        self,
        embedding: BridgedEmbedding,
        layers: list[BridgedLayer],
        head: nn.Module | None = None,
        *,
        output_of: nn.Module | None = None,
    ) -> None:
        self.embedding = embedding
        self.layers = layers
        self.final_norm: nn.Module | None = None
        self.hooks: dict[str, list[Any]] = {}
        if head is not None:
            head.register_forward_pre_hook(self._on_head_input)
        if output_of is not None:
            output_of.register_forward_hook(self._on_stack_output)

    def _on_head_input(self, module: nn.Module, args: tuple[Any, ...]) -> Any:
        if not self.hooks:
            return None
        return (run_hooks(self.hooks, "final_norm", args[0]), *args[1:])

    def _on_stack_output(self, module: nn.Module, inputs: tuple[Any, ...], out: Any) -> Any:
        if not self.hooks:
            return None
        if isinstance(out, tuple):
            return (run_hooks(self.hooks, "final_norm", out[0]), *out[1:])
        out["last_hidden_state"] = run_hooks(self.hooks, "final_norm", out["last_hidden_state"])
        return out


BRIDGED_ATTENTION_SETTINGS = ("auto", "sdpa", "explicit")
"""The attention settings a bridged model takes: transformers' SDPA path (``auto``, ``sdpa``) or
attnlab's explicit formula (``explicit``); attnlab's own kernels run only in attnlab's modules."""


def use_bridged_attention(model: nn.Module, setting: str) -> None:
    """Set every bridged attention module of ``model`` to ``setting`` (:data:`BRIDGED_ATTENTION_SETTINGS`)."""
    if setting not in BRIDGED_ATTENTION_SETTINGS:
        raise ConfigError(
            f"attention: {setting!r} runs attnlab's own attention modules, which a model opened through "
            f"the bridge does not have; allowed: {', '.join(BRIDGED_ATTENTION_SETTINGS)}"
        )
    for module in model.modules():
        site = getattr(module, SITE_ATTRIBUTE, None)
        if site is not None:
            site.explicit = setting == "explicit"
