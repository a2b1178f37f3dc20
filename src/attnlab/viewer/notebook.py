"""The viewer's head view and model view, and a patterns view, inline in Jupyter, as one
self-contained HTML fragment.

    import attnlab
    attnlab.show("runs/demo", "abcd")                       # the model view of a run on one input
    attnlab.show(run, "abcd", view="head", layer=1, off=["cross:0:1"])
    show_patterns(run, "the cat sat", layer=1, heads=[0, 2])  # a layer's heads on the text's tokens
    with attnlab.trace(model, "*.pattern") as traced:        # any attnlab model, no run directory
        model(tokens)
    attnlab.show_records(traced, ["<s>", "a", "b"])

No server is involved: the object returned has ``_repr_html_``, which Jupyter (Lab, Notebook, VS
Code) renders as a ``<div>`` with a unique id holding the view's CSS, the data as JSON in a
``<script type="application/json">`` element, and the drawing script (``static/draw.js``, the very
code the viewer page draws with, and ``static/notebook.js``). The maps are the viewer's own
(:func:`attnlab.viewer.payload.run_payload`: the same caps, rounding and held heads); a run is
computed once, in Python, so switching heads off is done by asking again with ``off=``.

Token text is untrusted (a token may be ``</script><img src=x onerror=...>``). It reaches the page
only inside the JSON, where every ``<``, ``>`` and ``&`` is written as ``\\u003c``, ``\\u003e``,
``\\u0026``, so the HTML parser cannot see a tag in it; the script puts it into the document only as
text nodes, as the viewer page does.

A model of many heads (SmolLM2: 30 layers of 9 heads) is shown a page of layers at a time, as the
viewer pages it (:attr:`attnlab.viewer.requests.Limits.layers_per_page`); every layer asked for is
embedded, at most :data:`MAX_EMBEDDED_WEIGHTS` numbers (``layers=`` embeds fewer). Above the pages,
the model view has the viewer's overview of every head of every layer (thumbnails pooled to 16 x 16,
:mod:`attnlab.viewer.overview`, a few hundred bytes a head); clicking one shows its layer's page.

The patterns view (``view="patterns"``, :func:`show_patterns`) is CircuitsVis' attention patterns
drawn with the same code: one layer at a time, a button per head with its heatmap, the chosen head's
map drawn large, and the tokens coloured by the attention the token pointed at (or clicked) pays to
each of them, with the weight under each token.
"""

from __future__ import annotations

import html
import json
import os
import re
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from attnlab.analysis.maps import AttentionMap, AttentionView, check_finite, traced_maps
from attnlab.errors import UsageError
from attnlab.head_ids import HeadId, head_ids, parse_head, parse_head_name
from attnlab.nn.trace import Trace
from attnlab.resources import check_input_text
from attnlab.run.loaded import LoadedRun, open_run
from attnlab.run.storage import atomic_write_text
from attnlab.viewer.overview import overview_json
from attnlab.viewer.payload import head_json, kind_info, maps_json, run_limits, run_payload
from attnlab.viewer.requests import MAX_INPUT_TOKENS, RunRequest, viewer_limits

__all__ = ["AttentionHTML", "show", "show_patterns", "show_records", "VIEWS", "MAX_EMBEDDED_WEIGHTS", "json_for_html"]

STATIC_DIR = Path(__file__).with_name("static")
VIEWS = ("model", "head", "patterns")
"""``model``: a heatmap per head, a page of layers at a time; ``head``: lines between tokens, one layer;
``patterns``: one layer's heads, one head's map large, the tokens coloured by a query's attention."""
MAX_EMBEDDED_WEIGHTS = 2_000_000
"""Most attention weights one view embeds (about 14 MB of JSON): a bigger one asks for ``layers=``."""

_ELEMENT_ID = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")
_HTML_ESCAPES = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}


