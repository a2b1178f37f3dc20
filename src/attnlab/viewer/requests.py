"""What the page may ask for, checked: the input text and the heads switched off.

Every problem is a :class:`~attnlab.errors.UsageError` whose message names the field at fault; the
server answers it with status 400. The caps keep one request small enough that the page never
freezes: longer inputs get a message instead of a run.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from attnlab.errors import UsageError
from attnlab.head_ids import HeadId

__all__ = [
    "MAX_INPUT_CHARS",
    "MAX_INPUT_TOKENS",
    "MAX_OUTPUT_TOKENS",
    "RunRequest",
    "parse_run_request",
    "parse_head_object",
    "check_input_length",
]

MAX_INPUT_CHARS = 500
"""Longest input text, in characters, checked before tokenizing."""
MAX_INPUT_TOKENS = 48
"""Longest input, in tokens: every map is at most this wide (plus the special tokens)."""
MAX_OUTPUT_TOKENS = 32
"""Most tokens the viewer decodes or generates."""

_RUN_FIELDS = ("text", "off")
_HEAD_FIELDS = ("kind", "layer", "head")


@dataclass(frozen=True)
class RunRequest:
    """Run the model on ``text`` with the heads in ``off`` switched off."""

    text: str
    off: tuple[HeadId, ...]


def parse_run_request(body: Any, heads: Collection[HeadId]) -> RunRequest:
    """Check a decoded JSON body ``{"text": str, "off": [{"kind", "layer", "head"}, ...]}``.

    ``off`` may be left out (no head off). ``heads`` are the model's heads
    (:func:`attnlab.head_ids.head_ids`).
    """
    if not isinstance(body, dict):
        raise UsageError('the request body must be a JSON object like {"text": "...", "off": []}')
    unknown = sorted(set(body) - set(_RUN_FIELDS))
    if unknown:
        raise UsageError(f"unknown field {unknown[0]!r}; allowed: {', '.join(_RUN_FIELDS)}")
    text = body.get("text")
    if not isinstance(text, str):
        raise UsageError('"text" must be a string')
    if len(text) > MAX_INPUT_CHARS:
        raise UsageError(f"the input is {len(text)} characters long; the viewer takes at most {MAX_INPUT_CHARS}")
    off = body.get("off", [])
    if not isinstance(off, list):
        raise UsageError('"off" must be a list of {"kind", "layer", "head"} objects')
    chosen = (parse_head_object(item, heads, where=f"off[{index}]") for index, item in enumerate(off))
    return RunRequest(text, tuple(dict.fromkeys(chosen)))


def parse_head_object(item: Any, heads: Collection[HeadId], *, where: str) -> HeadId:
    """``{"kind": str, "layer": int, "head": int}`` -> a head of the model, or a UsageError naming ``where``."""
    if not isinstance(item, dict) or sorted(item) != sorted(_HEAD_FIELDS):
        raise UsageError(f'{where} must be an object with exactly "kind", "layer" and "head"')
    kind, layer, head = item["kind"], item["layer"], item["head"]
    kinds = sorted({h.kind for h in heads})
    if kind not in kinds:
        raise UsageError(f"{where}.kind: this model has no {kind!r} attention; it has: {', '.join(kinds)}")
    layers = sorted({h.layer for h in heads if h.kind == kind})
    if not _is_index(layer) or layer not in layers:
        raise UsageError(f"{where}.layer: {kind} has layers 0 to {layers[-1]}, got {layer!r}")
    per_layer = sorted(h.head for h in heads if h.kind == kind and h.layer == layer)
    if not _is_index(head) or head not in per_layer:
        raise UsageError(f"{where}.head: {kind} layer {layer} has heads 0 to {per_layer[-1]}, got {head!r}")
    return HeadId(kind, layer, head)


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_input_length(tokens: int) -> None:
    """Refuse inputs longer than :data:`MAX_INPUT_TOKENS` tokens."""
    if tokens > MAX_INPUT_TOKENS:
        raise UsageError(
            f"the input is {tokens} tokens long; the viewer shows at most {MAX_INPUT_TOKENS} so that the page stays quick"
        )
