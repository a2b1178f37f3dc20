"""Activation patching, exact and by attribution: how much of a clean-vs-corrupt difference a site restores.

Run a model on a clean input and on a corrupt one of the same length; then run the corrupt input
again with one site's value taken from the clean run (:func:`attnlab.nn.trace.trace`). With m the
measured output (higher = more like the clean run), a patch restores

    r = (m_patched - m_corrupt) / (m_clean - m_corrupt)

of the difference: 1 when the site carries all of it, 0 when none (Vig et al. 2020; Meng et al.
2022, "causal tracing"; Wang et al. 2023).

What is patched is any set of named sites (:mod:`attnlab.nn.hooks`, a name or a glob such as
``*.attn.z`` or ``*.ffn.out``), each split into *units*: one per head of a site with heads, and,
with ``positions="each"``, one per (head and) position; with ``positions="all"`` a unit covers
every position. Two requests have names: ``heads``, every layer's ``attn.z`` head by head over all
positions, and ``residual``, the residual stream entering every layer and leaving the last
(``resid_pre``, the last ``resid_post``) position by position. By default a site with heads is
patched over all positions and one without position by position.

Two methods (``method``):

* ``exact``: one forward pass per unit, batched (the corrupt input repeated, example i patching
  unit i with the clean value on its slice and nothing else);
* ``attribution`` (Nanda 2023, "Attribution patching"; Syed et al. 2023, "Attribution patching
  outperforms automated circuit discovery"): the first-order estimate of every unit at once,

      m_patched - m_corrupt  ~  sum over the unit's slice of (a_clean - a_corrupt) * dm/da |_{a_corrupt}

  from two forward passes (the clean one cached; the corrupt one with every site's gradient kept)
  and one backward pass. The gradient of a site is its total derivative: the sites after it respond
  (a zero probe added at each site, whose gradient is dm/da). The ``verify_top`` units of each
  request with the largest |estimate| are then patched exactly, their restored fraction reported
  beside the estimate.

What is measured, by the run's model kind (:data:`RUNNERS`), or any function of the model's output
(``metric`` a callable: the logits (B, T, V) of a language model, the sentence embedding (B, d) of
an encoder, the class logits (B, C) of a classifier, to (B,)):

* a language model (:data:`METRICS`): ``logit_diff``, the logit difference at the last position
  between the ``answer`` token and the ``wrong`` one (by default the clean and the corrupt run's
  top next tokens); ``loss``, the answer token's log-probability there (minus its next-token loss);
  ``logprob``, the sum of the log-probabilities of the answer's tokens (``answer`` a text of one or
  more tokens), teacher-forced after the prompt: both inputs are read with the answer's tokens but
  the last appended, so that their positions can be patched too;
* a sentence encoder: the cosine of the sentence embedding (the task's pooling) to the clean one;
* a classifier: the logit of the clean run's class minus the largest other class logit.

:func:`head_means` gives each head's mean output over a text file, for mean ablation
(``attnlab heads ablate --mean-over FILE``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from attnlab.analysis.patch_measures import (
    METRICS,
    RUNNERS,
    Batch,
    answer_ids,
    batch_of,
    examples_of,
    language_model_measure,
    runner_of,
    user_measure,
)
from attnlab.analysis.plots import heads_heatmap
from attnlab.analysis.reports import data_frame, write_rows
from attnlab.devices import model_device
from attnlab.errors import UsageError
from attnlab.figures import Figure
from attnlab.kernels.linear import packed_weights
from attnlab.nn.hooks import Site, model_sites, resolve_sites
from attnlab.nn.trace import trace
from attnlab.run.loaded import LoadedRun
from attnlab.tasks.text import read_lines

__all__ = [
    "SitePatch",
    "PatchResult",
    "patch",
    "head_means",
    "METRICS",
    "METHODS",
    "POSITIONS",
    "NAMED_SITES",
    "RUNNERS",
]

METHODS = ("exact", "attribution")
"""Exact patching (one forward pass per unit) or attribution patching (one backward pass for all)."""

POSITIONS = ("all", "each")
"""Patch each unit over all positions at once, or position by position."""


@dataclass(frozen=True)
class SitePatch:
    """One unit patched: a site, a head of it (or all), a position of it (or all), and what it restored.

    Attributes:
        site: the site's name (``decoder.3.attn.z``).
        point: the name without its stack and layer (``attn.z``, ``resid_pre``).
        kind: the attention kind of an attention site (``self``, ...), else None.
        layer: the site's layer, or None outside layers.
        head: the head (a key/value head for ``k``, ``v``), or None: every head, or a site without heads.
        position: the (query) position, or None: every position.
        token: the corrupt input's token at ``position``, or None.
        restored: (m_patched - m_corrupt) / (m_clean - m_corrupt); for attribution patching, the
            estimate divided by m_clean - m_corrupt.
        metric: m_patched; for attribution patching, m_corrupt + the estimate.
        exact: attribution patching only: the exact restored fraction of the ``verify_top`` units
            of each request with the largest |estimate|, None for the others (and for exact patching).
    """

    site: str
    point: str
    kind: str | None
    layer: int | None
    head: int | None
    position: int | None
    token: str | None
    restored: float
    metric: float
    exact: float | None = None


@dataclass(frozen=True)
class PatchResult:
    """Both runs' metric, what was measured, and every unit's restored fraction.

    Attributes:
        measure: what the metric is, for people (``logit[" Paris"] - logit[" Rome"] at the last
            position``, ``cosine to the clean embedding``, ...).
        method: ``exact`` or ``attribution``.
        clean_tokens, corrupt_tokens: the two inputs' token labels (an answer's tokens appended
            for ``logprob``); of the first example of a batch, ``<pad>`` where it is padded.
        groups: one list of rows per site request, by the request (``heads``, ``residual``, or
            the site glob as given), in the order given.
    """

    measure: str
    method: str
    metric_clean: float
    metric_corrupt: float
    clean_tokens: list[str]
    corrupt_tokens: list[str]
    groups: dict[str, list[SitePatch]]

    def __getitem__(self, request: str) -> Tensor:
        """The restored fraction of every unit of ``request`` as a tensor (:meth:`tensor`)."""
        return self.tensor(request)

    def tensor(self, request: str = "heads", value: str = "restored") -> Tensor:
        """One request's units as a float64 tensor: sites down (a site per layer: ``layer``), then
        heads where the sites have heads, then positions where they were patched one by one;
        NaN where a site has no such unit (``exact``: the units attribution did not verify).

        Args:
            request: a request as given (``heads``, ``residual``, a site glob).
            value: ``restored``, ``metric`` or ``exact``.

        Shape:
            (layers, heads) for ``heads``; (layers, heads, T) with ``positions="each"``;
            (layers + 1, T) for ``residual``: :meth:`dims` names them.
        """
        rows, dims = self._group(request), self.dims(request)
        if value not in ("restored", "metric", "exact"):
            raise UsageError(f"value: unknown {value!r}; allowed: restored, metric, exact")
        sites = list(dict.fromkeys(r.site for r in rows))
        shape = [len(sites)]
        shape += [max(r.head for r in rows if r.head is not None) + 1] if "head" in dims else []
        shape += [len(self.corrupt_tokens)] if "position" in dims else []
        values = torch.full(shape, float("nan"), dtype=torch.float64)
        for r in rows:  # a unit of every head (or position) fills the whole axis
            index: list[Any] = [sites.index(r.site)]
            index += [slice(None) if r.head is None else r.head] if "head" in dims else []
            index += [slice(None) if r.position is None else r.position] if "position" in dims else []
            cell = getattr(r, value)
            values[tuple(index)] = float("nan") if cell is None else cell
        return values

    def dims(self, request: str = "heads") -> tuple[str, ...]:
        """The names of :meth:`tensor`'s dimensions for ``request``."""
        rows = self._group(request)
        layers = [r.layer for r in rows]
        per_layer = None not in layers and len({r.site for r in rows}) == len(set(layers))
        head = ("head",) if any(r.head is not None for r in rows) else ()
        position = ("position",) if any(r.position is not None for r in rows) else ()
        return ("layer" if per_layer else "site", *head, *position)

    def plot(self, request: str = "heads", *, value: str = "restored", path: str | Path | None = None) -> Figure:
        """A heatmap of :meth:`tensor` (layers x heads, per position where patched one by one; the
        residual's sites x positions), as a matplotlib Figure; also written as PNG to ``path``."""
        values, dims = self.tensor(request, value), self.dims(request)
        if "head" not in dims:  # sites x positions: one "head" per site
            values = values[:, None, :] if "position" in dims else values[:, None]
        return heads_heatmap(
            values,
            title=f"{value} by patching {request} ({self.method})",
            colorbar=f"{value}: {self.measure}" if value == "metric" else value,
            tokens=self.corrupt_tokens if "position" in dims else None,
            diverging=True,
            path=None if path is None else Path(path),
        )

    def to_csv(self, path: str | Path) -> Path:
        """Every unit of every request, one row each (the columns of :class:`SitePatch`), as CSV."""
        rows = [dataclasses.replace(r, **{c: "" for c in COLUMNS if getattr(r, c) is None}) for r in self.rows()]
        return write_rows(rows, Path(path), COLUMNS)

    def to_frame(self) -> Any:
        """A pandas DataFrame of every unit (:func:`attnlab.analysis.reports.data_frame`)."""
        return data_frame([dataclasses.asdict(r) for r in self.rows()], COLUMNS)

    def rows(self) -> list[SitePatch]:
        """Every unit of every request, in order (a unit in two requests, twice)."""
        return [row for group in self.groups.values() for row in group]

    def _group(self, request: str) -> list[SitePatch]:
        if request not in self.groups:
            raise UsageError(f"request: {request!r} was not patched; patched: {', '.join(self.groups)}")
        return self.groups[request]


