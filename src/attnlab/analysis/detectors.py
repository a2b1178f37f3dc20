"""What each head does: scores of the attention patterns interpretability papers name.

A head's score for a pattern is the attention it puts where the pattern says, averaged over
queries. For a pattern with target sets P(i) (the keys query i should attend to under the
pattern) and the head's attention weights A (rows sum to 1),

    score = mean over (sequence, query i) of  sum_{j in P(i)} A[i, j]

over the queries i >= 1 whose P(i) is not empty (query 0 is left out: in a causal model it can
only attend to itself). A score is in [0, 1]: 1 when every query puts all its weight on its
targets. The patterns (:data:`PATTERNS`), for tokens x_0 .. x_{T-1}:

* ``previous_token``: P(i) = {i - 1}.
* ``duplicate_token``: P(i) = {j < i : x_j = x_i}, the earlier occurrences of the query's token
  (bidirectional attention: every other occurrence, j != i).
* ``induction``: P(i) = {j + 1 : j + 1 < i, x_j = x_i}, the token after an earlier occurrence of
  the query's token; on a sequence of random tokens repeated twice, r_1 .. r_n r_1 .. r_n, it is
  the attention from each token of the second half to the token after its first occurrence, as
  Olsson et al. (2022, "In-context learning and induction heads") measure induction heads.
  Causal models only: a head that sees the whole sequence has no "earlier" to copy from.
* ``bos``: P(i) = {0}, the first position (BOS where the model has one; [CLS] for BERT): the
  "attention sink" of Xiao et al. (2023, "Efficient streaming language models with attention
  sinks").
* ``positional``: the largest, over relative offsets d in [-w, w] other than -1 (d <= 0 in a
  causal model), of the score of P(i) = {i + d}; the offset d is reported. A head with a fixed
  relative offset is Voita et al.'s (2019) positional head; d = 0 is a head attending to its own
  token, d = +1 (bidirectional) to the next one. The previous token (d = -1) has its own pattern.

The patterns are those of TransformerLens' head detector (``detect_head``: previous, duplicate,
induction) and of the papers above; the score here is the attention mass on the targets, not
TransformerLens' elementwise match with a reference pattern.

Where they are measured: ``duplicate_token`` and ``induction`` need tokens that recur, so they are
always measured on ``batch`` sequences of ``length`` random tokens (drawn without repetition from
the vocabulary, its special tokens and the task's BOS, EOS and padding left out), each repeated
twice, in the model's framing (its BOS where it puts one). The others are measured on the texts
of a file when one is given, else on the same random sequences. Cross-attention (an
encoder-decoder's) is not scored: its queries and keys are different sequences.

A score is a ratio of two sums over the sequences (:class:`DetectSums`): each candidate's
attention mass summed over sequences and queries, per head, and the queries with targets. So a
texts file is a corpus run (:mod:`attnlab.analysis.corpus`): streamed in windows with bounded
memory, summed in float64 on N processes that each read a shard (``attnlab heads detect --texts
FILE --nproc N``, giving the one-process scores), resumable (``--resume``). Each text is read alone,
as the model reads one text (texts of one length share a forward pass; nothing is padded). The
random sequences are few: the first process measures them alone.

Patterns are read layer by layer inside the forward pass: a hook on each attention module's
``pattern`` site reduces the (B, H, T, T) weights to the heads' scores at once, so no more than one
layer's weights exist at a time, and only the attention weights are computed outside the fused
kernel. The model runs as the run defines it (its held heads, ``train.mask_heads``, off).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from attnlab.analysis.corpus import run_corpus
from attnlab.analysis.head_scores import HeadScores
from attnlab.devices import model_device
from attnlab.errors import DataError, UsageError
from attnlab.nn import masking_heads
from attnlab.nn.hooks import Site, add_hook, model_sites
from attnlab.resources import check_input_tokens
from attnlab.run.loaded import LoadedRun

__all__ = [
    "Pattern",
    "PATTERNS",
    "ON_TEXTS",
    "HeadPatterns",
    "Detection",
    "DetectSums",
    "detect_heads",
    "score_heads",
    "repeated_random",
    "pattern_targets",
]

LENGTH = 50
"""The default n of the random sequences r_1 .. r_n r_1 .. r_n (fewer where the context or the
vocabulary holds fewer)."""

Candidates = list[tuple[int | None, Tensor]]
"""A pattern's target sets: (label, mask (B, T, T) bool, True at [b, i, j] where j is in P(i))."""


