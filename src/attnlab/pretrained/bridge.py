"""The bridge: any causal language model transformers runs, with attnlab's named sites.

Where a folder's ``model_type`` has no native family (:data:`attnlab.pretrained.families.FAMILIES`),
:mod:`attnlab.pretrained.hf_model` opens it with transformers' own classes
(:func:`load_transformers_model`: ``AutoModelForCausalLM``, local files only, never remote code)
and :class:`BridgedLM` gives it the sites of :mod:`attnlab.nn.hooks`, so every
analysis runs on it as on a native model, through the same hook tables:

* the attention sites ``decoder.L.attn.q/k/v/scores/pattern/z`` come from attnlab's function in
  transformers' attention registry (:mod:`attnlab.pretrained.bridge_attention`), which every
  modern model calls with its queries, keys and values per head;
* ``attn.result`` and ``attn.out`` from the module's output projection W^O: result_h = z_h W_O^h,
  out = sum_h result_h + b^O (Michel §2.2);
* ``resid_pre`` / ``resid_post`` from the decoder layer's input and output, ``resid_mid`` (= resid_pre
  + attn.out) where the layer adds the attention output to its input as it is, ``ffn.out`` from
  the layer's feed-forward module (with ``ffn.hidden``, and ``ffn.router`` / ``ffn.experts`` for
  a mixture of experts: :mod:`attnlab.pretrained.bridge_sites`), ``embed`` from the token
  embedding, ``final_norm`` from the unembedding's input, and ``logits``.

Which module plays which part is found once, when the model is opened, by one short forward pass
(the *probe*) that watches the attention calls; nothing is chosen by ``model_type``. The bridge
installs one PyTorch module hook per part, each of which runs the site's attnlab hooks and costs
one truth test while none is set.

Shape:
    tokens: (B, T) ids;  is_token: (B, T) bool, False at (left) padding;  returns logits (B, T, V).
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from attnlab.errors import CheckpointError, ConfigError
from attnlab.nn import DecoderOnlyConfig, DecodingState, TransformerModel
from attnlab.pretrained.bridge_attention import IMPLEMENTATION, SITE_ATTRIBUTE, register
from attnlab.pretrained.bridge_sites import (
    BridgedAttention,
    BridgedEmbedding,
    BridgedFeedForward,
    BridgedLayer,
    BridgedStack,
    in_width,
    use_bridged_attention,
)

__all__ = [
    "BridgedLM",
    "BridgedState",
    "attach_sites",
    "empty_transformers_model",
    "find_residual_sums",
    "input_device",
    "load_transformers_model",
]


_FFN_NAMES = ("mlp", "feed_forward", "block_sparse_moe", "ffn", "moe", "mlps", "feedforward")


def empty_transformers_model(folder: Any, *, seq2seq: bool = False) -> tuple[nn.Module, list[str]]:
    """transformers' model of ``folder``'s config on the meta device (nothing allocated, nothing
    read), and the module classes it keeps whole on one device (``_no_split_modules``): what a
    placement is planned on."""
    from accelerate import init_empty_weights  # lazy: only a placed model needs it
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    config = AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    with init_empty_weights():
        model = (AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM).from_config(config)
    return model, list(getattr(model, "_no_split_modules", None) or [])


def load_transformers_model(
    folder: Any, *, dtype: torch.dtype | None, seq2seq: bool = False, placement: Any = None
) -> nn.Module:
    """transformers' model of ``folder`` with attnlab's attention function, local files only:
    ``AutoModelForCausalLM``, or with ``seq2seq`` ``AutoModelForSeq2SeqLM``; with a
    ``placement`` (:class:`attnlab.pretrained.placement.Placement`) its map given to transformers'
    own dispatch (``device_map``, ``offload_folder``).

    Raises:
        ConfigError: a folder that needs remote code, or that transformers cannot build (its words).
    """
    register()
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM  # lazy: only the bridge needs it

    auto = AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM
    try:
        model = auto.from_pretrained(
            folder,
            attn_implementation=IMPLEMENTATION,
            local_files_only=True,
            trust_remote_code=False,
            dtype=dtype if dtype is not None else "auto",
            # grouped_mm, transformers' default for experts, computes no float64: the reference precision runs eager
            **({"experts_implementation": "eager"} if dtype == torch.float64 else {}),
            **(
                {"device_map": placement.devices, "offload_folder": placement.offload_folder}
                if placement is not None
                else {}
            ),
        )
    except (ValueError, OSError, KeyError, TypeError, RuntimeError, ImportError, AttributeError) as error:
        message = " ".join(str(error).split())
        if isinstance(error, KeyError) and IMPLEMENTATION in message:
            raise ConfigError(
                f"{folder}: its modules pick their attention class by name, not through transformers' attention "
                "interface, so attnlab's bridge cannot reach its heads"
            ) from None
        if "trust_remote_code" in message or "custom code" in message:
            raise ConfigError(
                f"{folder}: the model needs remote code (trust_remote_code), which attnlab never runs"
            ) from None
        raise ConfigError(f"{folder}: transformers cannot open it: {message[:300]}") from None
    return model.eval()


# ---- the model ----------------------------------------------------------------------------------------


@dataclass
class BridgedState(DecodingState):
    """What a bridged model keeps between decoding steps: which keys so far are real tokens (as
    :class:`attnlab.nn.decoding.DecodingState`, no per-layer caches of attnlab's) and transformers' KV cache."""

    layers: list[Any] = dataclasses.field(default_factory=list)
    cache: Any = None
    tokens: Tensor | None = None
    """Every token so far, where the model returns no cache (then each step runs the whole sequence)."""

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows ``index`` (beam search)."""
        super().reorder(index)
        if self.cache is not None:
            self.cache.reorder_cache(index)
        if self.tokens is not None:
            self.tokens = self.tokens.index_select(0, index)


class BridgedLM(TransformerModel):
    """A transformers causal language model with attnlab's named sites (see the module docstring).

    Attention kind: ``self``.

    Attributes:
        hf: transformers' model (its parameters are this module's).
        decoder: the :class:`BridgedStack` of sites.
        config: a :class:`~attnlab.nn.DecoderOnlyConfig` of the sizes the probe saw (layers, heads,
            widths, vocabulary, positions): what analyses read; the architecture is ``hf``'s.
        lm_head: transformers' unembedding (``get_output_embeddings()``).
    """

    bridged = True
    norm_form = "measured"
    """How direct attribution freezes the final norm (:data:`attnlab.analysis.logit_attribution.FROZEN_NORMS`):
    transformers' norm, read from what it computes."""
    additive: bool
    """Whether each layer's output is its input plus its attention's and FFN's outputs (probe)."""

    def __init__(self, hf: nn.Module, *, pad_id: int = 0) -> None:
        super().__init__()
        self.hf = hf
        text = hf.config.get_text_config() if hasattr(hf.config, "get_text_config") else hf.config
        head = hf.get_output_embeddings()
        if head is None:
            raise ConfigError(f"{type(hf).__name__} has no output embeddings: not a language model attnlab can read")
        parameters = inspect.signature(hf.forward).parameters
        self._takes_positions = "position_ids" in parameters
        self._cache_argument = "cache" if "cache" in parameters else "past_key_values"  # transformers >= 5.25: cache
        device = input_device(hf)
        [(layers, calls)] = _probe_layers(hf, {"input_ids": torch.ones((1, 4), dtype=torch.long, device=device)}, [hf])
        embedding = BridgedEmbedding(hf.get_input_embeddings())
        d_model = int(getattr(text, "hidden_size", 0) or head.weight.shape[1])
        self.decoder = BridgedStack(embedding, layers, head)
        attach_sites(hf, layers, calls, d_model, cross=False)
        heads, kv_heads, d_v = next(c[0] for c in calls if c)[1:4]
        self.config = DecoderOnlyConfig(
            vocab_size=int(head.weight.shape[0]),
            layers=len(layers),
            d_model=d_model,
            heads=heads,
            kv_heads=kv_heads,
            d_k=d_v,
            d_v=d_v,
            d_ff=int(getattr(text, "intermediate_size", None) or 4 * d_model),
            positional="none",
            max_len=int(getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None) or 2048),
            norm_first=True,
            final_softcap=getattr(text, "final_logit_softcapping", None),
            dropout=0.0,
            attention_dropout=0.0,
            pad_id=pad_id,
        )
        find_residual_sums(self)
        if not self.additive:  # say so in the config: the stream is no sum of the layers' outputs
            self.config = dataclasses.replace(self.config, norm_first=False)

    @property
    def lm_head(self) -> nn.Module:
        return self.hf.get_output_embeddings()

    def forward(self, tokens: Tensor, *, state: BridgedState | None = None, is_token: Tensor | None = None) -> Tensor:
        """Logits for ``tokens``; with ``state`` (from :meth:`new_state`) only the new positions.
        ``is_token`` (B, T): False at padding (default: every position is a token)."""
        if is_token is None:
            is_token = torch.ones(tokens.shape, dtype=torch.bool, device=tokens.device)
        keys = is_token if state is None else state.advance(is_token)
        new = tokens.shape[1]
        if state is not None and state.tokens is not None:  # no cache: the whole sequence again
            tokens = state.tokens = torch.cat([state.tokens, tokens], dim=1)
        inputs: dict[str, Any] = {"input_ids": tokens}
        if not bool(keys.all()):  # padding: masked, and each row counts its own positions
            inputs["attention_mask"] = keys.long()
            if self._takes_positions:
                inputs["position_ids"] = (keys.long().cumsum(-1) - 1).clamp(min=0)[:, -tokens.shape[1] :]
        if state is not None and state.tokens is None:
            inputs |= {self._cache_argument: state.cache, "use_cache": True}
        else:
            inputs["use_cache"] = False
        out = self.hf(**inputs)
        if state is not None and state.tokens is None:
            state.cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
            if state.cache is None:  # a model that keeps no cache (or keeps its state elsewhere)
                state.tokens = tokens
        return self._logits(out.logits[:, -new:])

    def new_state(self) -> BridgedState:
        return BridgedState()

    def use_attention(self, setting: str) -> None:
        """transformers' SDPA path (``auto``, ``sdpa``) or attnlab's explicit formula (``explicit``)."""
        use_bridged_attention(self, setting)

    def site_stacks(self) -> dict[str, tuple[Any, tuple[str, ...]]]:
        return {"decoder": (self.decoder, ("self",))}

    def example_inputs(self, length: int) -> tuple[Tensor, ...]:
        return (torch.full((1, length), 1, device=input_device(self.hf)),)