COLUMNS = tuple(field.name for field in dataclasses.fields(SitePatch))
"""The columns of a patching table (:meth:`PatchResult.to_csv`, ``attnlab patch``'s CSV)."""


# ---- what is patched: sites split into units ------------------------------------------------------


NAMED_SITES = ("heads", "residual")
"""Site requests by name: every head's ``attn.z``, and the residual stream (see the module docstring)."""


@dataclass(frozen=True)
class Unit:
    """One patch: a site's slice, a head (or all) and a position (or all)."""

    site: Site
    head: int | None
    position: int | None


def _named(request: str, stack: str, layers: int) -> list[str]:
    if request == "heads":
        return [f"{stack}.{layer}.attn.z" for layer in range(layers)]
    return [f"{stack}.{layer}.resid_pre" for layer in range(layers)] + [f"{stack}.{layers - 1}.resid_post"]


def _requests(model, requests: Sequence[str]) -> dict[str, list[Site]]:  # noqa: ANN001
    """request -> its sites, in the model's order."""
    sites = model_sites(model)
    stack, (stack_module, _) = next(iter(model.site_stacks().items()))
    chosen: dict[str, list[Site]] = {}
    for request in dict.fromkeys(requests):
        names = _named(request, stack, len(stack_module.layers)) if request in NAMED_SITES else None
        try:
            names = resolve_sites(sites, [request]) if names is None else names
        except ValueError as error:
            raise UsageError(f"--site: {error} (or one of: {', '.join(NAMED_SITES)})") from None
        chosen[request] = [sites[name] for name in names]
    return chosen


