"""Activation patching, exact and by attribution: how much of a clean-vs-corrupt difference a site restores.

Run a model on a clean input and on a corrupt one of the same length; then run the corrupt input
again with one site's value taken from the clean run (:func:`attnlab.nn.hooks.trace`). With m the
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

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab.analysis.maps import (  # the prompt `attnlab attention` reads, an answer as a continuation
    answer_token,
    continuation_ids,
    language_model_prompt,
)
from attnlab.devices import model_device
from attnlab.errors import UsageError
from attnlab.nn.hooks import Site, model_sites, resolve_sites, trace
from attnlab.nn.models import POOLINGS
from attnlab.resources import check_input_text, check_input_tokens
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

METRICS = ("logit_diff", "loss", "logprob")
"""What a language model's patching measures by name (see the module docstring)."""

METHODS = ("exact", "attribution")
"""Exact patching (one forward pass per unit) or attribution patching (one backward pass for all)."""

POSITIONS = ("all", "each")
"""Patch each unit over all positions at once, or position by position."""

Measure = Callable[[Tensor], Tensor]
"""The metric of a batch of outputs: (B, ...) -> (B,), higher = more like the clean run."""


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
            for ``logprob``).
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


# ---- how each model kind reads one text, and what is measured -----------------------------------


@dataclass(frozen=True)
class Runner:
    """How a model kind turns a text into ids, and ids into the output that is measured.

    Attributes:
        ids: (loaded, text) -> the token ids the model reads.
        output: (loaded, tokens (B, T)) -> (B, ...) what the metric reads: the logits (B, T, V),
            the sentence embedding, the class logits.
        measure: (loaded, clean output, corrupt output) -> the metric and what it is, for people
            (the kinds without named metrics).
        what: the model kind, for messages.
        reads_answer: whether it measures named metrics of ``answer`` and ``wrong`` (a language
            model's next tokens); for the other kinds giving them is an error, not silently ignored.
    """

    ids: Callable[[LoadedRun, str], list[int]]
    output: Callable[[LoadedRun, Tensor], Tensor]
    measure: Callable[[LoadedRun, Tensor, Tensor], tuple[Measure, str]] | None
    what: str
    reads_answer: bool = False


def _lm_ids(loaded: LoadedRun, text: str) -> list[int]:
    return language_model_prompt(loaded, text)


def _lm_output(loaded: LoadedRun, tokens: Tensor) -> Tensor:
    return loaded.model(tokens, is_token=torch.ones_like(tokens, dtype=torch.bool))  # (B, T, V)


def _encoder_ids(loaded: LoadedRun, text: str) -> list[int]:
    ids = loaded.codec.encode(text)
    check_input_tokens(len(ids), context=loaded.model.config.max_len)
    return ids


def _encoder_output(loaded: LoadedRun, tokens: Tensor) -> Tensor:
    hidden = loaded.model(tokens)
    return POOLINGS[loaded.task.pooling](hidden, torch.ones_like(tokens, dtype=torch.bool))  # (B, d_model)


def _classifier_ids(loaded: LoadedRun, text: str) -> list[int]:
    ids = loaded.codec.encode(text) + [loaded.task.eos_id]
    check_input_tokens(len(ids), context=loaded.model.config.max_len)
    return ids


def _classifier_output(loaded: LoadedRun, tokens: Tensor) -> Tensor:
    return loaded.model(tokens)  # (B, C)


def _encoder_measure(loaded: LoadedRun, clean: Tensor, corrupt: Tensor) -> tuple[Measure, str]:
    """The cosine of the sentence embedding to the clean one."""
    reference = clean[0]
    return lambda out: F.cosine_similarity(out, reference.expand_as(out), dim=-1), "cosine to the clean embedding"