@dataclass(frozen=True)
class AttentionHTML:
    """One attention view, drawn by Jupyter from :meth:`_repr_html_` (or saved with :meth:`save`).

    Attributes:
        payload: the data the view draws: ``heads`` (per kind: title, layers, heads per layer),
            ``attention`` (maps as in the viewer's ``POST /api/run``: kind, layer, queries, keys,
            weights (heads, queries, keys) rounded to 4 decimals; with ``heads=`` only those heads'
            weights, their numbers in the map's ``heads``), ``overview`` (every head's thumbnail, as
            in ``POST /api/run``; None in the patterns view), ``off``, ``held``, ``output`` (None for
            traced maps), ``tokens``, ``pages`` (the layers of each page) and the view's start
            (``view``, ``kind``, ``layer``).
    """

    payload: dict[str, Any]

    def _repr_html_(self) -> str:
        return self.html()

    def html(self, element_id: str | None = None) -> str:
        """The self-contained HTML fragment: a ``<div>`` holding the CSS, the data and the script.

        Args:
            element_id: the container's id; default a new unique one on every call, so that views
                shown several times in one notebook (or the same view twice) never share one.
        """
        element_id = element_id or f"attnlab-view-{uuid.uuid4().hex}"
        if not _ELEMENT_ID.fullmatch(element_id):
            raise UsageError(f"element_id: {element_id!r} is not a plain HTML id (letters, digits, '-', '_')")
        return (
            f'<div id="{element_id}" class="attnlab-nb" data-view="{self.payload["view"]}">'
            f"<style>{_asset('notebook.css')}</style>"
            '<p class="attnlab-nb-fallback">This attnlab attention view is drawn by JavaScript: run the cell '
            "again, or trust the notebook, to see it.</p>"
            f'<script type="application/json" class="attnlab-nb-data">{json_for_html(self.payload)}</script>'
            f"<script>{_asset('draw.js')}\n{_asset('notebook.js')}\n"
            f'attnlabNotebook.render(document.getElementById("{element_id}"));</script>'
            "</div>"
        )

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the view as a standalone HTML page (opens in any browser, no server); returns the path."""
        title = html.escape(self.payload["title"])
        page = f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title></head>'
        path = Path(path)
        atomic_write_text(path, f"{page}<body>{self.html()}</body></html>\n")  # never half a page
        return path


def json_for_html(value: Any) -> str:
    """``value`` as JSON that is safe inside an HTML ``<script>`` element: ``<``, ``>``, ``&`` (and the
    line separators U+2028/U+2029) are written as ``\\u`` escapes, which JSON reads back unchanged."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return "".join(_HTML_ESCAPES.get(char, char) for char in text)


@cache
def _asset(name: str) -> str:
    """A static file to inline; it must not be able to end the element it is inlined into."""
    text = (STATIC_DIR / name).read_text(encoding="utf-8")
    if "</" in text or "<!--" in text:
        raise RuntimeError(f"viewer/static/{name} contains '</' or '<!--' and cannot be inlined in HTML")
    return text


def show(
    run: LoadedRun | str | os.PathLike[str],
    text: str,
    *,
    view: str = "model",
    layer: int | None = None,
    layers: Iterable[int] | None = None,
    off: Iterable[HeadId | str] = (),
    heads: Iterable[int] | None = None,
) -> AttentionHTML:
    """Run a trained run on ``text`` and show its attention as the viewer does, inline in Jupyter.

    Args:
        run: a run directory, or a run opened with :func:`attnlab.run.loaded.open_run`.
        text: the input, as typed in the viewer (the viewer's caps apply: 48 tokens, or 512 for a
            pretrained LM, and the model's context).
        view: ``"model"`` (a heatmap per head), ``"head"`` (lines between tokens) or
            ``"patterns"`` (one layer's heads on the tokens, as :func:`show_patterns`).
        layer: the layer shown first (default 0): the head view's layer, the model view's page.
        layers: the layers to embed (default: all). Only these can be shown.
        off: heads to switch off (``HeadId`` or ``"kind:layer:head"``): their entry of the head mask
            ξ becomes 0 (Michel §2.3). The run's held heads (``train.mask_heads``) are off in any case.
        heads: the heads of each layer to draw (default: all); only their maps are embedded. The
            model view's overview still shows every head.

    Returns:
        An :class:`AttentionHTML` (the output is in its ``payload``, the maps in ``payload["attention"]``).

    Raises:
        UsageError: a bad ``view``, ``layer``, ``layers``, ``heads`` or head name; an input the model
            cannot read.
    """
    _check_view(view)
    loaded = _open(run)
    every = head_ids(loaded.model)
    embedded = _check_layers(layers, every, layer)
    drawn = _check_heads(heads, every, embedded)
    stopped = _run_off(off, loaded)
    request = RunRequest(text=text, off=stopped, layers=embedded)
    found = run_payload(loaded, request, check=lambda view: _check_size(view.records, embedded, drawn))
    title = f"run {loaded.name}: {loaded.experiment.model_kind.replace('_', ' ')}, input {text!r}"
    per_page = run_limits(loaded).layers_per_page
    return _view(found, every, embedded, drawn, view=view, layer=layer, title=title, per_page=per_page)