def input_device(hf: nn.Module) -> torch.device:
    """Where token ids go in: the input embedding's device (the CPU where it is offloaded to disk,
    its weight on the meta device until transformers' dispatch hook brings it in)."""
    device = hf.get_input_embeddings().weight.device
    return torch.device("cpu") if device.type == "meta" else device


def find_residual_sums(model: Any) -> None:
    """One forward pass of a bridged ``model`` comparing what each module receives and returns:
    which layers add their self-attention's W^O output to their input as it is (``resid_mid``),
    whether every layer's output is the sum of its input and its attention's (and cross-attention's)
    and FFN's outputs (``model.additive``: then the residual stream is a sum of the parts, as direct
    attribution reads it), and which module is the final norm (the unembedding's input)."""
    seen: dict[str, Tensor] = {}
    removers = []
    inputs: dict[int, list[Tensor]] = {}
    layers = [layer for stack, _ in model.site_stacks().values() for layer in stack.layers]

    def note(name: str) -> Any:
        def keep(x: Tensor) -> Tensor:
            seen[name] = x.detach()
            return x

        return keep

    for index, layer in enumerate(layers):
        layer.hooks["resid_pre"] = [note(f"{index}.pre")]
        layer.hooks["resid_post"] = [note(f"{index}.post")]
        if "out" in layer.feed_forward.site_points:
            layer.feed_forward.hooks["out"] = [note(f"{index}.ffn")]
        cross = getattr(layer, "cross_attn", None)
        if cross is not None and cross.output is not None:
            cross.hooks["out"] = [note(f"{index}.cross")]
        if layer.self_attn is None or layer.self_attn.output is None:
            continue
        layer.self_attn.hooks["out"] = [note(f"{index}.out")]
        for module in layer.module.modules():
            if module is not layer.module:
                removers.append(module.register_forward_pre_hook(_inputs_to(inputs, index)))
    final: list[Tensor] = []
    removers.append(model.lm_head.register_forward_pre_hook(lambda m, a: final.append(a[0].detach())))
    norms: list[tuple[nn.Module, Tensor]] = []
    in_layers = {id(m) for layer in layers for m in layer.module.modules()}
    for module in model.hf.modules():
        if "norm" in type(module).__name__.lower() and id(module) not in in_layers:
            removers.append(module.register_forward_hook(_outputs_to(norms)))
    try:
        with torch.no_grad():
            model(*model.example_inputs(4))
    finally:
        for remover in removers:
            remover.remove()
        for layer in layers:
            layer.hooks.clear()
            layer.feed_forward.hooks.clear()
            for attention in (layer.self_attn, getattr(layer, "cross_attn", None)):
                if attention is not None:
                    attention.hooks.clear()
    model.additive = True
    for index, layer in enumerate(layers):
        pre, out, ffn, post = (seen.get(f"{index}.{part}") for part in ("pre", "out", "ffn", "post"))
        if pre is not None and out is not None:
            summed = pre + out
            layer.resid_mid = any(x.shape == summed.shape and torch.equal(x, summed) for x in inputs.get(index, []))
        parts = [pre, out, ffn, post]
        crossed = seen.get(f"{index}.cross") if hasattr(layer, "cross_attn") else 0
        if any(part is None for part in [*parts, crossed]) or not _close(pre + out + crossed + ffn, post):
            model.additive = False
    if final:
        for module, out in norms:
            if out.shape == final[0].shape and torch.equal(out, final[0]):
                model.decoder.final_norm = module


