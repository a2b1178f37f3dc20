"""Run a loaded model on one input and capture every attention map, with token labels.

The output is what the plots and the viewer show: for each :class:`AttentionMap` (an attention
module's ``pattern`` site, cached with :func:`attnlab.nn.trace`), the tokens along its query and
key axes. For an encoder-decoder the input is decoded greedily
first, then one teacher-forced pass over (source, BOS + output) records all three kinds. For a
decoder-only model the prompt is continued greedily, then one pass over (prompt + continuation),
every position a real token, records the maps and gives the next-token distribution right after the
prompt. The prompt is the task's own (``task.generation_prompt``: ``BOS text`` for a model trained
here, the model's framing for a pretrained LM, whose BOS may not exist), as ``attnlab generate``
reads it.

The model runs as the run defines it: the heads held at zero in training (``train.mask_heads``,
Michel §2.3's xi_h = 0) are off in every view, and a ``head_mask`` given switches more heads off
(it is multiplied in). A head that is off still has attention weights to draw (xi scales a head's
output, not its weights); :attr:`AttentionView.off` names those heads.

"Visualising learned attentions: different heads show different patterns" (Li's slides).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from attnlab.devices import model_device
from attnlab.errors import UsageError
from attnlab.generate.search import DecodeOptions, Hypothesis, decode, generate_continuations
from attnlab.head_ids import HeadId, heads_off
from attnlab.nn import masking_heads, trace
from attnlab.nn.hooks import model_sites
from attnlab.nn.models import POOLINGS
from attnlab.nn.trace import Trace
from attnlab.resources import check_decode_length, check_input_text, check_input_tokens
from attnlab.run.loaded import LoadedRun

__all__ = [
    "AttentionMap",
    "AttentionView",
    "SINK",
    "attention_maps",
    "attention_view",
    "check_finite",
    "decode_source",
    "kind_maps",
    "traced_maps",
    "with_sinks",
]


@dataclass(frozen=True)
class AttentionMap:
    """The attention weights of one attention module in one forward pass.

    Attributes:
        kind: ``encoder_self``, ``decoder_self``, ``cross`` or ``self``.
        layer: layer index within its kind.
        weights: (B, H, T_q, T_k) per-head attention weights (one-hot rows for hard attention):
            the module's ``pattern`` site.
    """

    kind: str
    layer: int
    weights: Tensor


def traced_maps(traced: Trace) -> list[AttentionMap]:
    """The attention maps ``traced`` cached in its latest forward pass: one per ``pattern`` site in
    its cache (a lone attention module's is kind ``self``, layer 0), in the model's order."""
    return [
        AttentionMap(site.kind or "self", site.layer or 0, traced.cache[name])
        for name, site in traced.sites.items()
        if site.point == "pattern" and name in traced.cache
    ]


@contextmanager
def attention_maps(model: torch.nn.Module) -> Iterator[list[AttentionMap]]:
    """Trace the ``pattern`` site of every attention module of ``model`` inside the block; on
    leaving, the list yielded holds their maps (:func:`traced_maps`) from the block's last pass.

    Args:
        model: an attnlab model, or a lone :class:`~attnlab.nn.MultiHeadAttention`.

    Yields:
        The list, filled when the block ends.
    """
    patterns = [name for name, site in model_sites(model).items() if site.point == "pattern"]
    with trace(model, patterns) as traced:
        found: list[AttentionMap] = []
        yield found
        found.extend(traced_maps(traced))


@dataclass(frozen=True)
class AttentionView:
    """Every attention map of one forward pass.

    Attributes:
        records: one per attention module (kind, layer, weights (1, H, T_q, T_k)).
        axes: kind -> (query tokens, key tokens).
        output: the decoded sequence, the class, or the continuation, as text.
        probability: the class probability (classifiers), else None.
        distribution: (token or class, probability) pairs: every class (classifiers), or the
            ``top_k`` most likely next tokens right after the input (decoder-only); else None.
        off: the heads switched off in this pass (the run's held heads and those of ``head_mask``).
    """

    records: list[AttentionMap]
    axes: dict[str, tuple[list[str], list[str]]]
    output: str
    probability: float | None = None
    distribution: list[tuple[str, float]] | None = None
    off: tuple[HeadId, ...] = ()


@torch.no_grad()
def attention_view(
    loaded: LoadedRun,
    text: str,
    *,
    head_mask: Mapping[str, Tensor] | None = None,
    max_length: int = 64,
    top_k: int = 5,
    continuation: bool = False,
) -> AttentionView:
    """Run ``loaded.model`` on ``text`` and capture its attention.

    A language model's maps cover the prompt only, unless ``continuation``: then the prompt and
    the greedy continuation it is given (its ``output``, computed either way).

    The run's held heads (``train.mask_heads``) are off; ``head_mask`` switches more heads off
    (``loaded.held_mask(base=head_mask)``). An empty text, one longer than
    :data:`attnlab.limits.MAX_TEXT_CHARS` or one whose tokens exceed the context
    (``model.max_len``; a pretrained LM's ``task.max_tokens`` too) is a
    :class:`~attnlab.errors.UsageError`, raised before the model runs.
    """
    check_input_text(text)
    model = loaded.experiment.model_config_class
    if model.language_model:
        ids = language_model_prompt(loaded, text)
        context = loaded.task.generation_context
        max_length = check_decode_length(len(ids), max_length, config=loaded.model.config, context=context)
    else:
        ids = loaded.codec.encode(text)
        check_input_tokens(len(ids) + 1, context=loaded.model.config.max_len)  # + EOS
        if model.reads_source_and_target:  # decoding stops at the model's last position
            context = getattr(loaded.task, "generation_context", None)  # a pretrained one's max_tokens
            max_length = check_decode_length(1, max_length, config=loaded.model.config, context=context)  # after BOS
    mask = loaded.held_mask(base=head_mask)
    view = VIEWS[loaded.experiment.model_kind]
    found = view(loaded, ids, head_mask=mask, max_length=max_length, top_k=top_k, continuation=continuation)
    check_finite(found)
    return dataclasses.replace(with_sinks(found), off=tuple(heads_off(loaded.model, mask)))


SINK = "<sink>"
"""The key label of an attention sink's share (gpt-oss), the last column of a map that has one."""

SINK_TOLERANCE = 1e-4
"""How far below 1 a pattern's row must sum to hold a sink's share (softmax rows sum to 1 to rounding)."""


def with_sinks(view: AttentionView) -> AttentionView:
    """``view`` with each map of a kind whose rows sum below 1 (a learned sink logit in the softmax,
    gpt-oss's: the pattern site drops it) given a last key column ``<sink>``, 1 - sum_k pattern[q, k]:
    the share of each query's attention the sink takes, shown in the pictures and the viewer."""
    sunk = {r.kind for r in view.records if float((1 - r.weights.float().sum(-1)).abs().max()) > SINK_TOLERANCE}
    if not sunk:
        return view
    records = [
        dataclasses.replace(r, weights=torch.cat([r.weights, 1 - r.weights.sum(-1, keepdim=True)], dim=-1))
        if r.kind in sunk
        else r
        for r in view.records
    ]
    axes = {kind: (q, [*k, SINK] if kind in sunk else k) for kind, (q, k) in view.axes.items()}
    return dataclasses.replace(view, records=records, axes=axes)


def check_finite(view: AttentionView) -> None:
    """Refuse maps that hold NaN or infinity (a model that overflowed, in fp16 say): drawn or sent
    to the viewer, they would be drawn as zeros or break its JSON.

    Raises:
        UsageError: naming the first kind and layer whose weights are not finite.
    """
    for record in view.records:
        if not torch.isfinite(record.weights).all():
            raise UsageError(f"{record.kind} layer {record.layer}: the attention weights hold NaN or infinity")


def language_model_prompt(loaded: LoadedRun, text: str, *, chat: bool = False, what: str = "TEXT") -> list[int]:
    """The ids a language model reads for ``text``: its task's own prompt (``BOS text`` for a model
    trained here; the model's framing, BOS or none, for a pretrained LM; with ``chat`` the model's
    chat template around it), within its context.

    Raises:
        UsageError: naming ``what``, the prompt is longer than the context (the task's, else
        ``model.max_len``).
    """
    task, config = loaded.task, loaded.model.config
    ids = task.generation_prompt(text, chat=chat)
    context = config.max_len if task.generation_context is None else min(task.generation_context, config.max_len)
    check_input_tokens(len(ids), context=context, what=what)
    return ids


def generation_ids(
    loaded: LoadedRun, text: str, new: int, *, chat: bool = False, what: str = "TEXT"
) -> tuple[list[int], int]:
    """The ids a model reads to write after ``text`` (a language model's whole prompt, its chat
    template with ``chat``; an encoder-decoder's or classifier's source without EOS) and how many
    new tokens it may write (``new``, fewer where its context ends).

    Raises:
        UsageError: naming ``what``: an empty text, a prompt longer than the context or leaving no
        room to write (the command line's checks, for Python callers too).
    """
    check_input_text(text, what=what)
    task, model, kind = loaded.task, loaded.model, loaded.experiment.model_config_class
    if kind.language_model:
        ids = language_model_prompt(loaded, text, chat=chat, what=what)
        return ids, check_decode_length(len(ids), new, config=model.config, context=task.generation_context)
    ids = loaded.codec.encode(text)
    check_input_tokens(len(ids) + 1, context=model.config.max_len, what=what)  # + EOS
    if kind.predicts_class:
        return ids, new
    context = getattr(task, "generation_context", None)  # a pretrained encoder-decoder's max_tokens
    return ids, check_decode_length(1, new, config=model.config, context=context)  # the decoder starts at BOS


def continuation_ids(loaded: LoadedRun, text: str) -> list[int]:
    """The ids of ``text`` read as a continuation of a prompt: without the model's framing (no
    BOS where the model puts one before a prompt)."""
    return loaded.tokenizer.encode(text) if loaded.tokenizer is not None else loaded.codec.encode(text)


def answer_token(loaded: LoadedRun, text: str | int, flag: str) -> int:
    """The id of ``text`` where it is one token as a continuation (:func:`continuation_ids`): an
    answer whose logit is measured; an id of the vocabulary is taken as it is.

    Raises:
        UsageError: naming ``flag``, the text and its tokens, where it is not one token; an id
        outside the vocabulary.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        vocabulary = loaded.model.config.vocab_size
        if not 0 <= text < vocabulary:
            raise UsageError(f"{flag}: id {text} lies outside the vocabulary [0, {vocabulary})")
        return text
    if not isinstance(text, str):
        raise UsageError(f"{flag}: a text of one token or a token id is needed, got {type(text).__name__}")
    ids = continuation_ids(loaded, text)
    if len(ids) != 1:
        shown = " ".join(repr(t) for t in loaded.codec.tokens(ids))
        raise UsageError(f"{flag}: {text!r} is {len(ids)} tokens ({shown}); give text that is one token")
    return ids[0]


def decode_source(loaded: LoadedRun, ids: list[int], options: DecodeOptions, head_mask: Any = None) -> Hypothesis:
    """An encoder-decoder's output for the source ``ids`` (EOS appended), decoded from the task's
    start id with ``options`` and ``head_mask``, never writing the task's banned ids (a pretrained
    model's ``generation_banned``; else its padding and start ids)."""
    task, model = loaded.task, loaded.model
    return decode(
        model,
        torch.tensor([ids + [task.eos_id]], device=model_device(model)),
        bos_id=task.bos_id,
        eos_id=task.eos_id,
        pad_id=task.pad_id,
        options=options,
        head_mask=head_mask,
        banned=getattr(task, "generation_banned", None),
    )[0]


def _seq2seq_view(
    loaded: LoadedRun, ids: list[int], *, head_mask, max_length: int, top_k: int, continuation: bool
) -> AttentionView:  # noqa: ANN001
    """Decode greedily, then one teacher-forced pass over (source, BOS + output) records all kinds."""
    task, codec, model = loaded.task, loaded.codec, loaded.model
    hypothesis = decode_source(loaded, ids, DecodeOptions(max_length=max_length), head_mask)
    src = torch.tensor([ids + [task.eos_id]], device=model_device(model))
    tgt_in = torch.tensor([[task.bos_id, *hypothesis.tokens]], device=src.device)
    with attention_maps(model) as records, masking_heads(model, head_mask):
        model(src, tgt_in)
    source = codec.tokens(ids) + ["</s>"]
    target = ["<s>"] + codec.tokens(hypothesis.tokens)
    axes = {"encoder_self": (source, source), "decoder_self": (target, target), "cross": (target, source)}
    return AttentionView(records, axes, codec.decode(hypothesis.tokens))


def _classifier_view(
    loaded: LoadedRun, ids: list[int], *, head_mask, max_length: int, top_k: int, continuation: bool
) -> AttentionView:  # noqa: ANN001
    """The label read at the EOS position (Hahn §3), with every class's probability."""
    task, codec, model = loaded.task, loaded.codec, loaded.model
    tokens = torch.tensor([ids + [task.eos_id]], device=model_device(model))
    with attention_maps(model) as records, masking_heads(model, head_mask):
        probs = torch.softmax(model(tokens), -1)[0]
    labels = codec.tokens(ids) + ["</s>"]
    label = int(probs.argmax())
    classes = [(str(index), float(p)) for index, p in enumerate(probs)]
    return AttentionView(records, {"self": (labels, labels)}, str(label), float(probs[label]), classes)


def _language_model_view(  # noqa: ANN001
    loaded: LoadedRun, ids: list[int], *, head_mask, max_length: int, top_k: int, continuation: bool
) -> AttentionView:
    """The greedy continuation of the prompt ``ids``, the next-token distribution right after it,
    and the maps over the prompt (with ``continuation``, over prompt + continuation). Every
    position is a real token (``is_token``): a pretrained LM's padding id may be a real token
    (SmolLM2's is its EOS)."""
    task, codec, model = loaded.task, loaded.codec, loaded.model
    hypothesis = generate_continuations(
        model,
        [ids],
        eos_id=task.eos_id,
        banned=task.generation_banned,
        options=DecodeOptions(max_length=max_length),
        head_mask=head_mask,
    )[0]
    drawn = ids + hypothesis.tokens if continuation else ids
    full = torch.tensor([drawn], device=model_device(model))
    with attention_maps(model) as records, masking_heads(model, head_mask):
        logits = model(full, is_token=torch.ones_like(full, dtype=torch.bool))
    labels = codec.tokens(drawn)
    next_token = torch.softmax(logits[0, len(ids) - 1].float(), -1)
    values, indices = next_token.topk(min(top_k, next_token.numel()))
    top = [(codec.tokens([int(i)])[0], float(v)) for v, i in zip(values, indices, strict=True)]
    return AttentionView(records, {"self": (labels, labels)}, codec.decode(hypothesis.tokens), distribution=top)


def _encoder_view(
    loaded: LoadedRun, ids: list[int], *, head_mask, max_length: int, top_k: int, continuation: bool
) -> AttentionView:  # noqa: ANN001
    """A sentence encoder reads ``[CLS] text [SEP]`` once; the output summarises the sentence embedding."""
    tokens = torch.tensor([ids], device=model_device(loaded.model))
    with attention_maps(loaded.model) as records, masking_heads(loaded.model, head_mask):
        hidden = loaded.model(tokens)
    pooling = loaded.task.pooling
    embedding = POOLINGS[pooling](hidden, tokens != loaded.task.pad_id)[0]
    labels = loaded.codec.tokens(ids)
    shown = " ".join(f"{float(v):+.3f}" for v in embedding[:4])
    output = f"sentence embedding ({pooling} pooling, {embedding.numel()} values): {shown} ..."
    return AttentionView(records, {"self": (labels, labels)}, output)


VIEWS = {
    "encoder_decoder": _seq2seq_view,
    "encoder_classifier": _classifier_view,
    "decoder_only": _language_model_view,
    "encoder": _encoder_view,
}
"""Registry: model kind -> how to run one input and capture its attention."""


def kind_maps(view: AttentionView, kind: str) -> list[np.ndarray]:
    """The maps of one kind, one (H_l, T_q, T_k) array per layer, layer 0 first (batch row 0).

    A list, not one array: after physical pruning, layers may keep different numbers of heads
    (``model.heads_per_layer``). ``np.stack`` it when they do not.

    Raises:
        KeyError: ``view`` holds no map of ``kind``.
    """
    records = sorted((r for r in view.records if r.kind == kind), key=lambda r: r.layer)
    if not records:
        raise KeyError(kind)
    return [r.weights[0].float().cpu().numpy() for r in records]
