"""A run of the model as the JSON the page draws: the output, the maps of a page of layers, and
a thumbnail of every head (:mod:`attnlab.viewer.overview`).

Token text goes into JSON as it is; the page puts it into the document only as text nodes, so an
input such as ``"><img src=x onerror=alert(1)>`` shows as text (see ``static/viewer.js``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from attnlab.analysis.maps import AttentionView, attention_view, kind_maps
from attnlab.errors import UsageError
from attnlab.head_ids import KIND_TITLES, HeadId, head_ids, mask_without
from attnlab.nn import TransformerConfig
from attnlab.run.loaded import LoadedRun
from attnlab.viewer.importance import Importance
from attnlab.viewer.overview import overview_json
from attnlab.viewer.requests import Limits, RequestError, RunRequest, check_input_length, viewer_limits

__all__ = [
    "describe_model",
    "example_input",
    "run_payload",
    "run_limits",
    "kind_info",
    "head_json",
    "output_json",
    "maps_json",
    "DECIMALS",
]

DECIMALS = 4
"""Attention weights are rounded to this many decimals: enough for a picture, a small response."""


def run_limits(loaded: LoadedRun) -> Limits:
    """The viewer's caps for ``loaded`` (:func:`~attnlab.viewer.requests.viewer_limits`)."""
    return viewer_limits(head_ids(loaded.model), task_name=loaded.experiment.task_name, context=_context(loaded))


def _context(loaded: LoadedRun) -> int:
    """The most positions the model reads: ``model.max_len``, or a pretrained LM's ``max_tokens`` if fewer."""
    context = getattr(loaded.task, "generation_context", None)
    return loaded.model.config.max_len if context is None else min(context, loaded.model.config.max_len)


def describe_model(loaded: LoadedRun, importance: Importance | None = None) -> dict[str, Any]:
    """What the page needs before the first run: the model kind, its heads, the heads held at zero
    by ``train.mask_heads`` (always off), the caps (with how many layers one answer holds)."""
    heads = head_ids(loaded.model)
    limits = run_limits(loaded)
    return {
        "run": loaded.name,
        "model_kind": loaded.experiment.model_kind,
        "task": loaded.experiment.task_name,
        "attention": str(loaded.experiment.model.get("attention", "soft")),
        "heads": [kind_info(kind, heads) for kind in dict.fromkeys(h.kind for h in heads)],
        "held": [head_json(h) for h in loaded.held_heads],
        "limits": {
            "max_input_chars": limits.max_input_chars,
            "max_input_tokens": limits.max_input_tokens,
            "max_output_tokens": limits.max_output_tokens,
            "layers_per_page": limits.layers_per_page,
        },
        "importance": importance,
        "example": example_input(loaded),
    }


def kind_info(kind: str, heads: list[HeadId]) -> dict[str, Any]:
    """``GET /api/model``'s entry for one attention kind of ``heads``: its title, layers and heads per layer."""
    layers = max(h.layer for h in heads if h.kind == kind) + 1
    per_layer = [sum(1 for h in heads if h.kind == kind and h.layer == layer) for layer in range(layers)]
    return {
        "kind": kind,
        "title": KIND_TITLES.get(kind, kind),
        "layers": layers,
        "heads": max(per_layer),
        "heads_per_layer": per_layer,
    }


FALLBACK_EXAMPLE = "The quick brown fox jumps over the lazy dog."