def attach_sites(
    hf: nn.Module, layers: list[BridgedLayer], calls: list[list[tuple[Any, ...]]], d_model: int, *, cross: bool
) -> None:
    """Give each layer the sites of what the probe found in it: its self-attention (the first
    attention module that ran), its cross-attention (the second, where ``cross``), its FFN."""
    for layer, attentions in zip(layers, calls):
        if len(attentions) > 1 + cross:
            raise ConfigError(f"{type(hf).__name__}: a layer with {len(attentions)} attention modules")
        if cross and len(attentions) < 2:
            raise ConfigError(f"{type(hf).__name__}: a decoder layer without cross-attention")
        for index, (module, heads, kv_heads, d_v, output) in enumerate(attentions):
            attention = BridgedAttention(module, layer, heads, kv_heads, d_v, output, adds_to_input=index == 0)
            if index == 0:
                layer.self_attn = attention
            else:
                layer.cross_attn = attention
        ffn = _feed_forward(layer.module)
        if ffn is not None:
            layer.feed_forward = BridgedFeedForward(ffn, d_model)


def _close(a: Tensor, b: Tensor) -> bool:
    """Equal up to the rounding of summing in another order."""
    if a.shape != b.shape:
        return False
    tolerance = 1e-3 if a.dtype in (torch.float16, torch.bfloat16) else 1e-5
    return bool((a - b).abs().max() <= tolerance * (b.abs().max() + 1.0))