def show_patterns(
    run: LoadedRun | str | os.PathLike[str],
    text: str,
    layer: int | None = None,
    *,
    heads: Iterable[int] | None = None,
    off: Iterable[HeadId | str] = (),
) -> AttentionHTML:
    """The attention patterns of a layer's heads on ``text``'s tokens, inline in Jupyter (as
    CircuitsVis' ``attention_patterns``): :func:`show` with ``view="patterns"``.

    Point at a token (or a row of the large map) to colour the tokens by the attention it pays
    them, with each weight written under its token; click to keep it; click a head to show its map.
    A language model's maps are those of one forward pass over the prompt (``lm.trace``'s
    ``decoder.L.attn.pattern``, rounded to 4 decimals); the output line is its greedy continuation.

    Args:
        run: a run directory, or an opened run (``lm.loaded`` of ``attnlab.load``).
        text: the input (the viewer's caps apply: 48 tokens, or 512 for a pretrained LM).
        layer: the layer to show; default every layer, with a layer list to pick from.
        heads: the heads to show (default: all of the layer's).
        off: heads to switch off first (``HeadId`` or ``"kind:layer:head"``), as in :func:`show`.

    Returns:
        An :class:`AttentionHTML`; ``payload["attention"]`` holds the maps shown.

    Raises:
        UsageError: an empty ``text``, a ``layer`` or ``heads`` the model does not have, a bad head
            name in ``off``, an input the model cannot read.
    """
    check_input_text(text, what="text")
    loaded = _open(run)
    if layer is not None:
        _check_layers([layer], head_ids(loaded.model), None, name="layer")
    layers = None if layer is None else [layer]
    return show(loaded, text, view="patterns", layer=layer, layers=layers, off=off, heads=heads)


def show_records(
    records: Trace | Sequence[AttentionMap],
    tokens: Sequence[str] | Mapping[str, tuple[Sequence[str], Sequence[str]]],
    *,
    view: str = "model",
    layer: int | None = None,
    layers: Iterable[int] | None = None,
    off: Iterable[HeadId | str] = (),
    example: int = 0,
    title: str = "captured attention",
    heads: Iterable[int] | None = None,
) -> AttentionHTML:
    """Show the attention of one forward pass of any attnlab model, traced with
    :func:`attnlab.trace` (``with attnlab.trace(model, "*.pattern") as traced: model(tokens)``).

    Args:
        records: the trace (its cached ``pattern`` sites, :func:`~attnlab.analysis.maps.traced_maps`),
            or the maps of one forward pass: one per kind and layer.
        tokens: the labels of the positions: one list for every kind (self-attention), or per kind a
            (query labels, key labels) pair (an encoder-decoder's ``cross`` reads target queries
            and source keys).
        view, layer, layers, heads: as for :func:`show`.
        off: heads to draw as switched off (``HeadId`` or ``"kind:layer:head"``): the heads the head
            mask of that pass had at 0. Drawing only: the weights are the traced ones.
        example: the batch row to show.
        title: a line above the view.

    Shape:
        each map's weights: (B, H, T_q, T_k); ``tokens`` must have T_q and T_k labels.

    Raises:
        UsageError: no records, a kind and layer recorded twice (several passes), labels that do
            not match the weights' shape, a bad ``example``, ``view``, ``layer``, ``layers``,
            ``heads`` or head.
    """
    records = traced_maps(records) if isinstance(records, Trace) else list(records)
    if not records:
        raise UsageError(
            'records: nothing was traced (run the model inside `with attnlab.trace(model, "*.pattern") as traced`)'
        )
    _check_view(view)
    every = _record_heads(records)
    embedded = _check_layers(layers, every, layer)
    drawn = _check_heads(heads, every, embedded)
    axes = _record_axes(records, tokens)
    rows = [_one_example(record, example) for record in records]
    _check_size(rows, embedded, drawn)
    stopped = _record_off(off, every)
    traced = AttentionView(rows, axes, "")
    check_finite(traced)
    found = {
        "tokens": list(axes[records[0].kind][1]),
        "off": [head_json(head) for head in stopped],
        "held": [],
        "output": None,
        "attention": maps_json(traced, set(embedded)),
        "overview": overview_json(traced, stopped),
    }
    per_page = viewer_limits(every, task_name="", context=MAX_INPUT_TOKENS).layers_per_page  # the viewer's paging
    return _view(found, every, embedded, drawn, view=view, layer=layer, title=str(title), per_page=per_page)