def _classifier_measure(loaded: LoadedRun, clean: Tensor, corrupt: Tensor) -> tuple[Measure, str]:
    """The clean run's class logit minus the largest other class logit."""
    chosen = int(clean[0].argmax())

    def margin(out: Tensor) -> Tensor:
        others = out.clone()
        others[:, chosen] = float("-inf")
        return out[:, chosen] - others.max(-1).values

    return margin, f"logit of class {chosen} (the clean run's) minus the largest other"


RUNNERS: dict[str, Runner] = {
    "decoder_only": Runner(_lm_ids, _lm_output, None, "language model", reads_answer=True),
    "encoder": Runner(_encoder_ids, _encoder_output, _encoder_measure, "sentence encoder"),
    "encoder_classifier": Runner(_classifier_ids, _classifier_output, _classifier_measure, "classifier"),
}
"""Registry: model kind -> :class:`Runner`. An encoder-decoder is not here: its output is a decoded
sequence, whose length the patch itself can change."""


def runner_of(loaded: LoadedRun, flag: str = "RUN") -> Runner:
    kind = loaded.experiment.model_kind
    if kind not in RUNNERS:
        raise UsageError(
            f"{flag}: patching reads one output of a language model, sentence encoder or classifier; "
            f"this run's model is {kind!r} (its output is a decoded sequence)"
        )
    return RUNNERS[kind]


# ---- a language model's named metrics -------------------------------------------------------------


def _answer_tokens(loaded: LoadedRun, metric: str, answer: str | None) -> list[int]:
    """The answer's tokens that ``logprob`` reads teacher-forced (none for the other metrics, or
    without an answer: the clean run's top next token then)."""
    if metric != "logprob" or answer is None:
        return []
    ids = continuation_ids(loaded, answer)
    if not ids:
        raise UsageError(f"--answer: {answer!r} is no token; give the text whose log-probability is measured")
    return ids


def _log_probs(out: Tensor) -> Tensor:
    """log-softmax over the vocabulary in at least float32."""
    return F.log_softmax(out.to(torch.promote_types(out.dtype, torch.float32)), -1)


def _lm_measure(
    loaded: LoadedRun,
    clean: Tensor,
    corrupt: Tensor,
    metric: str,
    answer: str | None,
    wrong: str | None,
    answer_ids: list[int],
) -> tuple[Measure, str]:
    """The answer's logit minus the wrong token's at the last position, or the answer's log-probability.

    Shape:
        clean, corrupt: (1, T, V), the logits of the two inputs (with the answer's tokens but the
        last appended for ``logprob`` with an answer).
    """
    label = lambda i: repr(loaded.codec.tokens([i])[0])  # noqa: E731
    if answer_ids:  # logprob: sum_i log p(a_i | prompt, a_<i), the logits at the last n positions
        n = len(answer_ids)
        index = torch.tensor(answer_ids, device=clean.device)  # (n,)
        shown = " ".join(label(i) for i in answer_ids)

        def logprob(out: Tensor) -> Tensor:
            last = _log_probs(out[:, out.shape[1] - n :])  # (B, n, V)
            return last.gather(-1, index.expand(out.shape[0], n).unsqueeze(-1)).squeeze(-1).sum(-1)

        return logprob, f"log p({shown}) after the prompt, teacher-forced ({n} tokens)"
    good = answer_token(loaded, answer, "--answer") if answer is not None else int(clean[0, -1].argmax())
    if metric in ("loss", "logprob"):
        return lambda out: _log_probs(out[:, -1])[:, good], f"log p({label(good)}) at the last position"
    bad = answer_token(loaded, wrong, "--wrong") if wrong is not None else int(corrupt[0, -1].argmax())
    if bad == good:
        raise UsageError(
            f"--answer/--wrong: the clean and the corrupt input both lead to {label(good)}; give two different "
            "next tokens (--answer for the clean input's, --wrong for the corrupt one's), or --metric loss"
        )
    return (
        lambda out: out[:, -1, good] - out[:, -1, bad],
        f"logit[{label(good)}] - logit[{label(bad)}] at the last position",
    )


