"""An activation cache with the helpers TransformerLens users rely on: the residual stream
accumulated layer by layer, decomposed into what each part wrote, each head's output, the final norm
with its scale frozen, and each part's direct contribution to a logit.

In a decoder-only model whose layers add their branches to a residual stream (Elhage et al. 2021,
"A Mathematical Framework for Transformer Circuits", §2), the stream entering layer L is a sum

    r_L = e + p + sum_{l < L} ( a_l + f_l ),      a_l = sum_h result_{l,h} + b^O_l

of the token embedding e, the added positions p, and each earlier layer's attention output a_l
(its heads' outputs z_h W^O_h, the ``attn.result`` site, plus the output bias) and FFN output f_l.
The logits read the last stream r through the final norm N and the unembedding:
logit_a = N(r) . W_U[a] + b_U[a]. With N's scale frozen at this input's r (TransformerLens'
``apply_ln_to_stack``), N(t) = g * C(t) / sigma + beta is affine (C centres for LayerNorm), so

    logit_a = sum_parts t . C(g * W_U[a] / sigma) + beta . W_U[a] + b_U[a]

exactly: :meth:`ActivationCache.logit_attrs` gives the terms of the sum, with the last two as two
more rows on request. Where a layer normalises a branch before adding it (sandwich and output
placements: :data:`~attnlab.analysis.logit_attribution.BRANCH_NORMS`) a_l and f_l are the normalised
branches, what the stream receives. A post-norm model's stream is no such sum; the helpers refuse it.

Names follow TransformerLens' ``ActivationCache`` (``accumulated_resid``, ``decompose_resid``,
``stack_head_results``, ``logit_attrs``; its ``apply_ln`` is ``apply_final_norm`` here) with
attnlab's sites (:mod:`attnlab.nn.hooks`: ``decoder.L.resid_pre``, ``decoder.L.attn.result``, ...)
and shapes: a stack is (components, B, T, d_model), positions on axis 2. The labels of the parts
are those of :func:`~attnlab.analysis.logit_attribution.direct_logit_attribution`'s terms.
The helpers read sites only, so they serve attnlab's own models and bridged ones alike.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Iterator, Mapping, Sequence
from functools import cached_property
from typing import Any

import torch
from torch import Tensor, nn

from attnlab.analysis.inputs import check_token_ids, model_inputs
from attnlab.analysis.logit_attribution import BRANCH_NORMS, FROZEN_NORMS, NormParts
from attnlab.analysis.maps import answer_token
from attnlab.errors import UsageError
from attnlab.nn import masking_heads, trace
from attnlab.nn.hooks import resolve_sites
from attnlab.run.loaded import LoadedRun

__all__ = ["ActivationCache", "run_with_cache", "PositionSelection"]

PositionSelection = int | slice | Sequence[int] | Tensor | None
"""Positions of the (B, T, ...) sites: one (that axis dropped), a slice, indices, or None for all."""

HELPER_POINTS = ("resid_pre", "resid_mid", "resid_post", "attn.result", "attn.out", "ffn.out")
"""The points of every layer that the helpers read (``resid_mid`` where the model has it)."""

MODES = {"all": (True, True), "attn": (True, False), "ffn": (False, True), "mlp": (False, True)}
"""decompose_resid's ``mode`` -> (attention parts, FFN parts); ``mlp`` is TransformerLens' name."""


def language_model(source: Any) -> LoadedRun:
    """The :class:`LoadedRun` of ``source`` (one, or what ``attnlab.load`` returns), checked to be a
    decoder-only language model."""
    loaded: LoadedRun = getattr(source, "loaded", source)
    if not loaded.experiment.model_config_class.language_model:
        raise UsageError(
            f"model: a decoder-only language model is needed here; this one is {loaded.experiment.model_kind!r}"
        )
    return loaded


@torch.no_grad()
def run_with_cache(
    source: Any,
    inputs: str | Sequence[str] | Sequence[Sequence[int]] | Tensor,
    is_token: Tensor | None = None,
    names: str | Sequence[str] | None = None,
) -> tuple[Tensor, ActivationCache]:
    """Run a language model once and cache its sites (TransformerLens' ``run_with_cache``), with
    the run's held heads (``train.mask_heads``) off as every analysis runs it.

    Args:
        source: a :class:`~attnlab.run.loaded.LoadedRun`, or what ``attnlab.load`` returns.
        inputs: a text, a list of texts (left-padded), a list of id lists, or a (B, T) tensor of ids.
        is_token: (B, T) True at real tokens, with ids as a tensor (default: all).
        names: site names or globs to cache (``attnlab sites``), beside those the helpers read;
            None caches every site.

    Shape:
        logits (B, T, V); the cache's sites as :mod:`attnlab.nn.hooks` lists them.

    Returns:
        (logits, :class:`ActivationCache`).

    Raises:
        UsageError: a model that is not a decoder-only language model, bad inputs
            (:func:`attnlab.analysis.inputs.model_inputs`), a name that matches no site (naming
            ``names`` and the closest sites).
    """
    loaded = language_model(source)
    tokens, mask = model_inputs(loaded, inputs, is_token)
    model = loaded.model.eval()
    with trace(model) as traced:
        stack = next(iter(model.site_stacks()))
        wanted = [f"{stack}.*.{point}" for point in HELPER_POINTS] + [f"{stack}.pos_embed", f"{stack}.final_norm"]
        wanted = [pattern for pattern in wanted if fnmatch.filter(traced.sites, pattern)]
        asked = ["*"] if names is None else [names] if isinstance(names, str) else list(names)
        try:
            resolve_sites(traced.sites, asked)
        except ValueError as error:
            raise UsageError(f"names: {error}") from None
        traced.record(wanted + asked)
        with masking_heads(model, loaded.held_mask()):
            logits = model(tokens, is_token=mask)
    return logits, ActivationCache(traced.cache, loaded, tokens=tokens, is_token=mask)


class ActivationCache(Mapping[str, Tensor]):
    """Site name -> its tensor in one forward pass, with TransformerLens' helpers (module docstring).

    Attributes:
        loaded: the run the tensors came from.
        tokens, is_token: (B, T) the ids it read and where they are real tokens (None where the
            cache was built from a trace without them).
        layers: the number of layers.
    """

    def __init__(
        self,
        cache: Mapping[str, Tensor],
        source: Any,
        *,
        tokens: Tensor | None = None,
        is_token: Tensor | None = None,
    ) -> None:
        self.loaded = language_model(source)
        self._cache = dict(cache)
        self.tokens, self.is_token = tokens, is_token
        self._stack, (self._stack_module, _) = next(iter(self.loaded.model.site_stacks().items()))
        self.layers = len(self._stack_module.layers)

    # ---- the mapping -----------------------------------------------------------------------------

    def __getitem__(self, name: str) -> Tensor:
        if name not in self._cache:
            close = difflib.get_close_matches(str(name), list(self._cache), n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise UsageError(f"site {name!r}: not in this cache (run_with_cache names= caches more){hint}")
        return self._cache[name]

    def __contains__(self, name: object) -> bool:
        return name in self._cache

    def get(self, name: str, default: Any = None) -> Any:
        return self._cache.get(name, default)

    def __iter__(self) -> Iterator[str]:
        return iter(self._cache)

    def __len__(self) -> int:
        return len(self._cache)

    def __repr__(self) -> str:
        return f"ActivationCache({len(self)} sites of {self.loaded.name!r})"

    # ---- the residual stream -------------------------------------------------------------------------

    def accumulated_resid(
        self,
        layer: int | None = None,
        incl_mid: bool = False,
        apply_final_norm: bool = False,
        pos_slice: PositionSelection = None,
        return_labels: bool = False,
    ) -> Tensor | tuple[Tensor, list[str]]:
        """The residual stream entering each layer before ``layer``, and leaving the last (the
        logit lens' streams, nostalgebraist 2020): r_0, (r_0 + a_0,) r_1, ..., r_L.

        Args:
            layer: streams up to the one entering ``layer``, in 0..layers; None or -1: every
                layer's and the last one's output (``decoder.{layers-1}.resid_post``).
            incl_mid: also each layer's ``resid_mid`` (after its attention; not for parallel
                residuals or a bridged layer without that site).
            apply_final_norm: each stream through the final norm at its own scale (the norm as the
                model applies it, not frozen: the last row is then the ``final_norm`` site).
            pos_slice: the positions kept (:data:`PositionSelection`).
            return_labels: also return the site name of each stream.

        Shape:
            (streams, B, T, d_model); (streams, B, d_model) for one position.

        Returns:
            The stack, or (stack, labels).
        """
        layer = self._layer_arg(layer)
        names = []
        for index in range(layer + 1):
            if index == self.layers:
                names.append(self._name("resid_post", index - 1))
                continue
            names.append(self._name("resid_pre", index))
            if incl_mid and index < layer:
                names.append(self._need_mid(index))
        stack = torch.stack([_positions(self[name], pos_slice, "pos_slice") for name in names])
        if apply_final_norm:
            norm = self._stack_module.final_norm
            with torch.no_grad():
                stack = norm(stack)
        return (stack, names) if return_labels else stack

    def decompose_resid(
        self,
        layer: int | None = None,
        mode: str = "all",
        apply_final_norm: bool = False,
        incl_embeds: bool = True,
        pos_slice: PositionSelection = None,
        return_labels: bool = False,
    ) -> Tensor | tuple[Tensor, list[str]]:
        """The stream entering ``layer`` as the sum of what wrote it (Elhage et al. 2021, §2):
        r_L = e + p + sum_{l < L} (a_l + f_l) (module docstring).

        The parts: ``embed`` e (``resid_pre`` of layer 0 less ``pos_embed``; a model without a
        ``pos_embed`` site, such as a bridged GPT-2, has its positions in it), ``pos_embed`` p,
        then per layer ``L.attn`` (the ``attn.out`` site, through the layer's branch norm where
        it has one) and ``L.ffn`` (``ffn.out``, likewise).

        Args:
            layer: the stream entering this layer, 0..layers; None or -1: the last layer's output.
            mode: ``all``; ``attn`` (the attention parts only); ``ffn`` or ``mlp`` (the FFN parts only).
            apply_final_norm: the parts through the final norm with its scale frozen at the last
                stream (:meth:`apply_final_norm` at ``pos_slice``).
            incl_embeds: include ``embed`` and ``pos_embed``.
            pos_slice: the positions kept (:data:`PositionSelection`).
            return_labels: also return each part's label.

        Shape:
            (parts, B, T, d_model); (parts, B, d_model) for one position.

        Returns:
            The stack (with every part, its sum over axis 0 is the stream), or (stack, labels).
        """
        layer = self._layer_arg(layer)
        if mode not in MODES:
            raise UsageError(f"mode: unknown {mode!r}; allowed: {', '.join(MODES)}")
        attention, ffn = MODES[mode]
        self._check_sum()
        parts: dict[str, Tensor] = {}
        if incl_embeds:
            position = self.get(self._name("pos_embed"))
            embedded = self[self._name("resid_pre", 0)]
            parts["embed"] = embedded if position is None else embedded - position
            if position is not None:
                parts["pos_embed"] = position
        for index in range(layer):
            if attention:
                parts[f"{index}.attn"] = self._branch(index, "attn")
            if ffn:
                parts[f"{index}.ffn"] = self._branch(index, "ffn")
        if not parts:
            raise UsageError("decompose_resid: no parts (layer 0 without the embeddings)")
        stack = torch.stack([_positions(part, pos_slice, "pos_slice") for part in parts.values()])
        if apply_final_norm:
            stack = self.apply_final_norm(stack, pos=pos_slice)
        return (stack, list(parts)) if return_labels else stack

    def stack_head_results(
        self,
        layer: int | None = None,
        incl_bias: bool = False,
        incl_remainder: bool = False,
        apply_final_norm: bool = False,
        pos_slice: PositionSelection = None,
        return_labels: bool = False,
    ) -> Tensor | tuple[Tensor, list[str]]:
        """Each head's output z_h W^O_h (the ``attn.result`` site) of the layers before ``layer``,
        layer by layer (TransformerLens' ``(layer head)`` order).

        Where the layer normalises its attention branch (sandwich and output placements), a head's
        row is its output through that norm frozen at the layer's output, g * C(result_h) / sigma:
        the part of what the stream receives that is the head's.

        Args:
            layer: heads of the layers before this one, 0..layers; None or -1: every layer.
            incl_bias: after the heads, one row per layer ``L.attn.bias``: what the attention
                branch adds beyond its heads (b^O, and a branch norm's bias); the heads of layer
                L plus its bias row are then the ``L.attn`` part of :meth:`decompose_resid`.
            incl_remainder: a last row ``remainder``: the stream entering ``layer`` less the rows
                above (the embeddings, the FFNs, and the biases where not included).
            apply_final_norm: the rows through the final norm frozen at the last stream.
            pos_slice: the positions kept (:data:`PositionSelection`).
            return_labels: also return the labels ``L.attn.head.H`` (as ``direct_logit_attribution``).

        Shape:
            (parts, B, T, d_model): layer * heads rows, then a bias row per layer and a remainder
            row where asked; (parts, B, d_model) for one position.

        Returns:
            The stack, or (stack, labels).
        """
        layer = self._layer_arg(layer)
        self._check_sum()
        rows: list[Tensor] = []
        labels: list[str] = []
        biases: list[Tensor] = []
        for index in range(layer):
            result = self[self._name("attn.result", index)].transpose(0, 1)  # (H, B, T, d)
            norm = self._branch_norm(index, "attn")
            if norm is not None:
                out = self[self._name("attn.out", index)]
                parts = self._parts(norm, out)
                result = parts.linear(result.double(), parts.sigma(out.double())).to(out.dtype)
            rows += list(result)
            labels += [f"{index}.attn.head.{head}" for head in range(result.shape[0])]
            biases.append(self._branch(index, "attn") - result.sum(0))
        if incl_bias:
            rows += biases
            labels += [f"{index}.attn.bias" for index in range(layer)]
        if incl_remainder:
            stream = self[self._stream(layer)]
            rows.append(stream - (torch.stack(rows).sum(0) if rows else 0.0))
            labels.append("remainder")
        if not rows:
            raise UsageError("stack_head_results: no heads before layer 0; give layer >= 1 or incl_remainder=True")
        stack = torch.stack([_positions(row, pos_slice, "pos_slice") for row in rows])
        if apply_final_norm:
            stack = self.apply_final_norm(stack, pos=pos_slice)
        return (stack, labels) if return_labels else stack

    # ---- the final norm and the logits -------------------------------------------------------------------

    def apply_final_norm(self, stack: Tensor, pos: PositionSelection = -1, incl_bias: bool = False) -> Tensor:
        """Parts of the last stream through the final norm with its scale frozen at that stream
        (TransformerLens' ``apply_ln_to_stack``, with the gain applied, as no weights are folded):
        t -> g * C(t) / sigma(r), C(t) = t - mean(t) for LayerNorm, t for RMSNorm, sigma(r) the
        norm's scale at the real stream r. Summed over the parts of r, plus the norm's bias beta,
        it is the ``final_norm`` site exactly.

        Args:
            stack: (parts, B, d_model) at one position ``pos``, or (parts, B, T', d_model) at the
                positions ``pos`` selects (a stack of every position is read at an int ``pos``).
            pos: the positions of the stack (:data:`PositionSelection`).
            incl_bias: a last row, beta (zeros for a norm without a bias).

        Shape:
            as ``stack`` (one more row with ``incl_bias``).

        Returns:
            The normalised parts, in float64 for a float64 model (at least float32).
        """
        residual, stack = self._aligned(stack, pos)
        parts = self._final_parts
        normed = parts.linear(stack.double(), parts.sigma(residual.double()))
        if incl_bias:
            normed = torch.cat([normed, parts.bias.expand_as(normed[:1])])
        return normed.to(_result_dtype(stack))

    def logit_attrs(
        self,
        stack: Tensor,
        tokens: int | str | Tensor,
        incorrect_tokens: int | str | Tensor | None = None,
        pos: PositionSelection = -1,
        incl_offset: bool = False,
    ) -> Tensor:
        """Each part's direct contribution to the logit of ``tokens`` (minus that of
        ``incorrect_tokens``) through the final norm frozen at the real stream and the
        unembedding (Elhage et al. 2021; TransformerLens' ``logit_attrs``): t . C(g * u / sigma),
        u = W_U[token] (- W_U[incorrect]).

        The parts of :meth:`decompose_resid` (every one, the last layer's stream) sum, with the
        two offset rows, to the model's logit (difference) before any soft cap, exactly.

        Args:
            stack: the unnormalised parts, shaped as :meth:`apply_final_norm` takes them.
            tokens: a token id, a text that is one token (read without the model's BOS), or a
                tensor of ids: () for all, (B,) one per example, (B, T') one per example and position.
            incorrect_tokens: the same for the token subtracted (a logit difference).
            pos: the positions of the stack (:data:`PositionSelection`).
            incl_offset: two last rows, ``final_norm.bias`` beta . u and ``unembed.bias``
                b_U[token] (- b_U[incorrect]): with them the rows sum to the logit.

        Shape:
            (parts [+ 2], B) at one position; (parts [+ 2], B, T') at several.

        Returns:
            The contributions (float64 for a float64 model, at least float32).

        Raises:
            UsageError: a text of several tokens, an id outside the vocabulary, tokens whose shape
                does not fit the stack's examples and positions (naming the argument).
        """
        residual, stack = self._aligned(stack, pos)
        head = self.loaded.model.lm_head
        where = residual.shape[:-1]  # (B,) or (B, T')
        u = self._directions(head.weight, tokens, where, "tokens")
        bias = getattr(head, "bias", None)
        offset = self._chosen(bias, tokens, where, "tokens")
        if incorrect_tokens is not None:
            u = u - self._directions(head.weight, incorrect_tokens, where, "incorrect_tokens")
            offset = offset - self._chosen(bias, incorrect_tokens, where, "incorrect_tokens")
        v, norm_offset = self._final_parts.direction(residual.double(), u)
        attributions = (stack.double() * v).sum(-1)
        if incl_offset:
            attributions = torch.cat([attributions, norm_offset.expand(where)[None], offset.expand(where)[None]])
        return attributions.to(_result_dtype(stack))

    # ---- reading the model ---------------------------------------------------------------------------

    def _name(self, point: str, layer: int | None = None) -> str:
        return f"{self._stack}.{point}" if layer is None else f"{self._stack}.{layer}.{point}"

    def _stream(self, layer: int) -> str:
        """The site of the stream entering ``layer`` (the last layer's output for ``layers``)."""
        return self._name("resid_post", layer - 1) if layer == self.layers else self._name("resid_pre", layer)

    def _layer_arg(self, layer: int | None) -> int:
        if layer is None or layer == -1:
            return self.layers
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer <= self.layers:
            raise UsageError(f"layer: {layer!r} is out of range; give 0..{self.layers}, or None (every layer)")
        return layer

    def _need_mid(self, layer: int) -> str:
        name = self._name("resid_mid", layer)
        if name not in self._cache:
            raise UsageError(f"incl_mid: this model has no {name} site (parallel residuals, or a bridged layer)")
        return name

    def _check_sum(self) -> None:
        placement = self.loaded.model.config.placement
        if placement not in BRANCH_NORMS:
            raise UsageError(
                f"this model normalises the residual stream after each sum (norm placement {placement!r}): "
                "the stream is no sum of the layers' outputs, so it has no decomposition"
            )

    def _branch_norm(self, layer: int, label: str) -> nn.Module | None:
        """The norm the layer's ``attn`` or ``ffn`` branch goes through before it is added, or None."""
        add_norm = getattr(self._stack_module.layers[layer], f"{label}_norm", None)
        return BRANCH_NORMS[self.loaded.model.config.placement](add_norm)

    def _branch(self, layer: int, label: str) -> Tensor:
        """What the layer's ``attn`` or ``ffn`` branch adds to the stream: its output, normalised
        where the layer does so."""
        out = self[self._name(f"{label}.out", layer)]
        norm = self._branch_norm(layer, label)
        if norm is None:
            return out
        with torch.no_grad():
            return norm(out)

    def _parts(self, norm: nn.Module, like: Tensor) -> NormParts:
        return FROZEN_NORMS[self.loaded.model.norm_form].parts(norm, like)

    @cached_property
    def _final_parts(self) -> NormParts:
        return self._parts(self._stack_module.final_norm, self[self._stream(self.layers)])

    def _aligned(self, stack: Tensor, pos: PositionSelection) -> tuple[Tensor, Tensor]:
        """(the last stream at ``pos``, the stack there), checked to fit each other."""
        self._check_sum()
        full = self[self._stream(self.layers)]
        residual = _positions(full, pos, "pos")
        if not isinstance(stack, Tensor) or stack.dim() < 2:
            raise UsageError("stack: expected a tensor of parts, (parts, B, [T,] d_model)")
        if isinstance(pos, int) and tuple(stack.shape[1:]) == tuple(full.shape):  # every position: read at pos
            stack = stack[:, :, pos]
        if tuple(stack.shape[1:]) != tuple(residual.shape):
            raise UsageError(
                f"stack: parts of shape {tuple(stack.shape[1:])} do not fit the stream at pos={pos!r}, "
                f"{tuple(residual.shape)}; select the same positions (pos_slice=) in both"
            )
        return residual, stack

    def _ids(self, tokens: int | str | Tensor, where: torch.Size, what: str) -> Tensor:
        """Token ids broadcast to the examples (and positions) ``where``."""
        if isinstance(tokens, str):
            tokens = answer_token(self.loaded, tokens, what)
        ids = torch.as_tensor(tokens, device=self[self._stream(self.layers)].device)
        if ids.is_floating_point() or ids.dim() > len(where):
            raise UsageError(f"{what}: expected integer ids of shape (), (B,) or (B, T'), got {tuple(ids.shape)}")
        check_token_ids(ids, self.loaded.model.lm_head.weight.shape[0], what)
        if ids.dim() == 1 and len(where) == 2:  # one per example, at each position
            ids = ids[:, None]
        try:
            return ids.expand(where)
        except RuntimeError:
            raise UsageError(f"{what}: ids of shape {tuple(ids.shape)} do not fit the stack's {tuple(where)}") from None

    def _directions(self, weight: Tensor, tokens: int | str | Tensor, where: torch.Size, what: str) -> Tensor:
        return weight.detach().double()[self._ids(tokens, where, what)]

    def _chosen(self, bias: Tensor | None, tokens: int | str | Tensor, where: torch.Size, what: str) -> Tensor:
        ids = self._ids(tokens, where, what)
        return (
            torch.zeros(where, dtype=torch.float64, device=ids.device) if bias is None else bias.detach().double()[ids]
        )


def _positions(x: Tensor, pos: PositionSelection, what: str) -> Tensor:
    """``x`` (B, T, ...) at the positions ``pos`` (axis 1): one (the axis dropped), a slice, indices, or all."""
    if pos is None:
        return x
    if isinstance(pos, slice):
        return x[:, pos]
    length = x.shape[1]
    index = torch.as_tensor(pos, device=x.device)
    if index.is_floating_point() or index.dim() > 1:
        raise UsageError(f"{what}: expected a position, a slice or a list of positions, got {pos!r}")
    if index.numel() and (int(index.min()) < -length or int(index.max()) >= length):
        raise UsageError(f"{what}: position {pos!r} is out of range for {length} positions")
    return x[:, int(index)] if index.dim() == 0 else x[:, index]


def _result_dtype(stack: Tensor) -> torch.dtype:
    return torch.promote_types(stack.dtype, torch.float32)