def _units(site: Site, shape: torch.Size, positions: str | None) -> list[Unit]:
    """The units of one site: per head if it has heads, per position with ``each`` (default: per
    position for a site without heads)."""
    each = (positions or ("all" if site.head_axis is not None else "each")) == "each"
    heads = range(shape[site.head_axis]) if site.head_axis is not None else [None]
    places = range(shape[site.position_axis]) if each and site.position_axis is not None else [None]
    return [Unit(site, h, p) for h in heads for p in places]


def _mask(unit_rows: list[tuple[int, Unit]], shape: torch.Size, device: torch.device) -> Tensor:
    """A bool tensor of ``shape`` (the batch first): True on example i's unit slice, for each (i, unit)."""
    mask = torch.zeros(shape, dtype=torch.bool, device=device)
    for example, unit in unit_rows:
        index: list[object] = [slice(None)] * len(shape)
        index[0] = example
        if unit.head is not None:
            index[unit.site.head_axis] = unit.head  # type: ignore[index]
        if unit.position is not None:
            index[unit.site.position_axis] = unit.position  # type: ignore[index]
        mask[tuple(index)] = True
    return mask


def _exact(
    model: torch.nn.Module,
    run: Callable[[Batch], Tensor],
    corrupt: Batch,
    clean: dict[str, Tensor],
    units: list[Unit],
    batch: int,
    tick: Callable[[], None],
) -> list[float]:
    """m_patched of every unit, the mean over the B examples: the corrupt batch repeated, copy i
    with unit i's clean slice, in passes of about ``batch`` rows (at least one unit each)."""
    examples = len(corrupt.tokens)
    per_pass = max(1, batch // examples)
    values: list[float] = []
    with packed_weights():  # one weight read by every pass: oneDNN's packed copies reused
        for start in range(0, len(units), per_pass):
            chunk = units[start : start + per_pass]
            by_site: dict[str, list[tuple[int, Unit]]] = {}
            for copy, unit in enumerate(chunk):
                rows = [(copy * examples + example, unit) for example in range(examples)]
                by_site.setdefault(unit.site.name, []).extend(rows)
            with trace(model) as t:
                for name, rows in by_site.items():
                    t.edit(name, _patcher(clean[name], rows))
                measured = run(corrupt.tiled(len(chunk) * examples)).double()
            values += measured.reshape(len(chunk), examples).mean(1).tolist()
            tick()
    return values


def _patcher(clean: Tensor, rows: list[tuple[int, Unit]]) -> Callable[[Tensor], Tensor]:
    """x -> the clean value (its example's, the batch repeated) on each row's unit slice, x elsewhere."""

    def edit(x: Tensor) -> Tensor:
        source = clean.to(x.dtype).repeat(len(x) // len(clean), *([1] * (clean.dim() - 1)))
        return torch.where(_mask(rows, x.shape, x.device), source, x)

    return edit


def _attribution(
    model: torch.nn.Module,
    run: Callable[[Batch], Tensor],
    corrupt: Batch,
    clean: dict[str, Tensor],
    units: list[Unit],
) -> list[float]:
    """The first-order estimate of every unit: sum over its slice (and the examples) of
    (a_clean - a_corrupt) dm/da at the corrupt run, m the mean over the examples, from one
    forward and one backward pass."""
    names = list(dict.fromkeys(unit.site.name for unit in units))
    probes: dict[str, Tensor] = {}
    values: dict[str, Tensor] = {}

    def probe(name: str) -> Callable[[Tensor], Tensor]:
        def add(x: Tensor) -> Tensor:  # x + 0, a leaf whose gradient is dm/dx (total: later sites respond)
            values[name] = x.detach()
            probes[name] = torch.zeros_like(x, requires_grad=True)
            return x + probes[name]

        return add

    with torch.enable_grad(), trace(model) as t:
        for name in names:
            t.edit(name, probe(name))
        metric = run(corrupt).mean()
        grads = torch.autograd.grad(metric, [probes[name] for name in names], allow_unused=True)
    effects = {}
    for name, grad in zip(names, grads, strict=True):  # (a_clean - a_corrupt) * dm/da, per element
        gradient = torch.zeros_like(values[name]) if grad is None else grad
        effects[name] = ((clean[name].double() - values[name].double()) * gradient.double()).sum(0)  # in float64
    estimates = []
    for unit in units:
        effect = effects[unit.site.name]  # the batch axis gone: axes shift by one
        index: list[object] = [slice(None)] * effect.dim()
        if unit.head is not None:
            index[unit.site.head_axis - 1] = unit.head  # type: ignore[operator]
        if unit.position is not None:
            index[unit.site.position_axis - 1] = unit.position  # type: ignore[operator]
        estimates.append(float(effect[tuple(index)].sum()))
    return estimates


# ---- patching ------------------------------------------------------------------------------------


def check_choices(
    metric: str | Callable[[Tensor], Tensor], method: str, positions: str | None, verify_top: int
) -> None:
    """Raise UsageError naming the flag of an unknown metric name, method or positions, or a
    negative ``verify_top`` (before any model is read)."""
    if isinstance(metric, str) and metric not in METRICS:
        raise UsageError(f"--metric: unknown {metric!r}; allowed: {', '.join(METRICS)}")
    for flag, value, allowed in (("--method", method, METHODS), ("--positions", positions, POSITIONS)):
        if value is not None and value not in allowed:
            raise UsageError(f"{flag}: unknown {value!r}; allowed: {', '.join(allowed)}")
    if verify_top < 0:
        raise UsageError(f"--verify-top: must be 0 or more, got {verify_top}")


def patch(
    loaded: LoadedRun,
    clean: Any,
    corrupt: Any,
    *,
    metric: str | Callable[[Tensor], Tensor] = "logit_diff",
    answer: Any = None,
    wrong: Any = None,
    sites: Sequence[str] = NAMED_SITES,
    positions: str | None = None,
    method: str = "exact",
    verify_top: int = 10,
    batch_size: int = 64,
    progress: Callable[[int], None] | None = None,
) -> PatchResult:
    """Patch the units of ``sites`` from the clean run into the corrupt one (see the module docstring).

    Args:
        loaded: a language model, sentence encoder or classifier.
        clean, corrupt: the two inputs, each a text, ids (a list or a (T,) tensor), or a batch of
            B texts or id lists ((B, T) tensor); example i of each of as many tokens. A language
            model's examples may differ in length (left-padded); the metric is the mean over them.
        metric: a name of :data:`METRICS` (a language model's), or a function of the model's output
            to (B,), higher = more like the clean run.
        answer, wrong: a language model's tokens for the named metrics: a text of one token or an
            id, for every example, or a list with one per example (``answer`` of any number of
            tokens for ``logprob``, one text for the batch).
        sites: named requests (:data:`NAMED_SITES`) or site names and globs, each a group of rows.
        positions: ``all`` or ``each`` for every site; None: all for sites with heads, each otherwise.
        method: ``exact`` or ``attribution``.
        verify_top: attribution: patch exactly this many units of each request, those with the
            largest |estimate|.
        batch_size: rows of one patched forward pass (the B examples of a unit are never split).
        progress: called after each forward pass of patching with the number of passes in all.

    Raises:
        UsageError: an encoder-decoder run, inputs of different token counts (both tokenizations
            shown), batches of different sizes or of mixed types, an id outside the vocabulary, an
            unknown metric, method, positions or site, an answer that is not one token (or no token
            for ``logprob``), the same answer and wrong token, an answer or wrong token for a model
            that is not a language model or with a metric function, or inputs the model measures
            alike (nothing to restore).
    """
    check_choices(metric, method, positions, verify_top)
    named = isinstance(metric, str)
    runner = runner_of(loaded)
    given = [flag for flag, value in (("--answer", answer), ("--wrong", wrong)) if value is not None]
    if given and not (runner.reads_answer and named):
        reason = (
            f"this run is a {runner.what}, which patching measures without one"
            if not runner.reads_answer
            else "a metric function reads the output itself"
        )
        raise UsageError(
            f"{given[0]}: only for a language model's named metrics (the next token it measures); {reason}"
        )
    appended = answer_ids(loaded, metric, answer) if named and runner.reads_answer else []
    clean_ids, corrupt_ids = (
        examples_of(loaded, runner, clean, "--clean"),
        examples_of(loaded, runner, corrupt, "--corrupt"),
    )
    _check_pairs(loaded, runner, clean_ids, corrupt_ids)
    clean_ids = [ids + appended[:-1] for ids in clean_ids]  # a teacher-forced answer
    corrupt_ids = [ids + appended[:-1] for ids in corrupt_ids]
    model = loaded.model.eval()
    requests = _requests(model, sites)
    device = model_device(model)
    pad = getattr(loaded.task, "pad_id", 0)
    clean_batch, corrupt_batch = batch_of(clean_ids, pad, device), batch_of(corrupt_ids, pad, device)
    padding = ["<pad>"] * (clean_batch.tokens.shape[1] - len(clean_ids[0]))  # the first example's labels, padded
    clean_tokens = padding + loaded.codec.tokens(clean_ids[0])
    corrupt_tokens = padding + loaded.codec.tokens(corrupt_ids[0])
    names = list(dict.fromkeys(site.name for chosen in requests.values() for site in chosen))
    with torch.no_grad():
        with trace(model, cache=names) as seen:
            clean_out = runner.output(loaded, clean_batch.tokens, clean_batch.is_token)
        corrupt_out = runner.output(loaded, corrupt_batch.tokens, corrupt_batch.is_token)
        if not named:
            measure, measured = user_measure(metric), getattr(metric, "__name__", "the metric given")  # type: ignore[arg-type]
        elif runner.measure is None:
            measure, measured = language_model_measure(loaded, clean_out, corrupt_out, metric, answer, wrong, appended)  # type: ignore[arg-type]
        else:
            measure, measured = runner.measure(loaded, clean_out, corrupt_out)
        m_clean, m_corrupt = float(measure(clean_out).double().mean()), float(measure(corrupt_out).double().mean())
    if abs(m_clean - m_corrupt) <= 1e-6 * max(1.0, abs(m_clean)):
        raise UsageError(
            f"--clean/--corrupt: the model measures both alike ({measured}: {m_clean:.6g} and "
            f"{m_corrupt:.6g}); there is no difference for a patch to restore"
        )
    cache = seen.cache

    def run(batch: Batch) -> Tensor:
        return measure(runner.output(loaded, batch.tokens, batch.is_token))

    groups = {
        request: [u for site in chosen for u in _units(site, cache[site.name].shape, positions)]
        for request, chosen in requests.items()
    }
    units = list(dict.fromkeys(u for group in groups.values() for u in group))
    gap = m_clean - m_corrupt
    per_pass = max(1, batch_size // len(clean_ids))
    if method == "exact":
        passes = math.ceil(len(units) / per_pass)
        tick = (lambda: progress(passes)) if progress else (lambda: None)  # noqa: E731
        with torch.no_grad():
            exact = _exact(model, run, corrupt_batch, cache, units, batch_size, tick)
        rows = {u: (value, None) for u, value in zip(units, exact, strict=True)}
    else:
        passes = 1 + math.ceil(sum(min(verify_top, len(group)) for group in groups.values()) / per_pass)
        tick = (lambda: progress(passes)) if progress else (lambda: None)  # noqa: E731
        estimates = dict(zip(units, _attribution(model, run, corrupt_batch, cache, units), strict=True))
        tick()
        ranked = (sorted(group, key=lambda u: -abs(estimates[u]))[:verify_top] for group in groups.values())
        top = list(dict.fromkeys(u for group in ranked for u in group))  # each request's largest |estimate|
        with torch.no_grad():
            verified = dict(zip(top, _exact(model, run, corrupt_batch, cache, top, batch_size, tick), strict=True))
        rows = {
            u: (m_corrupt + estimates[u], (verified[u] - m_corrupt) / gap if u in verified else None) for u in units
        }

    def row(unit: Unit) -> SitePatch:
        site, value = unit.site, rows[unit][0]
        point = site.name if site.layer is None else site.name.split(f".{site.layer}.", 1)[1]
        token = None if unit.position is None else corrupt_tokens[unit.position]
        return SitePatch(
            site.name,
            point,
            site.kind,
            site.layer,
            unit.head,
            unit.position,
            token,
            (value - m_corrupt) / gap,
            value,
            rows[unit][1],
        )

    result_groups = {request: [row(u) for u in group] for request, group in groups.items()}
    return PatchResult(measured, method, m_clean, m_corrupt, clean_tokens, corrupt_tokens, result_groups)


def _check_pairs(loaded: LoadedRun, runner: Any, clean: list[list[int]], corrupt: list[list[int]]) -> None:
    """Example i of the clean and of the corrupt batch of as many tokens; a model other than a
    language model reads examples of one length (it is not padded)."""
    if len(clean) != len(corrupt):
        raise UsageError(f"--clean and --corrupt: batches of {len(clean)} and {len(corrupt)} examples; give as many")
    for number, (a, b) in enumerate(zip(clean, corrupt, strict=True)):
        if len(a) != len(b):
            which = "" if len(clean) == 1 else f" (example {number})"
            raise UsageError(
                f"--clean and --corrupt must have the same number of tokens{which}: clean has {len(a)} "
                f"({' | '.join(loaded.codec.tokens(a))}), corrupt has {len(b)} ({' | '.join(loaded.codec.tokens(b))})"
            )
    if not runner.reads_answer and len({len(ids) for ids in clean}) > 1:
        raise UsageError(f"--clean: a {runner.what} reads a batch of examples of one length; these differ")


# ---- mean ablation -------------------------------------------------------------------------------


def head_means(loaded: LoadedRun, texts_file: str | Path) -> dict[str, Tensor]:
    """Each head's mean output over the texts of a file: z site name -> (H, d_v).

    Every text (one per non-empty line) is read alone, as patching reads one, so there is no
    padding; the mean is over every position of every text.

    Raises:
        UsageError: a run patching does not support; DataError: an empty or unreadable file.
    """
    runner = runner_of(loaded)
    texts = [line for line in read_lines(Path(texts_file)).items if line.strip()]
    if not texts:
        raise UsageError(f"--mean-over: {texts_file} holds no text")
    model = loaded.model.eval()
    device = model_device(model)
    pattern = f"{next(iter(model.site_stacks()))}.*.attn.z"
    sums: dict[str, Tensor] = {}
    positions = 0
    with torch.no_grad():
        for text in texts:
            tokens = torch.tensor([runner.ids(loaded, text)], device=device)
            with trace(model, cache=pattern) as seen:
                runner.output(loaded, tokens, torch.ones_like(tokens, dtype=torch.bool))
            for name, z in seen.cache.items():  # (1, H, T, d_v)
                sums[name] = sums.get(name, 0) + z[0].double().sum(1)  # (H, d_v)
            positions += tokens.shape[1]
    return {name: (total / positions).to(torch.float32) for name, total in sums.items()}