def _user_measure(metric: Callable[[Tensor], Tensor]) -> Measure:
    """A metric given as a function, checked to give one value per example."""

    def measure(out: Tensor) -> Tensor:
        value = metric(out)
        if not isinstance(value, Tensor) or value.shape != (out.shape[0],):
            shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(f"metric: must map the output ({out.shape[0]}, ...) to ({out.shape[0]},); it gave {shape}")
        return value

    return measure


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
    run: Callable[[Tensor], Tensor],
    corrupt: Tensor,
    clean: dict[str, Tensor],
    units: list[Unit],
    batch: int,
    tick: Callable[[], None],
) -> list[float]:
    """m_patched of every unit: the corrupt input repeated, example i with unit i's clean slice, in
    passes of ``batch`` examples."""
    values: list[float] = []
    for start in range(0, len(units), batch):
        chunk = units[start : start + batch]
        by_site: dict[str, list[tuple[int, Unit]]] = {}
        for example, unit in enumerate(chunk):
            by_site.setdefault(unit.site.name, []).append((example, unit))
        with trace(model) as t:
            for name, rows in by_site.items():
                t.edit(name, _patcher(clean[name], rows))
            values += run(corrupt.expand(len(chunk), -1)).double().tolist()
        tick()
    return values


def _patcher(clean: Tensor, rows: list[tuple[int, Unit]]) -> Callable[[Tensor], Tensor]:
    """x -> the clean value on each example's unit slice, x elsewhere."""

    def edit(x: Tensor) -> Tensor:
        return torch.where(_mask(rows, x.shape, x.device), clean.to(x.dtype).expand_as(x), x)

    return edit


