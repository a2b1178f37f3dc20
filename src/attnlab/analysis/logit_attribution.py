"""Direct logit attribution and the logit lens: what each part of a language model writes towards
its next token.

**Direct logit attribution** (Elhage et al. 2021, "A mathematical framework for transformer
circuits"; TransformerLens' ``decompose_resid`` / ``logit_attrs``). In a model whose layers add
their branches to a residual stream, the residual at the last position is a sum,

    r = e + p + sum_L ( sum_h result_{L,h} + b^O_L  +  f_L )

of the token embedding e (with the token types, where there are), the added position p, each
head's output through W^O (the ``result`` site), each attention's output bias and each FFN's
output f_L. The answer's logit is logit_a = N(r) . W_U[a] + b_U[a], N the final norm. With N's
scale frozen at the clean run, as is standard (its 1/sigma read from this input's r), N is affine:
N(t) = g * C(t) / sigma + beta, C the centring of LayerNorm (t - mean(t); RMSNorm only scales), so

    logit_a = sum_terms t . u  +  beta . W_U[a]  +  b_U[a],      u = C(g * W_U[a] / sigma)

exactly: each head's direct contribution is result_{L,h} . u. Where a layer normalises a branch
before adding it (Gemma 2's sandwich norms, OLMo 2's norms on the output; :data:`BRANCH_NORMS`),
that norm is frozen the same way, at its own clean input, and its bias joins the layer's bias
term. With ``wrong`` the direction is W_U[a] - W_U[w]: the logit difference is decomposed. A soft cap
on the logits (Gemma 2) comes after: the terms sum to the logit before the cap (both are reported).
Only the direct path is measured: what a head writes that later layers read and transform is theirs.

**Logit lens** (nostalgebraist 2020): the next-token distribution read from the residual stream
entering every layer, and leaving the last, through the final norm (not frozen: each residual's
own scale) and the unembedding, as if the model ended there. The last row is the model's output.

Both read a decoder-only language model whose layers add to a residual stream (a norm placement
other than ``post``), at the last position of its prompt (the task's framing, as ``attnlab
generate`` reads it), with the run's held heads (``train.mask_heads``) off.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from attnlab.analysis.inputs import check_ids
from attnlab.analysis.maps import answer_token, language_model_prompt
from attnlab.analysis.plots import heads_heatmap
from attnlab.devices import model_device
from attnlab.errors import UsageError
from attnlab.figures import Figure
from attnlab.nn import masking_heads
from attnlab.nn.hooks import Site, add_hook, model_sites
from attnlab.nn.scores import soft_cap
from attnlab.resources import check_input_text
from attnlab.run.loaded import LoadedRun

__all__ = [
    "NormParts",
    "FrozenNorm",
    "FROZEN_NORMS",
    "MeasuredNorm",
    "BRANCH_NORMS",
    "Term",
    "HeadContribution",
    "LayerContribution",
    "Attribution",
    "Attributions",
    "direct_logit_attribution",
    "LensRow",
    "LogitLens",
    "logit_lens",
]


# ---- norms with their scale frozen -------------------------------------------------------------------


@dataclass(frozen=True)
class NormParts:
    """A norm's affine parts: N(t) = gain * C(t) / sigma + bias, sigma = sqrt(mean(C(x)^2) + eps)
    read from the norm's input x (float64), C(t) = t - mean(t) where it ``centres`` (LayerNorm),
    t otherwise. With sigma frozen at one x, N is affine in t (TransformerLens' ``apply_ln_to_stack``
    with the gain and bias applied rather than folded into the next weights)."""

    gain: Tensor
    bias: Tensor
    centres: bool
    eps: float

    def sigma(self, x: Tensor) -> Tensor:
        """(..., d) -> (..., 1): the norm's scale at each input x."""
        centred = x - x.mean(-1, keepdim=True) if self.centres else x
        return torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + self.eps)

    def linear(self, t: Tensor, sigma: Tensor) -> Tensor:
        """gain * C(t) / sigma: the norm frozen at ``sigma`` without its bias (t (..., d), sigma
        broadcast to it)."""
        centred = t - t.mean(-1, keepdim=True) if self.centres else t
        return self.gain * centred / sigma

    def direction(self, x: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
        """(v, c) with N(t) . u = t . v + c for every t, N frozen at ``x``: v = C(gain * u / sigma_x),
        c = bias . u (C is self-adjoint). x, u: (..., d); returns v (..., d) and c (...)."""
        v = self.gain * u / self.sigma(x)
        v = v - v.mean(-1, keepdim=True) if self.centres else v
        return v, (self.bias * u).sum(-1)


@dataclass(frozen=True)
class FrozenNorm:
    """A norm N(t) = g * C(t) / sigma + beta with sigma read from one input x: affine in t.

    Attributes:
        gain: the module -> g (Gemma's RMSNorm: 1 + w).
        centres: C(t) = t - mean(t) (LayerNorm); otherwise C(t) = t.
    """

    gain: Callable[[nn.Module], Tensor]
    centres: bool

    def parts(self, norm: nn.Module, like: Tensor) -> NormParts:
        """The module's :class:`NormParts` in float64 on ``like``'s device."""
        gain = self.gain(norm).detach().to(like.device, torch.float64)
        bias = getattr(norm, "bias", None)
        bias = torch.zeros_like(gain) if bias is None else bias.detach().to(like.device, torch.float64)
        return NormParts(gain, bias, self.centres, float(norm.eps))

    def direction(self, norm: nn.Module, x: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
        """(v, c) with N(t) . u = t . v + c for every t, N frozen at ``x``.

        Shape:
            x, u: (d,) float64;  returns v (d,) and c ().
        """
        return self.parts(norm, x).direction(x, u)


class MeasuredNorm:
    """A norm of the same form N(t) = g * C(t) / sigma + beta read from what the module computes
    (transformers' own norms on a bridged model, :mod:`attnlab.pretrained.bridge`): beta = N(0);
    C centres where N(t + c) = N(t) (LayerNorm); g = (N(y) - beta) sigma_y / y on a y of zero mean
    and unit root mean square (sigma_y = sqrt(1 + eps)); eps is the module's (``eps``,
    ``variance_epsilon``, ``epsilon``). Gemma's 1 + w and a norm without a gain are measured alike."""

    def parts(self, norm: nn.Module, like: Tensor) -> NormParts:
        """The module's :class:`NormParts`, measured (float64, on ``like``'s device, width its last axis)."""
        eps = next((getattr(norm, n) for n in ("eps", "variance_epsilon", "epsilon") if hasattr(norm, n)), None)
        if not isinstance(eps, (int, float)):
            name = type(norm).__name__
            raise UsageError(f"direct attribution: the final norm {name} names no epsilon to freeze it at")
        parameter = next(norm.parameters(), None)
        dtype = like.dtype if parameter is None else parameter.dtype

        def apply(t: Tensor) -> Tensor:
            return norm(t.to(dtype).reshape(1, 1, -1)).reshape(-1).double()

        d = like.shape[-1]
        y = torch.ones(d, dtype=torch.float64, device=like.device)
        y[1::2] = -1.0
        if d % 2:  # an odd width: zero mean with one entry 0
            y[-1] = 0.0
            y = y * (d / (d - 1)) ** 0.5
        beta = apply(torch.zeros_like(y))
        probe = like.reshape(-1, d)[0].double()
        centres = bool(torch.allclose(apply(probe + 1.0), apply(probe), rtol=1e-3, atol=1e-4))
        gain = torch.zeros_like(y)
        for probe in (y.roll(1), y):  # the second fills every entry; the first, an odd width's 0 entry
            measured = (apply(probe) - beta) * (1.0 + eps) ** 0.5
            gain = torch.where(probe != 0, measured / torch.where(probe != 0, probe, 1.0), gain)
        return NormParts(gain, beta, centres, float(eps))

    def direction(self, norm: nn.Module, x: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
        """(v, c) with N(t) . u = t . v + c for every t, N frozen at ``x`` (as :meth:`FrozenNorm.direction`)."""
        return self.parts(norm, x).direction(x, u)


FROZEN_NORMS: dict[str, FrozenNorm | MeasuredNorm] = {
    "layer": FrozenNorm(lambda norm: norm.weight, centres=True),
    "rms": FrozenNorm(lambda norm: norm.weight, centres=False),
    "rms_one_plus": FrozenNorm(lambda norm: 1.0 + norm.weight, centres=False),
    "measured": MeasuredNorm(),
}
"""Registry: ``model.norm_form`` (``config.norm``, :data:`attnlab.nn.normalization.NORMS`, or
``measured`` for a bridged model's norms) -> its frozen form."""

BRANCH_NORMS: dict[str, Callable[[nn.Module], nn.Module | None]] = {
    "pre": lambda add_norm: None,
    "sandwich": lambda add_norm: add_norm.post_norm,
    "output": lambda add_norm: add_norm.norm,
}
"""Registry: norm placement -> (the layer's AddNorm -> the norm its sublayer's output goes through
before it is added to the residual, or None). ``post`` is not here: a post-norm stack normalises
the sum, and its residual is no sum of the parts."""


# ---- results -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Term:
    """One term of the decomposition: ``embed``, ``pos_embed``, ``L.attn.head.H``, ``L.attn.bias``,
    ``L.ffn``, ``final_norm.bias``, ``unembed.bias``."""

    term: str
    contribution: float


@dataclass(frozen=True)
class HeadContribution:
    kind: str
    layer: int
    head: int
    contribution: float


@dataclass(frozen=True)
class LayerContribution:
    """A layer's attention (its heads and its bias term) and FFN contributions."""

    layer: int
    attention: float
    ffn: float


@dataclass(frozen=True)
class Attribution:
    """The direct contributions to the answer's logit (or logit difference) at the last position.

    Attributes:
        measure: what is decomposed, for people (``logit[' Paris']``, or a difference).
        tokens: the prompt's token labels.
        value: the model's value of the measure (after any soft cap).
        total: the sum of every term: the measure before the soft cap (``value`` without one).
        terms: every term, in the order of the model; heads, layers: the same, by head and by layer.
    """

    measure: str
    tokens: list[str]
    value: float
    total: float
    terms: list[Term]
    heads: list[HeadContribution]
    layers: list[LayerContribution]
    lens: LogitLens | None = None
    """The logit lens on the same prompt, where it was asked for (``LanguageModel.attribute``)."""

    @property
    def head_effects(self) -> Tensor:
        """(layers, heads) float64: each head's direct contribution, ``[L, h]`` as in the head mask."""
        layers, heads = max(h.layer for h in self.heads) + 1, max(h.head for h in self.heads) + 1
        values = torch.zeros(layers, heads, dtype=torch.float64)
        for h in self.heads:
            values[h.layer, h.head] = h.contribution
        return values

    @property
    def layer_effects(self) -> Tensor:
        """(layers, 2) float64: each layer's attention (heads and bias) and FFN contributions."""
        return torch.tensor([[row.attention, row.ffn] for row in self.layers], dtype=torch.float64)

    def plot(self, *, path: str | os.PathLike[str] | None = None) -> Figure:
        """Each head's direct effect, layers down and heads across, as a matplotlib Figure."""
        return heads_heatmap(
            self.head_effects,
            title=f"direct effect of each head on {self.measure}",
            colorbar="direct effect",
            diverging=True,
            path=None if path is None else Path(path),
        )


@dataclass(frozen=True)
class Attributions:
    """Direct logit attribution of a batch of prompts: one :class:`Attribution` each, and their
    tensors stacked (the mean over the batch: ``.head_effects.mean(0)``).

    Attributes:
        items: one per prompt, in order.
    """

    items: list[Attribution]

    @property
    def head_effects(self) -> Tensor:
        """(B, layers, heads) float64."""
        return torch.stack([item.head_effects for item in self.items])

    @property
    def layer_effects(self) -> Tensor:
        """(B, layers, 2) float64: attention, FFN."""
        return torch.stack([item.layer_effects for item in self.items])

    @property
    def values(self) -> Tensor:
        """(B,) the model's value of each prompt's measure."""
        return torch.tensor([item.value for item in self.items], dtype=torch.float64)


@dataclass(frozen=True)
class LensRow:
    """The next-token distribution read from one residual stream at the last position.

    Attributes:
        layer: the layer the residual enters (the last layer's output: the number of layers).
        site: ``resid_pre`` or ``resid_post``.
        answer_rank: 1 for the most likely token; None without an answer.
        top: the most likely tokens with their probabilities, ``' Paris' 0.412 | ...``.
    """

    layer: int
    site: str
    answer_rank: int | None
    answer_probability: float | None
    answer_logit: float | None
    top: str


@dataclass(frozen=True)
class LogitLens:
    """The logit lens at every layer.

    Attributes:
        rows: one per residual stream, layer 0 first, at the last position.
        tokens: the prompt's token labels.
        answer: the answer's label, or None.
        top_tokens: per residual stream and position, the most likely next token's label.
        top_probabilities: (layers + 1, T) their probabilities.
        answer_probabilities: (layers + 1, T) the answer's, or None.
    """

    rows: list[LensRow]
    tokens: list[str]
    answer: str | None
    top_tokens: list[list[str]]
    top_probabilities: Tensor
    answer_probabilities: Tensor | None


# ---- reading the model ------------------------------------------------------------------------------


def _language_model(source: Any) -> LoadedRun:
    loaded: LoadedRun = getattr(source, "loaded", source)
    if not loaded.experiment.model_config_class.language_model:
        kind = loaded.experiment.model_kind
        raise UsageError(f"RUN: the logits read here are a language model's next tokens; this run's model is {kind!r}")
    placement = loaded.model.config.placement
    if placement not in BRANCH_NORMS:
        raise UsageError(
            f"RUN: its layers normalise the residual stream after each sum (norm placement {placement!r}), so the "
            "stream is no sum of the layers' outputs; direct attribution and the logit lens need a pre-norm model"
        )
    return loaded


def _run(
    loaded: LoadedRun, text: str | Sequence[int], sites: dict[str, bool]
) -> tuple[list[int], dict[str, Tensor], Tensor]:
    """Run the prompt of ``text``; (its ids, site -> value, the logits at the last position (V,)).

    ``sites``: name -> keep every position (else the last one only, taken inside the hook).
    """
    if isinstance(text, str):
        check_input_text(text)
        ids = language_model_prompt(loaded, text)
    else:
        ids = check_ids(loaded, [int(i) for i in text], "ids")
    model = loaded.model.eval()
    named = model_sites(model)
    seen: dict[str, Tensor] = {}

    def keep(site: Site, every: bool) -> Callable[[Tensor], Tensor]:
        def hook(x: Tensor) -> Tensor:
            seen[site.name] = (x if every else x.select(site.position_axis, -1))[0].detach()  # type: ignore[arg-type]
            return x

        return hook

    tokens = torch.tensor([ids], device=model_device(model))
    removers = [add_hook(named[name], keep(named[name], every)) for name, every in sites.items()]
    try:
        with masking_heads(model, loaded.held_mask()):
            logits = model(tokens, is_token=torch.ones_like(tokens, dtype=torch.bool))[0, -1]
    finally:
        for remove in removers:
            remove()
    return ids, seen, logits


def _stack(loaded: LoadedRun) -> tuple[str, nn.Module]:
    stack, (module, _) = next(iter(loaded.model.site_stacks().items()))
    return stack, module


def _label(loaded: LoadedRun, index: int) -> str:
    return repr(loaded.codec.tokens([index])[0])


# ---- direct logit attribution -------------------------------------------------------------------------


@torch.no_grad()
def direct_logit_attribution(
    source: Any, text: str | Sequence[int], answer: str | int, wrong: str | int | None = None
) -> Attribution:
    """Decompose the answer's logit (minus the wrong token's) at the last position of ``text``'s
    prompt into the direct contributions of the embeddings, every head, every attention bias and
    FFN, and the final norm's and unembedding's biases (see the module docstring).

    Args:
        source: a :class:`~attnlab.run.loaded.LoadedRun`, or what ``attnlab.load`` returns.
        text: the prompt, or its ids as the model reads them.
        answer: the next token (text that is one token, or its id).
        wrong: another token: decompose logit[answer] - logit[wrong].

    Raises:
        UsageError: a model that is not a pre-norm language model, an answer or wrong token that
            is not one token (naming ``--answer`` / ``--wrong``), the same answer and wrong token.
    """
    loaded = _language_model(source)
    good = answer_token(loaded, answer, "--answer")
    bad = None if wrong is None else answer_token(loaded, wrong, "--wrong")
    if bad == good:
        raise UsageError(f"--wrong: {wrong!r} is the answer's token; give another token")
    model, config = loaded.model, loaded.model.config
    stack, stack_module = _stack(loaded)
    layers = len(stack_module.layers)
    sites = {f"{stack}.0.resid_pre": False, f"{stack}.{layers - 1}.resid_post": False}
    if f"{stack}.pos_embed" in model_sites(model):
        sites[f"{stack}.pos_embed"] = False
    for layer in range(layers):
        sites |= {f"{stack}.{layer}.attn.result": False, f"{stack}.{layer}.attn.out": False}
        sites[f"{stack}.{layer}.ffn.out"] = False
    ids, seen, logits = _run(loaded, text, sites)
    wide = {name: value.double() for name, value in seen.items()}
    unembedding = model.lm_head.weight.double()
    u = unembedding[good] - (unembedding[bad] if bad is not None else 0.0)
    head_bias = model.lm_head.bias
    unembed_bias = 0.0 if head_bias is None else float(head_bias[good] - (head_bias[bad] if bad is not None else 0.0))
    frozen = FROZEN_NORMS[model.norm_form]
    u_res, final_bias = frozen.direction(stack_module.final_norm, wide[f"{stack}.{layers - 1}.resid_post"], u)

    terms: list[Term] = []
    position = wide.get(f"{stack}.pos_embed")
    embedded = wide[f"{stack}.0.resid_pre"]
    terms.append(Term("embed", float((embedded - (0.0 if position is None else position)) @ u_res)))
    if position is not None:
        terms.append(Term("pos_embed", float(position @ u_res)))
    branch_norm = BRANCH_NORMS[config.placement]
    heads: list[HeadContribution] = []
    per_layer: list[LayerContribution] = []
    for index, layer in enumerate(stack_module.layers):
        result, out = wide[f"{stack}.{index}.attn.result"], wide[f"{stack}.{index}.attn.out"]  # (H, d), (d,)
        u_attn, attn_constant = _through(branch_norm(layer.attn_norm), frozen, out, u_res)
        contributions = (result @ u_attn).tolist()  # (H,)
        bias = float((out - result.sum(0)) @ u_attn + attn_constant)
        ffn_out = wide[f"{stack}.{index}.ffn.out"]
        u_ffn, ffn_constant = _through(branch_norm(layer.ffn_norm), frozen, ffn_out, u_res)
        ffn = float(ffn_out @ u_ffn + ffn_constant)
        terms += [Term(f"{index}.attn.head.{h}", c) for h, c in enumerate(contributions)]
        terms += [Term(f"{index}.attn.bias", bias), Term(f"{index}.ffn", ffn)]
        heads += [HeadContribution("self", index, h, c) for h, c in enumerate(contributions)]
        per_layer.append(LayerContribution(index, sum(contributions) + bias, ffn))
    terms += [Term("final_norm.bias", float(final_bias)), Term("unembed.bias", unembed_bias)]

    measure = f"logit[{_label(loaded, good)}]" + ("" if bad is None else f" - logit[{_label(loaded, bad)}]")
    value = float(logits[good] - (logits[bad] if bad is not None else 0.0))
    total = sum(term.contribution for term in terms)
    return Attribution(measure, loaded.codec.tokens(ids), value, total, terms, heads, per_layer)


def _through(norm: nn.Module | None, frozen: FrozenNorm, x: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
    """(v, c): a branch's direction and constant through its own norm (frozen at x), or u itself."""
    return (u, u.new_zeros(())) if norm is None else frozen.direction(norm, x, u)


# ---- the logit lens -----------------------------------------------------------------------------------


@torch.no_grad()
def logit_lens(source: Any, text: str | Sequence[int], *, answer: str | int | None = None, top_k: int = 5) -> LogitLens:
    """The next-token distribution read from every layer's residual stream (see the module docstring).

    Args:
        source: a :class:`~attnlab.run.loaded.LoadedRun`, or what ``attnlab.load`` returns.
        text: the prompt, or its ids as the model reads them.
        answer: a token (text that is one token, or its id) whose rank and probability each row reports.
        top_k: tokens listed per row.

    Raises:
        UsageError: a model that is not a pre-norm language model, an answer that is not one token.
    """
    loaded = _language_model(source)
    good = None if answer is None else answer_token(loaded, answer, "--answer")
    model, config = loaded.model, loaded.model.config
    stack, stack_module = _stack(loaded)
    layers = len(stack_module.layers)
    names = [f"{stack}.{layer}.resid_pre" for layer in range(layers)] + [f"{stack}.{layers - 1}.resid_post"]
    ids, seen, _ = _run(loaded, text, dict.fromkeys(names, True))
    residuals = torch.stack([seen[name] for name in names])  # (layers + 1, T, d)
    logits = model.lm_head(stack_module.final_norm(residuals))  # as DecoderOnly reads its last layer
    if config.final_softcap is not None:
        logits = soft_cap(logits, config.final_softcap)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # half precision read in float32
    probabilities = torch.softmax(logits, -1)  # (layers + 1, T, V)
    top_probabilities, top_ids = probabilities.max(-1)  # (layers + 1, T)
    labels = loaded.codec.tokens
    rows = []
    for row, name in enumerate(names):
        last = logits[row, -1]
        values, indices = probabilities[row, -1].topk(min(top_k, last.numel()))
        listed = " | ".join(f"{label!r} {float(p):.3f}" for label, p in zip(labels(indices.tolist()), values))
        rank = None if good is None else int((last > last[good]).sum()) + 1
        probability = None if good is None else float(probabilities[row, -1, good])
        logit = None if good is None else float(last[good])
        layer = row if row < layers else layers
        rows.append(LensRow(layer, name.rsplit(".", 1)[1], rank, probability, logit, listed))
    return LogitLens(
        rows,
        labels(ids),
        None if good is None else labels([good])[0],
        [labels(row) for row in top_ids.tolist()],
        top_probabilities.cpu(),
        None if good is None else probabilities[:, :, good].cpu(),
    )
