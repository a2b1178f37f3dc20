"""What the page may ask for, checked: the request body, the input text and the heads switched off.

Every problem is a :class:`RequestError` (a :class:`~attnlab.errors.UsageError`) whose message and
``field`` name the part at fault; the server answers it with its :attr:`~RequestError.status`: 400,
or 413 for a body over its route's cap (:class:`BodyTooLarge`). The caps keep one request
small enough that the page never freezes: longer inputs get a message instead of a run. Bodies are
checked before they are parsed: UTF-8 text, at most :data:`MAX_JSON_DEPTH` levels of nesting (so a
body of 100,000 ``[`` never reaches the recursive JSON parser), then JSON.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from attnlab.errors import UsageError
from attnlab.head_ids import HeadId

if TYPE_CHECKING:  # the request checks load no torch
    from attnlab.nn import TransformerConfig

__all__ = [
    "MAX_JSON_DEPTH",
    "MAX_INPUT_CHARS",
    "MAX_INPUT_TOKENS",
    "MAX_OUTPUT_TOKENS",
    "MAX_PRETRAINED_INPUT_CHARS",
    "MAX_PRETRAINED_INPUT_TOKENS",
    "PAGE_HEADS",
    "HEADS_PER_PAGE",
    "Limits",
    "viewer_limits",
    "RequestError",
    "BodyTooLarge",
    "RunRequest",
    "decode_json_body",
    "parse_run_request",
    "parse_head_object",
    "check_input_length",
]

MAX_JSON_DEPTH = 8
"""Deepest nesting of arrays and objects a JSON body may have (a run request needs 3)."""

MAX_INPUT_CHARS = 500
"""Longest input text, in characters, checked before tokenizing."""
MAX_INPUT_TOKENS = 48
"""Longest input, in tokens: every map is at most this wide (plus the special tokens)."""
MAX_OUTPUT_TOKENS = 32
"""Most tokens the viewer decodes or generates."""
MAX_PRETRAINED_INPUT_TOKENS = 512
"""Longest input of a pretrained language model (``pretrained_lm`` runs), in tokens, or its context
if shorter: real text runs to hundreds of tokens. The answer stays small because it holds one page
of layers (:data:`PAGE_HEADS`)."""
MAX_PRETRAINED_INPUT_CHARS = 4096
"""Longest input text of a pretrained language model, in characters (8 per token of the cap)."""
PAGE_HEADS = 64
"""A model with more heads than this (SmolLM2: 270) is shown one page of layers at a time."""
HEADS_PER_PAGE = 16
"""A page of layers holds at most this many heads, and at least one layer: one layer of 9 heads for
SmolLM2 (the maps of a 300-token input are then about 1 million weights, 7 MB of JSON)."""

_RUN_FIELDS = ("text", "off", "layers")
_HEAD_FIELDS = ("kind", "layer", "head")
_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"?|[\[\]{}]')
"""A JSON string (to its closing quote or the end of the text) or a bracket: one left-to-right pass."""


class RequestError(UsageError):
    """A request the viewer cannot carry out; ``field`` names the part at fault (``"body"``,
    ``"text"``, ``"off[0].layer"``, a header such as ``"Content-Length"``), :attr:`status` is the
    HTTP status it is answered with."""

    status: int = 400

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


class BodyTooLarge(RequestError):
    """A request body over its route's cap (field ``"body"``): status 413, Content Too Large."""

    status = 413

    def __init__(self, message: str) -> None:
        super().__init__(message, "body")


def decode_json_body(body: bytes) -> Any:
    """The JSON value of a request body: UTF-8 text, at most :data:`MAX_JSON_DEPTH` levels deep.

    Raises:
        RequestError: (field ``"body"``) for bytes that are not UTF-8, nesting deeper than the
            cap, or text that is not JSON.
    """
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as error:
        raise RequestError(f"the request body is not UTF-8 text (byte {error.start})", "body") from None
    if _nesting_exceeds(text, MAX_JSON_DEPTH):
        raise RequestError(f"the request body nests JSON more than {MAX_JSON_DEPTH} levels deep", "body")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as error:
        raise RequestError(f"the request body is not valid JSON: {error}", "body") from None


def _nesting_exceeds(text: str, limit: int) -> bool:
    """True when the brackets outside JSON strings of ``text`` nest deeper than ``limit``.

    Linear in the text and stops at the first bracket past the limit; it only counts, so text that
    is not JSON at all passes here and fails in the parser.
    """
    depth = 0
    for token in _JSON_TOKEN.finditer(text):
        symbol = token.group()[0]
        if symbol != '"':
            depth += 1 if symbol in "[{" else -1
            if depth > limit:
                return True
    return False