def _open(run: LoadedRun | str | os.PathLike[str]) -> LoadedRun:
    return run if isinstance(run, LoadedRun) else open_run(run)


def _view(
    found: dict[str, Any],
    heads: list[HeadId],
    embedded: tuple[int, ...],
    drawn: tuple[int, ...] | None,
    *,
    view: str,
    layer: int | None,
    title: str,
    per_page: int,
) -> AttentionHTML:
    """The payload of a view of the maps in ``found`` (a ``run_payload``-like dict), with only the
    heads ``drawn`` (None: all) in its maps."""
    first = embedded[0] if layer is None else layer
    pages = [list(embedded[i : i + per_page]) for i in range(0, len(embedded), per_page)]
    kinds = [kind_info(kind, heads) for kind in dict.fromkeys(h.kind for h in heads)]
    maps = found["attention"] if drawn is None else [_only_heads(item, drawn) for item in found["attention"]]
    return AttentionHTML(
        {
            **found,
            "attention": maps,
            "overview": None if view == "patterns" else found["overview"],  # that view draws no overview
            "title": title,
            "view": view,
            "kind": kinds[0]["kind"],
            "layer": first,
            "heads": kinds,
            "pages": pages,
        }
    )


def _only_heads(item: dict[str, Any], drawn: tuple[int, ...]) -> dict[str, Any]:
    """A map (as :func:`~attnlab.viewer.payload.maps_json` writes it) with the weights of ``drawn``
    only, their numbers in ``heads`` (a pruned layer may lack some)."""
    kept = [head for head in drawn if head < len(item["weights"])]
    return {**item, "heads": kept, "weights": [item["weights"][head] for head in kept]}


def _check_size(
    records: Sequence[AttentionMap], embedded: tuple[int, ...], drawn: tuple[int, ...] | None = None
) -> None:
    """Refuse a view of more than :data:`MAX_EMBEDDED_WEIGHTS` weights (batch row 0, the heads
    ``drawn`` (None: all) of the layers ``embedded``), before any JSON is built."""
    shown = set(embedded)
    numbers = sum(_count(r, drawn) * r.weights.shape[-2] * r.weights.shape[-1] for r in records if r.layer in shown)
    if numbers > MAX_EMBEDDED_WEIGHTS:
        raise UsageError(
            f"layers: the view would embed {numbers:,} attention weights (at most {MAX_EMBEDDED_WEIGHTS:,}); "
            "pass fewer layers (e.g. layers=[0], or show_patterns' layer=0), fewer heads=[...], or a shorter input"
        )


def _count(record: AttentionMap, drawn: tuple[int, ...] | None) -> int:
    """How many of ``record``'s heads are drawn."""
    return record.weights.shape[1] if drawn is None else sum(1 for head in drawn if head < record.weights.shape[1])


def _check_view(view: str) -> None:
    if view not in VIEWS:
        raise UsageError(f"view: unknown {view!r}; allowed: {', '.join(VIEWS)}")


def _check_layers(
    layers: Iterable[int] | None, heads: list[HeadId], layer: int | None, *, name: str = "layers"
) -> tuple[int, ...]:
    """The layers to embed, sorted (all of the model's by default), checked with ``layer``, the one
    shown first; ``name``: the argument that gave ``layers``, for the message."""
    deepest = max(head.layer for head in heads) + 1
    chosen = list(range(deepest) if layers is None else layers)
    for value in chosen:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < deepest:
            raise UsageError(f"{name}: {value!r} is not a layer of this model (0..{deepest - 1})")
    if not chosen:
        raise UsageError("layers: empty; name at least one layer")
    embedded = tuple(sorted(set(chosen)))
    if layer is not None and layer not in embedded:
        raise UsageError(f"layer: {layer!r} is not one of the layers shown ({', '.join(map(str, embedded))})")
    return embedded