def _inputs_to(store: dict[int, list[Tensor]], index: int) -> Any:
    def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
        if args and isinstance(args[0], Tensor):
            store.setdefault(index, []).append(args[0].detach())

    return hook


def _outputs_to(store: list[tuple[nn.Module, Tensor]]) -> Any:
    def hook(module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        if isinstance(out, Tensor):
            store.append((module, out.detach()))

    return hook


def _probe_layers(
    hf: nn.Module, inputs: dict[str, Any], roots: list[nn.Module]
) -> list[tuple[list[BridgedLayer], list[list[tuple[Any, ...]]]]]:
    """One forward pass (``hf(**inputs)``) watching attnlab's attention function and every linear
    map. Per root (the model; an encoder-decoder's encoder and decoder): its layers (the module
    list whose items hold the attention modules called under it) and, per layer, one
    (attention module, H, H_kv, d_v, W^O) per attention module in the order they ran (self, then
    cross-attention), W^O being the first map of the same layer, run after the attention function,
    whose input is the function's output as it returned it (inside the module, or beside it as
    BERT's); else the module's own last map of that width (a gate or norm between)."""
    events: list[tuple[str, nn.Module, Any]] = []

    class _Watch:
        hooks: dict[str, Any] = {}

        def __init__(self, module: nn.Module) -> None:
            self.module = module
            self.probe = self.watch

        def watch(self, query: Tensor, key: Tensor, value: Tensor, output: Tensor) -> None:
            shape = (query.shape[1], key.shape[1], value.shape[-1])
            events.append(("attention", self.module, (shape, output.detach().flatten(-2))))

    def linear(module: nn.Module, args: tuple[Any, ...]) -> None:
        if args and isinstance(args[0], Tensor):
            events.append(("map", module, args[0].detach()))

    watched, handles = [], []
    for module in hf.modules():  # transformers calls attnlab's function with the module that computes
        setattr(module, SITE_ATTRIBUTE, _Watch(module))
        watched.append(module)
        if in_width(module) and not isinstance(module, nn.Embedding):
            handles.append(module.register_forward_pre_hook(linear))
    try:
        with torch.no_grad():
            hf(**inputs, use_cache=False)
    except Exception as error:  # noqa: BLE001 - transformers' own failure, said in one line
        message = " ".join(str(error).split())[:300]
        raise ConfigError(f"{type(hf).__name__}: a first forward pass failed: {message}") from None
    finally:
        for module in watched:
            delattr(module, SITE_ATTRIBUTE)
        for handle in handles:
            handle.remove()
    calls = [module for kind, module, _ in events if kind == "attention"]
    if not calls:
        raise ConfigError(
            f"{type(hf).__name__} computes no attention through transformers' attention interface "
            "(no attention layers, or an older module attnlab's bridge cannot see)"
        )
    stacks = []
    for root in roots:
        under = {id(m) for m in root.modules()}
        called = [m for m in calls if id(m) in under]
        if not called:
            raise ConfigError(
                f"{type(hf).__name__}: its {type(root).__name__} computes no attention through transformers' "
                "attention interface (an older module attnlab's bridge cannot see)"
            )
        layers = [BridgedLayer(module) for module in _layer_list(hf, called)]
        stacks.append((layers, [_attentions_of(layer, events) for layer in layers]))
    return stacks


def _attentions_of(layer: BridgedLayer, events: list[tuple[str, nn.Module, Any]]) -> list[tuple[Any, ...]]:
    """(module, H, H_kv, d_v, W^O) of each attention module of ``layer``, in the order they ran."""
    inside = {id(m) for m in layer.module.modules()}
    found: list[tuple[Any, ...]] = []
    for at, (kind, module, seen) in enumerate(events):
        if kind != "attention" or id(module) not in inside or any(module is f[0] for f in found):
            continue
        (heads, kv_heads, d_v), returned = seen
        after = [e for e in events[at + 1 :] if e[0] == "map" and id(e[1]) in inside]
        own = {id(m) for m in module.modules()}
        output = next(  # W^O: the first map whose input is the attention's output, as it was returned,
            (e[1] for e in after if e[2].shape == returned.shape and torch.equal(e[2], returned)),
            next(  # else the module's own last map of that width (an output gate or norm between)
                (e[1] for e in reversed(after) if id(e[1]) in own and e[2].shape[-1] == returned.shape[-1]), None
            ),
        )
        found.append((module, heads, kv_heads, d_v, output))
    return found


def _layer_list(hf: nn.Module, modules: list[nn.Module]) -> nn.ModuleList:
    """The module list whose items hold all the attention ``modules``, and the most items holding
    some: a stack's layers (not a T5 block's list of its sub-layers)."""
    wanted = {id(m) for m in modules}
    best: tuple[int, nn.ModuleList | None] = (0, None)
    for module in hf.modules():
        if isinstance(module, nn.ModuleList):
            held = [{id(m) for m in item.modules()} & wanted for item in module]
            holding = sum(bool(ids) for ids in held)
            if holding > best[0] and set().union(*held) == wanted:
                best = (holding, module)
    if best[1] is None:
        raise CheckpointError(f"{type(hf).__name__}: its attention modules are not in one list of layers")
    return best[1]


def _feed_forward(layer: nn.Module) -> nn.Module | None:
    for name in _FFN_NAMES:
        child = getattr(layer, name, None)
        if isinstance(child, nn.Module):
            return child
    return None