# ---- the patterns ----------------------------------------------------------------------------------


def _previous(ids: Tensor, causal: bool, window: int) -> Candidates:
    return [(None, _offset_mask(ids, -1))]


def _duplicate(ids: Tensor, causal: bool, window: int) -> Candidates:
    same = ids[:, :, None] == ids[:, None, :]  # (B, T_q, T_k): x_i = x_j
    return [(None, same & _before(ids) if causal else same & ~_diagonal(ids))]


def _induction(ids: Tensor, causal: bool, window: int) -> Candidates:
    after = torch.zeros_like(ids[:, :, None] == ids[:, None, :])
    after[:, :, 1:] = ids[:, :, None] == ids[:, None, :-1]  # [i, j]: x_{j-1} = x_i
    return [(None, after & _before(ids))]  # j < i, so j - 1 is an earlier occurrence


def _bos(ids: Tensor, causal: bool, window: int) -> Candidates:
    mask = torch.zeros(*ids.shape, ids.shape[1], dtype=torch.bool, device=ids.device)
    mask[:, :, 0] = True
    return [(None, mask)]


def _positional(ids: Tensor, causal: bool, window: int) -> Candidates:
    offsets = range(-window, 1 if causal else window + 1)
    return [(d, _offset_mask(ids, d)) for d in offsets if d != -1]


def _offset_mask(ids: Tensor, offset: int) -> Tensor:
    t = ids.shape[1]
    diagonal = torch.ones(t, t, dtype=torch.bool, device=ids.device).triu(offset).tril(offset)  # j - i = offset
    return diagonal.expand(ids.shape[0], -1, -1)


def _before(ids: Tensor) -> Tensor:
    t = ids.shape[1]
    return torch.ones(t, t, dtype=torch.bool, device=ids.device).tril(-1)  # j < i


def _diagonal(ids: Tensor) -> Tensor:
    return torch.eye(ids.shape[1], dtype=torch.bool, device=ids.device)


@dataclass(frozen=True)
class Pattern:
    """One attention pattern.

    Attributes:
        targets: (ids (B, T), causal, window w) -> the candidate target sets; the score is the
            best candidate's (one candidate but for ``positional``, one per offset).
        what: the pattern for people.
        recurring: measured on the repeated random tokens always (it needs tokens that recur).
        causal_only: not scored for bidirectional attention.
    """

    targets: Callable[[Tensor, bool, int], Candidates]
    what: str
    recurring: bool = False
    causal_only: bool = False


PATTERNS: dict[str, Pattern] = {
    "previous_token": Pattern(_previous, "attention to the previous token"),
    "duplicate_token": Pattern(_duplicate, "attention to earlier occurrences of the same token", recurring=True),
    "induction": Pattern(
        _induction, "attention to the token after an earlier occurrence", recurring=True, causal_only=True
    ),
    "bos": Pattern(_bos, "attention to the first position (attention sink)"),
    "positional": Pattern(_positional, "attention at one fixed relative offset (not -1)"),
}
"""Registry: pattern name -> :class:`Pattern` (definitions in the module docstring)."""


def pattern_targets(name: str, ids: Tensor, *, causal: bool = True, window: int = 4) -> Candidates:
    """The target sets of pattern ``name`` for token ids (B, T), query 0 left out (see the module
    docstring): [(label, mask (B, T, T))], the label the offset of a ``positional`` candidate."""
    candidates = PATTERNS[name].targets(ids, causal, window)
    trimmed = []
    for label, mask in candidates:
        mask = mask.clone()
        mask[:, 0] = False
        trimmed.append((label, mask))
    return trimmed