def _attribution(
    model: torch.nn.Module,
    run: Callable[[Tensor], Tensor],
    corrupt: Tensor,
    clean: dict[str, Tensor],
    units: list[Unit],
) -> list[float]:
    """The first-order estimate of every unit: sum over its slice of (a_clean - a_corrupt) dm/da at
    the corrupt run, from one forward and one backward pass."""
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
        metric = run(corrupt).sum()
        grads = torch.autograd.grad(metric, [probes[name] for name in names], allow_unused=True)
    effects = {}
    for name, grad in zip(names, grads, strict=True):  # (a_clean - a_corrupt) * dm/da, per element
        gradient = torch.zeros_like(values[name]) if grad is None else grad
        effects[name] = ((clean[name].double() - values[name].double()) * gradient.double())[0]  # in float64
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
    clean_text: str,
    corrupt_text: str,
    *,
    metric: str | Callable[[Tensor], Tensor] = "logit_diff",
    answer: str | None = None,
    wrong: str | None = None,
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
        clean_text, corrupt_text: the two inputs, of as many tokens.
        metric: a name of :data:`METRICS` (a language model's), or a function of the model's output
            to (B,), higher = more like the clean run.
        answer, wrong: a language model's tokens for the named metrics (``answer`` of any number of
            tokens for ``logprob``).
        sites: named requests (:data:`NAMED_SITES`) or site names and globs, each a group of rows.
        positions: ``all`` or ``each`` for every site; None: all for sites with heads, each otherwise.
        method: ``exact`` or ``attribution``.
        verify_top: attribution: patch exactly this many units of each request, those with the
            largest |estimate|.
        batch_size: examples in one patched forward pass.
        progress: called after each forward pass of patching with the number of passes in all.

    Raises:
        UsageError: an encoder-decoder run, inputs of different token counts (both tokenizations
            shown), an unknown metric, method, positions or site, an answer that is not one token
            (or no token for ``logprob``), the same answer and wrong token, an answer or wrong token
            for a model that is not a language model or with a metric function, or inputs the
            model measures alike (nothing to restore).
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
    check_input_text(clean_text, what="--clean")
    check_input_text(corrupt_text, what="--corrupt")
    answer_ids = _answer_tokens(loaded, metric, answer) if named and runner.reads_answer else []
    clean_ids, corrupt_ids = runner.ids(loaded, clean_text), runner.ids(loaded, corrupt_text)
    if len(clean_ids) != len(corrupt_ids):
        clean_tokens, corrupt_tokens = loaded.codec.tokens(clean_ids), loaded.codec.tokens(corrupt_ids)
        raise UsageError(
            f"--clean and --corrupt must have the same number of tokens: clean has {len(clean_ids)} "
            f"({' | '.join(clean_tokens)}), corrupt has {len(corrupt_ids)} ({' | '.join(corrupt_tokens)})"
        )
    clean_ids, corrupt_ids = clean_ids + answer_ids[:-1], corrupt_ids + answer_ids[:-1]  # teacher-forced answer
    clean_tokens, corrupt_tokens = loaded.codec.tokens(clean_ids), loaded.codec.tokens(corrupt_ids)
    model = loaded.model.eval()
    requests = _requests(model, sites)
    device = model_device(model)
    clean, corrupt = (torch.tensor([ids], device=device) for ids in (clean_ids, corrupt_ids))
    names = list(dict.fromkeys(site.name for chosen in requests.values() for site in chosen))
    with torch.no_grad():
        with trace(model, cache=names) as seen:
            clean_out = runner.output(loaded, clean)
        corrupt_out = runner.output(loaded, corrupt)
        if not named:
            measure, measured = _user_measure(metric), getattr(metric, "__name__", "the metric given")  # type: ignore[arg-type]
        elif runner.measure is None:
            measure, measured = _lm_measure(loaded, clean_out, corrupt_out, metric, answer, wrong, answer_ids)  # type: ignore[arg-type]
        else:
            measure, measured = runner.measure(loaded, clean_out, corrupt_out)
        m_clean, m_corrupt = float(measure(clean_out)[0]), float(measure(corrupt_out)[0])
    if abs(m_clean - m_corrupt) <= 1e-6 * max(1.0, abs(m_clean)):
        raise UsageError(
            f"--clean/--corrupt: the model measures both alike ({measured}: {m_clean:.6g} and "
            f"{m_corrupt:.6g}); there is no difference for a patch to restore"
        )
    cache = seen.cache

    def run(tokens: Tensor) -> Tensor:
        return measure(runner.output(loaded, tokens))

    groups = {
        request: [u for site in chosen for u in _units(site, cache[site.name].shape, positions)]
        for request, chosen in requests.items()
    }
    units = list(dict.fromkeys(u for group in groups.values() for u in group))
    gap = m_clean - m_corrupt
    if method == "exact":
        passes = math.ceil(len(units) / batch_size)
        tick = (lambda: progress(passes)) if progress else (lambda: None)  # noqa: E731
        with torch.no_grad():
            metrics = dict(zip(units, _exact(model, run, corrupt, cache, units, batch_size, tick), strict=True))
        rows = {u: (metrics[u], None) for u in units}
    else:
        passes = 1 + math.ceil(sum(min(verify_top, len(group)) for group in groups.values()) / batch_size)
        tick = (lambda: progress(passes)) if progress else (lambda: None)  # noqa: E731
        estimates = dict(zip(units, _attribution(model, run, corrupt, cache, units), strict=True))
        tick()
        ranked = (sorted(group, key=lambda u: -abs(estimates[u]))[:verify_top] for group in groups.values())
        top = list(dict.fromkeys(u for group in ranked for u in group))  # each request's largest |estimate|
        with torch.no_grad():
            exact = dict(zip(top, _exact(model, run, corrupt, cache, top, batch_size, tick), strict=True))
        rows = {u: (m_corrupt + estimates[u], (exact[u] - m_corrupt) / gap if u in exact else None) for u in units}

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
                runner.output(loaded, tokens)
            for name, z in seen.cache.items():  # (1, H, T, d_v)
                sums[name] = sums.get(name, 0) + z[0].double().sum(1)  # (H, d_v)
            positions += tokens.shape[1]
    return {name: (total / positions).to(torch.float32) for name, total in sums.items()}