def example_input(loaded: LoadedRun) -> str:
    """The first test example's input (a prompt of half its text for a language model), as text.

    A run whose task has no examples (an imported sentence encoder) gets a plain English sentence.
    """
    examples = loaded.task.split("test")
    if not examples:
        return FALLBACK_EXAMPLE
    example = examples[0]
    if example.source:
        return loaded.codec.decode(list(example.source[:-1]))  # without EOS
    target = list(example.target or ())
    return loaded.codec.decode(target[: max(1, len(target) // 2)])


def run_payload(
    loaded: LoadedRun, request: RunRequest, *, check: Callable[[AttentionView], None] | None = None
) -> dict[str, Any]:
    """Run ``loaded.model`` on ``request.text`` with ``request.off`` switched off; the JSON answer.

    The run's held heads (``train.mask_heads``) are off too, whatever ``off`` says: the model is
    the one ``attnlab eval`` measures, and the user switches heads off on top of it. The input is
    checked against the viewer's caps (:func:`run_limits`) and the model's context before the model
    runs; the output is at most ``max_output_tokens`` tokens, fewer where the context leaves less
    room. The answer holds the maps of ``request.layers`` only (default: the first page of layers),
    and the overview of every head's map pooled to a thumbnail (:func:`~attnlab.viewer.overview.overview_json`).
    ``check``, if given, sees the captured view before any of it is turned into JSON (and may raise).

    Raises:
        RequestError: (field ``"text"``) for an input the model cannot read (see
            :func:`~attnlab.viewer.requests.check_input_length`) or a symbol outside the task's alphabet.
    """
    model, limits = loaded.experiment.model_config_class, run_limits(loaded)
    try:
        ids = loaded.codec.encode(request.text)
        prompt = loaded.task.generation_prompt(request.text) if model.language_model else ids
    except UsageError as error:  # a symbol outside a synthetic task's alphabet
        raise RequestError(str(error), "text") from None
    extra = len(prompt) - len(ids) + 1 if model.language_model else None  # its BOS, if any, and one new token
    outputs = check_input_length(
        len(ids), model=model, context=_context(loaded), cap=limits.max_input_tokens, extra=extra
    )
    mask = mask_without(loaded.model, request.off) if request.off else None
    view = attention_view(loaded, request.text, head_mask=mask, max_length=outputs)
    if check is not None:
        check(view)
    layers = request.layers if request.layers is not None else tuple(range(limits.layers_per_page))
    return {
        "input": request.text,
        "tokens": loaded.codec.tokens(ids),
        "off": [head_json(h) for h in request.off],
        "held": [head_json(h) for h in loaded.held_heads],
        "output": output_json(model, view),
        "attention": maps_json(view, set(layers)),
        "overview": overview_json(view, view.off),
    }


def head_json(head: HeadId) -> dict[str, Any]:
    """A head as JSON: ``{"kind", "layer", "head"}``."""
    return {"kind": head.kind, "layer": head.layer, "head": head.head}


def output_json(model: type[TransformerConfig], view: AttentionView) -> dict[str, Any]:
    """The model's output in ``view`` as ``POST /api/run``'s ``output`` (see API.md): a class, a
    language model's continuation, or a sequence (an encoder-decoder's output, a sentence
    encoder's summary); ``model`` is the model's config class (``experiment.model_config_class``)."""
    if model.predicts_class:
        return {
            "type": "class",
            "label": view.output,
            "probability": view.probability,
            "classes": [{"label": label, "probability": p} for label, p in view.distribution or []],
        }
    if model.language_model:
        return {
            "type": "continuation",
            "text": view.output,
            "next_tokens": [{"token": token, "probability": p} for token, p in view.distribution or []],
        }
    return {"type": "sequence", "text": view.output}


def maps_json(view: AttentionView, layers: set[int]) -> list[dict[str, Any]]:
    """The maps of ``layers`` as ``POST /api/run``'s ``attention``: weights rounded to :data:`DECIMALS`."""
    maps = []
    for kind, (queries, keys) in view.axes.items():
        for layer, weights in enumerate(kind_maps(view, kind)):
            if layer not in layers:
                continue
            maps.append(
                {
                    "kind": kind,
                    "layer": layer,
                    "queries": queries,
                    "keys": keys,
                    "weights": weights.astype(float).round(DECIMALS).tolist(),
                }
            )
    return maps