# ---- the result ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class HeadPatterns:
    """One head's score for every pattern (NaN where the pattern is not scored for the head), and
    the relative offset of its ``positional`` score."""

    kind: str
    layer: int
    head: int
    previous_token: float
    duplicate_token: float
    induction: float
    bos: float
    positional: float
    positional_offset: int | None


@dataclass(frozen=True)
class Detection:
    """Every head's pattern scores.

    Attributes:
        rows: one per head (self-attention kinds; cross-attention is not scored).
        measured_on: pattern -> what it was measured on, for people.
        notes: what was not scored, and why.
    """

    rows: list[HeadPatterns]
    measured_on: dict[str, str]
    notes: list[str]

    def scores(self, pattern: str) -> HeadScores:
        """Every head's score for ``pattern`` as (layers, heads) tensors per kind (NaN: not scored)."""
        if pattern not in PATTERNS:
            raise UsageError(f"pattern: unknown {pattern!r}; allowed: {', '.join(PATTERNS)}")
        return HeadScores.of_rows(pattern, self.rows, pattern)

    def top(self, pattern: str, count: int = 3) -> list[HeadPatterns]:
        """The ``count`` heads scoring highest for ``pattern`` (heads not scored left out)."""
        scored = [row for row in self.rows if not math.isnan(getattr(row, pattern))]
        return sorted(scored, key=lambda row: -getattr(row, pattern))[:count]


# ---- how each model kind reads a sequence ------------------------------------------------------------


@dataclass(frozen=True)
class Reader:
    """How a model kind frames token ids and runs them.

    Attributes:
        frame: (loaded, ids) -> the sequence the model reads around ``ids`` (its BOS, [CLS] .. [SEP], EOS).
        text: (loaded, text) -> the ids the model reads for a text.
        run: (model, ids (B, T)) -> runs the model.
    """

    frame: Callable[[LoadedRun, list[int]], list[int]]
    text: Callable[[LoadedRun, str], list[int]]
    run: Callable[[Any, Tensor], object]


def _with_eos(loaded: LoadedRun, ids: list[int]) -> list[int]:
    return [*ids, loaded.task.eos_id]


READERS: dict[str, Reader] = {
    "decoder_only": Reader(
        lambda loaded, ids: [*loaded.task.generation_prompt(""), *ids],
        lambda loaded, text: loaded.task.generation_prompt(text),
        lambda model, ids: model(ids, is_token=torch.ones_like(ids, dtype=torch.bool)),
    ),
    "encoder": Reader(
        lambda loaded, ids: getattr(loaded.task, "frame", list)(ids),
        lambda loaded, text: loaded.codec.encode(text),
        lambda model, ids: model(ids),
    ),
    "encoder_classifier": Reader(
        _with_eos, lambda loaded, text: _with_eos(loaded, loaded.codec.encode(text)), lambda model, ids: model(ids)
    ),
    "encoder_decoder": Reader(  # the same sequence as source and (teacher-forced) target
        _with_eos, lambda loaded, text: _with_eos(loaded, loaded.codec.encode(text)), lambda model, ids: model(ids, ids)
    ),
}
"""Registry: model kind -> :class:`Reader`."""


# ---- detection -------------------------------------------------------------------------------------

ON_TEXTS = [name for name, pattern in PATTERNS.items() if not pattern.recurring]
"""The patterns measured on a texts file when one is given (those that need no recurring tokens)."""