def _check_heads(heads: Iterable[int] | None, every: list[HeadId], embedded: tuple[int, ...]) -> tuple[int, ...] | None:
    """The head numbers to draw, sorted (None: all), each a head of some layer ``embedded``."""
    if heads is None:
        return None
    if isinstance(heads, int):
        raise UsageError(f"heads: a list of head numbers, such as [{heads}], not one number")
    chosen = list(heads)
    widest = max(head.head for head in every if head.layer in embedded) + 1
    for value in chosen:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < widest:
            raise UsageError(f"heads: {value!r} is not a head of the layers shown (0..{widest - 1})")
    if not chosen:
        raise UsageError("heads: empty; name at least one head")
    return tuple(sorted(set(chosen)))


def _record_heads(records: Sequence[AttentionMap]) -> list[HeadId]:
    """The heads of ``records``, which must hold each kind's layers 0..N-1 exactly once."""
    seen: dict[str, list[int]] = {}
    for record in records:
        if record.layer in seen.setdefault(record.kind, []):
            raise UsageError(
                f"records: {record.kind} layer {record.layer} is given twice; give the maps of one forward pass "
                "(a trace keeps its latest)"
            )
        seen[record.kind].append(record.layer)
    for kind, layers in seen.items():
        if sorted(layers) != list(range(len(layers))):
            raise UsageError(f"records: {kind} has layers {sorted(layers)}; expected every layer from 0")
    ordered = sorted(records, key=lambda r: (list(seen).index(r.kind), r.layer))
    return [HeadId(r.kind, r.layer, head) for r in ordered for head in range(r.weights.shape[1])]


def _record_axes(
    records: Sequence[AttentionMap], tokens: Sequence[str] | Mapping[str, tuple[Sequence[str], Sequence[str]]]
) -> dict[str, tuple[list[str], list[str]]]:
    """kind -> (query labels, key labels), checked against every record's (T_q, T_k)."""
    kinds = list(dict.fromkeys(record.kind for record in records))
    if isinstance(tokens, Mapping):
        missing = [kind for kind in kinds if kind not in tokens]
        if missing:
            raise UsageError(f"tokens: no labels for {', '.join(missing)}; give (queries, keys) for each kind")
        axes = {kind: ([str(t) for t in tokens[kind][0]], [str(t) for t in tokens[kind][1]]) for kind in kinds}
    elif isinstance(tokens, str):
        raise UsageError("tokens: a list of token labels, not one string")
    else:
        labels = [str(t) for t in tokens]
        axes = {kind: (labels, labels) for kind in kinds}
    for record in records:
        queries, keys = axes[record.kind]
        t_q, t_k = record.weights.shape[-2:]
        if (len(queries), len(keys)) != (t_q, t_k):
            raise UsageError(
                f"tokens: {record.kind} layer {record.layer} attends from {t_q} to {t_k} positions, "
                f"but {len(queries)} query and {len(keys)} key labels were given"
            )
    return axes


def _one_example(record: AttentionMap, example: int) -> AttentionMap:
    batch = record.weights.shape[0]
    if isinstance(example, bool) or not isinstance(example, int) or not 0 <= example < batch:
        raise UsageError(f"example: {example!r} is not a row of the batch (0..{batch - 1})")
    rows = slice(example, example + 1)
    return AttentionMap(record.kind, record.layer, record.weights[rows].detach())


def _run_off(off: Iterable[HeadId | str], loaded: LoadedRun) -> tuple[HeadId, ...]:
    """The heads ``off`` names, checked against the run's model."""
    try:
        return tuple(head if isinstance(head, HeadId) else parse_head(head, loaded.model) for head in off)
    except UsageError as error:
        raise UsageError(f"off: {error}") from None


def _record_off(off: Iterable[HeadId | str], heads: list[HeadId]) -> list[HeadId]:
    known = set(heads)
    stopped = []
    for head in off:
        if isinstance(head, str):
            try:
                head = parse_head_name(head)
            except UsageError as error:
                raise UsageError(f"off: {error}") from None
        if head not in known:
            raise UsageError(f"off: {head} is not a head of these records")
        stopped.append(head)
    return stopped