@dataclass(frozen=True)
class Limits:
    """The viewer's caps for one run (``GET /api/model``'s ``limits``).

    Attributes:
        max_input_chars: longest input text, in characters.
        max_input_tokens: longest input, in tokens.
        max_output_tokens: most tokens decoded or generated.
        layers_per_page: most layers one answer holds: every layer for a model of at most
            :data:`PAGE_HEADS` heads, else pages of :data:`HEADS_PER_PAGE` heads (at least one layer).
    """

    max_input_chars: int
    max_input_tokens: int
    max_output_tokens: int
    layers_per_page: int


def viewer_limits(heads: Collection[HeadId], *, task_name: str, context: int) -> Limits:
    """The caps for a run of ``heads`` (:func:`attnlab.head_ids.head_ids`) on task ``task_name``
    whose model reads ``context`` positions: a pretrained LM takes inputs of up to
    ``min(context, MAX_PRETRAINED_INPUT_TOKENS)`` tokens, other runs :data:`MAX_INPUT_TOKENS`."""
    layers = max(head.layer for head in heads) + 1
    widest = max(sum(1 for h in heads if (h.kind, h.layer) == (head.kind, head.layer)) for head in heads)
    per_page = layers if len(heads) <= PAGE_HEADS else max(1, HEADS_PER_PAGE // widest)
    if task_name == "pretrained_lm":
        tokens = min(context, MAX_PRETRAINED_INPUT_TOKENS)
        return Limits(MAX_PRETRAINED_INPUT_CHARS, tokens, MAX_OUTPUT_TOKENS, per_page)
    return Limits(MAX_INPUT_CHARS, MAX_INPUT_TOKENS, MAX_OUTPUT_TOKENS, per_page)


@dataclass(frozen=True)
class RunRequest:
    """Run the model on ``text`` with the heads in ``off`` switched off; answer with the maps of
    ``layers`` (None: the first page, :attr:`Limits.layers_per_page` layers from layer 0)."""

    text: str
    off: tuple[HeadId, ...]
    layers: tuple[int, ...] | None = None


def parse_run_request(body: Any, heads: Collection[HeadId], limits: Limits | None = None) -> RunRequest:
    """Check a decoded JSON body ``{"text": str, "off": [{"kind", "layer", "head"}, ...], "layers": [int, ...]}``.

    ``off`` may be left out (no head off), ``layers`` too (the first page of layers). ``heads`` are
    the model's heads (:func:`attnlab.head_ids.head_ids`); ``limits`` its caps (default: a trained
    run's, every layer on one page).

    Raises:
        RequestError: naming the field: not an object, an unknown field, ``text`` not a string,
            empty, not valid Unicode or over ``limits.max_input_chars``, a bad ``off``, ``layers``
            not a list of distinct layers of the model or longer than ``limits.layers_per_page``.
    """
    if limits is None:
        limits = viewer_limits(heads, task_name="", context=MAX_INPUT_TOKENS)
    if not isinstance(body, dict):
        raise RequestError('the request body must be a JSON object like {"text": "...", "off": []}', "body")
    unknown = sorted(set(body) - set(_RUN_FIELDS))
    if unknown:
        raise RequestError(f"unknown field {_shown(unknown[0])}; allowed: {', '.join(_RUN_FIELDS)}", unknown[0])
    text = _check_text(body.get("text"), limits.max_input_chars)
    off = body.get("off", [])
    if not isinstance(off, list):
        raise RequestError('"off" must be a list of {"kind", "layer", "head"} objects', "off")
    chosen = (parse_head_object(item, heads, where=f"off[{index}]") for index, item in enumerate(off))
    layers = _check_layers(body["layers"], heads, limits.layers_per_page) if "layers" in body else None
    return RunRequest(text, tuple(dict.fromkeys(chosen)), layers)


def _check_layers(layers: Any, heads: Collection[HeadId], per_page: int) -> tuple[int, ...]:
    """``layers``: a non-empty list of at most ``per_page`` distinct layer numbers of the model."""
    deepest = max(head.layer for head in heads)
    if not isinstance(layers, list) or not layers:
        raise RequestError('"layers" must be a non-empty list of layer numbers, such as [0]', "layers")
    if len(layers) > per_page:
        raise RequestError(f'"layers": ask for at most {per_page} layers at a time, got {len(layers)}', "layers")
    for index, layer in enumerate(layers):
        if not _is_index(layer) or not 0 <= layer <= deepest:
            raise RequestError(f"layers[{index}]: the model has layers 0 to {deepest}, got {_shown(layer)}", "layers")
    if len(set(layers)) != len(layers):
        raise RequestError('"layers" names a layer twice', "layers")
    return tuple(layers)


def _check_text(text: Any, cap: int) -> str:
    if not isinstance(text, str):
        raise RequestError('"text" must be a string', "text")
    if not text:
        raise RequestError('"text" is empty: type an input', "text")
    if len(text) > cap:
        raise RequestError(f"the input is {len(text)} characters long; the viewer takes at most {cap}", "text")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:  # a lone surrogate such as "\ud800"
        message = f'"text" is not valid Unicode: character {error.start} is a lone surrogate'
        raise RequestError(message, "text") from None
    return text


def parse_head_object(item: Any, heads: Collection[HeadId], *, where: str) -> HeadId:
    """``{"kind": str, "layer": int, "head": int}`` -> a head of the model, or a RequestError naming ``where``."""
    if not isinstance(item, dict) or sorted(item) != sorted(_HEAD_FIELDS):
        raise RequestError(f'{where} must be an object with exactly "kind", "layer" and "head"', where)
    kind, layer, head = item["kind"], item["layer"], item["head"]
    kinds = sorted({h.kind for h in heads})
    if not isinstance(kind, str) or kind not in kinds:
        raise RequestError(
            f"{where}.kind: this model has no {_shown(kind)} attention; it has: {', '.join(kinds)}", f"{where}.kind"
        )
    layers = sorted({h.layer for h in heads if h.kind == kind})
    if not _is_index(layer) or layer not in layers:
        raise RequestError(f"{where}.layer: {kind} has layers 0 to {layers[-1]}, got {_shown(layer)}", f"{where}.layer")
    per_layer = sorted(h.head for h in heads if h.kind == kind and h.layer == layer)
    if not _is_index(head) or head not in per_layer:
        raise RequestError(
            f"{where}.head: {kind} layer {layer} has heads 0 to {per_layer[-1]}, got {_shown(head)}", f"{where}.head"
        )
    return HeadId(kind, layer, head)


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters: a message stays one short line."""
    return cut(repr(value), limit)


def cut(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, ending in "..." when cut."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_input_length(
    tokens: int,
    *,
    model: type[TransformerConfig],
    context: int,
    cap: int = MAX_INPUT_TOKENS,
    extra: int | None = None,
) -> int:
    """Check an input of ``tokens`` tokens against the viewer's cap and the model's context.

    Args:
        tokens: the input's length in tokens (the codec's ids, without BOS or EOS).
        model: the model's config class (``experiment.model_config_class``), which says how many
            positions an input takes beside its tokens and where the output must fit.
        context: the most positions the model reads (``max_len``; a pretrained LM's ``max_tokens`` too).
        cap: the viewer's cap (:attr:`Limits.max_input_tokens`).
        extra: positions the input takes beside its tokens; default ``model.input_extra_positions``:
            EOS (encoder-decoder, classifier), BOS and one generated token (decoder-only), none (encoder).

    Returns:
        The most output tokens to decode or generate: :data:`MAX_OUTPUT_TOKENS`, fewer where the
        model's context leaves less room (BOS plus the output must fit, after the prompt for a
        decoder-only model).

    Raises:
        RequestError: (field ``"text"``) for an input of no tokens, over ``cap``, or longer than
            the context takes.
    """
    if tokens == 0:
        raise RequestError('"text" has no tokens: type an input', "text")
    if tokens > cap:
        raise RequestError(
            f"the input is {tokens} tokens long; the viewer shows at most {cap} so that the page stays quick", "text"
        )
    if extra is None:
        extra = model.input_extra_positions
    if tokens + extra > context:
        raise RequestError(
            f"the input is {tokens} tokens long; this model reads at most {context} positions, "
            f"so it takes at most {context - extra} input tokens",
            "text",
        )
    if model.language_model:  # the continuation follows the prompt in the same context
        return min(MAX_OUTPUT_TOKENS, context - (extra - 1) - tokens)
    if model.reads_source_and_target:  # the decoder writes from BOS to the model's last position
        return min(MAX_OUTPUT_TOKENS, context - 1)
    return MAX_OUTPUT_TOKENS