def detect_heads(
    source: Any,
    *,
    texts: str | Path | None = None,
    length: int | None = None,
    batch: int = 8,
    window: int = 4,
    seed: int = 0,
    progress: bool = False,
) -> Detection:
    """Score every head for every pattern of :data:`PATTERNS` (see the module docstring).

    The texts are a corpus run (:func:`attnlab.analysis.corpus.run_corpus` with
    :class:`DetectSums`: the file is streamed, any size) on this process; ``attnlab heads detect
    --nproc N --resume`` runs the same pieces on N processes, resumable.

    Args:
        source: a :class:`~attnlab.run.loaded.LoadedRun`, or what ``attnlab.load`` returns.
        texts: a text file (one text per line, each read alone) for the patterns of
            :data:`ON_TEXTS`; None: the random sequences for every pattern.
        length: n, the random tokens of each sequence before it repeats (2n tokens in all,
            with the model's framing); None: :data:`LENGTH`, or fewer where the context or the
            vocabulary is smaller.
        batch: random sequences (one forward pass), and texts per batch.
        window: w, the largest relative offset of ``positional``.
        seed: of the random tokens.
        progress: a bar of the bytes of ``texts`` read.

    Returns:
        A :class:`Detection`.

    Raises:
        UsageError: a random sequence longer than the model's context, a vocabulary too small
            for random tokens.
        DataError: a text file that is empty, not UTF-8, with a text longer than the context, or
            whose texts are all single tokens.
    """
    random = repeated_random(source, length=length, batch=batch, seed=seed)  # checked before any pass
    sums = None
    if texts is not None:
        objective = DetectSums(source, ON_TEXTS, window=window)
        sums = run_corpus(texts, objective, batch_size=batch, identity={}, progress=progress, desc="detect")
    return score_heads(source, random, sums, window=window, texts=texts)


def score_heads(
    source: Any,
    random: Tensor,
    text_sums: Mapping[str, Tensor] | None = None,
    *,
    window: int = 4,
    texts: str | Path | None = None,
) -> Detection:
    """Every head's scores: the patterns of ``text_sums`` from them, the others measured here on
    ``random``.

    Args:
        source: a :class:`~attnlab.run.loaded.LoadedRun`, or what ``attnlab.load`` returns.
        random: (B, T) repeated random sequences (:func:`repeated_random`).
        text_sums: the sums of :class:`DetectSums` over ``texts`` for the patterns of
            :data:`ON_TEXTS` (a corpus run's totals); None: every pattern on ``random``.
        window: w, the largest relative offset of ``positional``.
        texts: the file ``text_sums`` were summed over, for people.

    Raises:
        DataError: ``text_sums`` scored no text (each was a single token).
    """
    loaded: LoadedRun = getattr(source, "loaded", source)
    if text_sums is not None and float(text_sums["texts"]) == 0:
        raise DataError(f"--texts: every text of {texts} is a single token; nothing to score")
    on_texts = ON_TEXTS if text_sums is not None else []
    objective = DetectSums(loaded, [name for name in PATTERNS if name not in on_texts], window=window)
    sums = objective.measure_ids(random.to(model_device(objective.model)))
    rows = objective.rows({**sums, **(text_sums or {})})
    reader = READERS[loaded.experiment.model_kind]
    length = (random.shape[1] - len(reader.frame(loaded, []))) // 2
    described = f"{random.shape[0]} sequences of {length} random tokens repeated twice"
    measured_on = {name: (f"the texts of {texts}" if name in on_texts else described) for name in PATTERNS}
    notes = []
    if any(site.kind == "cross" for site in model_sites(objective.model).values()):
        notes.append("cross-attention heads are not scored (their queries and keys are different sequences)")
    bidirectional = sorted({site.kind for site in objective.sites if not objective.causal[site.name]})
    for name, pattern in PATTERNS.items():
        if pattern.causal_only and bidirectional:
            notes.append(f"{name}: not scored for bidirectional attention ({', '.join(bidirectional)} heads)")
    return Detection(rows, measured_on, notes)


def repeated_random(source: Any, *, length: int | None = None, batch: int = 8, seed: int = 0) -> Tensor:
    """(batch, T) on the CPU: each row the framing of r_1 .. r_n r_1 .. r_n, n = ``length`` distinct
    random tokens (None: :data:`LENGTH`, or as many as the context and the vocabulary hold), drawn
    from the ordinary tokens (the task's BOS, EOS and padding left out).

    Raises:
        UsageError: ``length`` < 2 or ``batch`` < 1, a sequence longer than the context, a
            vocabulary with fewer than ``length`` ordinary tokens.
    """
    loaded: LoadedRun = getattr(source, "loaded", source)
    if (length is not None and length < 2) or batch < 1:
        raise UsageError("--length must be at least 2, --batch-size at least 1")
    reader = READERS[loaded.experiment.model_kind]
    config = loaded.model.config
    limit = min(config.vocab_size, getattr(config, "target_vocab_size", config.vocab_size))
    task = loaded.task
    special = {task.bos_id, task.eos_id, task.pad_id}
    pool = torch.tensor(sorted(i for i in loaded.codec.vocabulary().values() if i < limit and i not in special))
    if length is None:
        length = max(2, min(LENGTH, len(pool), (config.max_len - len(reader.frame(loaded, []))) // 2))
    if len(pool) < length:
        raise UsageError(f"--length: {length} random tokens, but the vocabulary has {len(pool)} ordinary tokens")
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        drawn = pool[torch.randperm(len(pool), generator=generator)[:length]].tolist()
        rows.append(reader.frame(loaded, drawn + drawn))
    check_input_tokens(len(rows[0]), context=config.max_len, what=f"--length {length} (repeated twice)")
    return torch.tensor(rows)


class DetectSums:
    """The float64 sums the scores of the patterns ``names`` are made of, over sequences of tokens;
    a :class:`~attnlab.analysis.corpus.CorpusObjective` over the texts of a file.

    For every scored attention module s (self-attention; cross-attention is left out), every
    pattern p of ``names`` scored for it (``causal_only`` ones for causal modules alone) and every
    candidate c of p (one but for ``positional``):

    * ``"s:p"`` (C, H): sum over sequences and queries i of sum_{j in P_c(i)} A_h[i, j];
    * ``"s:p:queries"`` (C,): the queries i whose P_c(i) is not empty;

    and ``"texts"``, the sequences measured. The score is the first over the second, maximised over
    the candidates (:meth:`rows`): sums over texts add, so N processes that each sum a shard give
    the one-process scores, and a texts file may be read in windows (:func:`run_corpus`).

    Each sequence is read alone, as the model reads one text: a batch runs one forward pass per
    length among its sequences (no padding, so no model kind needs to be told which positions are
    real), the corpus runner giving batches of similar lengths.

    Args:
        source: a :class:`~attnlab.run.loaded.LoadedRun`, or what ``attnlab.load`` returns.
        names: the patterns summed (default every pattern of :data:`PATTERNS`).
        window: w, the largest relative offset of ``positional``.
    """

    def __init__(self, source: Any, names: Sequence[str] | None = None, *, window: int = 4) -> None:
        if window < 0:
            raise UsageError("--window must be at least 0")
        self.loaded: LoadedRun = getattr(source, "loaded", source)
        self.reader = READERS[self.loaded.experiment.model_kind]
        self.model = self.loaded.model.eval()
        self.held = self.loaded.held_mask()
        self.names = list(PATTERNS if names is None else names)
        self.window = window
        self.sites = [s for s in model_sites(self.model).values() if s.point == "pattern" and s.kind != "cross"]
        stacks = self.model.site_stacks()
        # An Encoder stack says whether it is causal; an encoder-decoder's Decoder always is.
        self.causal = {site.name: getattr(stacks[site.stack][0], "causal", True) for site in self.sites}
        probe = torch.zeros(1, 2, dtype=torch.long)  # a candidate's label does not depend on the tokens
        self.labels = {  # (pattern, causal) -> the labels of its candidates
            (name, causal): [label for label, _ in pattern_targets(name, probe, causal=causal, window=window)]
            for name in PATTERNS
            for causal in (False, True)
        }

    def scored(self, site: Site) -> list[str]:
        """The patterns of ``names`` scored for the module of ``site``."""
        causal = self.causal[site.name]
        return [name for name in self.names if causal or not PATTERNS[name].causal_only]

    def zeros(self) -> dict[str, Tensor]:
        sums = {"texts": torch.zeros((), dtype=torch.float64)}
        for site in self.sites:
            heads = site.module.heads
            for name in self.scored(site):
                candidates = len(self.labels[name, self.causal[site.name]])
                sums[f"{site.name}:{name}"] = torch.zeros(candidates, heads, dtype=torch.float64)
                sums[f"{site.name}:{name}:queries"] = torch.zeros(candidates, dtype=torch.float64)
        return sums

    def encode(self, text: str, *, where: str) -> list[int] | None:
        """The ids the model reads for ``text``; None for a single token (no query to score).

        Raises:
            DataError: a text the model cannot read (a symbol outside a task's alphabet), or longer
                than its context; ``where`` (``FILE:LINE``) names it.
        """
        try:
            ids = self.reader.text(self.loaded, text)
        except UsageError as error:
            raise DataError(f"{where}: {error}") from None
        context = self.model.config.max_len
        if len(ids) > context:
            raise DataError(f"{where}: the text has {len(ids)} tokens, more than the model's context of {context}")
        return ids if len(ids) > 1 else None

    def measure(self, items: Sequence[list[int]]) -> dict[str, Tensor]:
        """The sums over ``items`` (ids of any lengths), one forward pass per length."""
        lengths: dict[int, list[list[int]]] = {}
        for ids in items:
            lengths.setdefault(len(ids), []).append(ids)
        sums = self.zeros()
        device = model_device(self.model)
        for rows in lengths.values():
            for key, value in self.measure_ids(torch.tensor(rows, device=device)).items():
                sums[key] += value
        return sums

    def measure_ids(self, ids: Tensor) -> dict[str, Tensor]:
        """The sums over the sequences ``ids`` (B, T), from one forward pass, the model as the run
        defines it (its held heads off). Each module's (B, H, T, T) weights are reduced in a hook on
        its ``pattern`` site, so no more than one layer's exist at a time."""
        sums = self.zeros()
        targets = {
            causal: {
                name: self._targets(ids, name, causal)
                for name in self.names
                if causal or not PATTERNS[name].causal_only
            }
            for causal in set(self.causal.values())
        }
        removers = [add_hook(site, self._reducer(site, targets[self.causal[site.name]], sums)) for site in self.sites]
        try:
            with torch.no_grad(), masking_heads(self.model, self.held):
                self.reader.run(self.model, ids)
        finally:
            for remove in removers:
                remove()
        sums["texts"] += ids.shape[0]
        return sums

    def _targets(self, ids: Tensor, name: str, causal: bool) -> Tensor:
        """(C, B, T, T): the masks of the candidates of pattern ``name``."""
        return torch.stack([mask for _, mask in pattern_targets(name, ids, causal=causal, window=self.window)])

    def _reducer(self, site: Site, targets: dict[str, Tensor], sums: dict[str, Tensor]) -> Callable[[Tensor], Tensor]:
        names = self.scored(site)

        def reduce(weights: Tensor) -> Tensor:  # (B, H, T_q, T_k), this layer's only
            kept = weights.detach()
            for name in names:
                masks = targets[name]  # one candidate at a time: no more than one layer's size
                added = torch.stack(
                    [kept.masked_fill(~mask[:, None], 0.0).sum((0, 2, 3), dtype=torch.float64) for mask in masks]
                )  # (C, H)
                sums[f"{site.name}:{name}"] += added.cpu()
                sums[f"{site.name}:{name}:queries"] += masks.any(-1).sum((1, 2)).double().cpu()
            return weights

        return reduce

    def rows(self, sums: Mapping[str, Tensor]) -> list[HeadPatterns]:
        """Every head's scores from ``sums`` (of this or another :class:`DetectSums` of the same
        model and window, merged): per pattern, the best candidate's sum / queries; NaN where
        ``sums`` hold no pattern for the module."""
        rows = []
        for site in self.sites:
            heads = site.module.heads
            scores: dict[str, list[tuple[float, int | None]]] = {}
            for name in PATTERNS:
                key = f"{site.name}:{name}"
                if key not in sums:
                    scores[name] = [(math.nan, None)] * heads
                    continue
                per = sums[key] / sums[f"{key}:queries"].clamp_min(1)[:, None]  # (C, H)
                best = per.argmax(0)
                labels = self.labels[name, self.causal[site.name]]
                scores[name] = [(float(per[best[h], h]), labels[int(best[h])]) for h in range(heads)]
            for head in range(heads):
                values = {name: scores[name][head][0] for name in PATTERNS}
                offset = scores["positional"][head][1]
                rows.append(
                    HeadPatterns(site.kind or "self", site.layer or 0, head, **values, positional_offset=offset)
                )
        return rows
