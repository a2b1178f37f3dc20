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

Patterns are read layer by layer inside the forward pass: a hook on each attention module's
``pattern`` site reduces the (B, H, T, T) weights to the heads' scores at once, so no more than one
layer's weights exist at a time, and only the attention weights are computed outside the fused
kernel. The model runs as the run defines it (its held heads, ``train.mask_heads``, off).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from attnlab.analysis.maps import language_model_prompt
from attnlab.devices import model_device
from attnlab.errors import UsageError
from attnlab.nn import masking_heads
from attnlab.nn.hooks import Site, add_hook, model_sites
from attnlab.resources import check_input_tokens
from attnlab.run.loaded import LoadedRun
from attnlab.tasks.text import read_lines

__all__ = ["Pattern", "PATTERNS", "HeadPatterns", "Detection", "detect_heads", "pattern_targets"]

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
        language_model_prompt,
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


def detect_heads(
    source: Any,
    *,
    texts: str | Path | None = None,
    length: int | None = None,
    batch: int = 8,
    window: int = 4,
    seed: int = 0,
    progress: Callable[[], None] | None = None,
) -> Detection:
    """Score every head for every pattern of :data:`PATTERNS` (see the module docstring).

    Args:
        source: a :class:`~attnlab.run.loaded.LoadedRun`, or what ``attnlab.load`` returns.
        texts: a text file (one text per line, each read alone) for the patterns that need no
            recurring tokens; None: the random sequences for every pattern.
        length: n, the random tokens of each sequence before it repeats (2n tokens in all,
            with the model's framing); None: :data:`LENGTH`, or fewer where the context or the
            vocabulary is smaller.
        batch: random sequences.
        window: w, the largest relative offset of ``positional``.
        seed: of the random tokens.
        progress: called after every forward pass.

    Returns:
        A :class:`Detection`.

    Raises:
        UsageError: a sequence longer than the model's context, a vocabulary too small for
            random tokens, a text file without text.
    """
    loaded: LoadedRun = getattr(source, "loaded", source)
    kind = loaded.experiment.model_kind
    reader = READERS[kind]
    model = loaded.model.eval()
    if (length is not None and length < 2) or batch < 1 or window < 0:
        raise UsageError("--length must be at least 2, --batch-size at least 1, --window at least 0")
    sites = [site for site in model_sites(model).values() if site.point == "pattern" and site.kind != "cross"]
    tally = _Tally(sites, model, window)
    device = model_device(model)
    text_ids = [] if texts is None else _text_ids(loaded, reader, texts)  # every input checked before a pass
    random = _repeated_random(loaded, reader, length, batch, seed).to(device)
    length = (random.shape[1] - len(reader.frame(loaded, []))) // 2
    on_texts = [name for name, pattern in PATTERNS.items() if texts is not None and not pattern.recurring]
    tick = progress or (lambda: None)
    with torch.no_grad(), masking_heads(model, loaded.held_mask()):
        tally.measure(reader, model, random, [name for name in PATTERNS if name not in on_texts])
        tick()
        for ids in text_ids:
            tally.measure(reader, model, torch.tensor([ids], device=device), on_texts)
            tick()
    described = f"{batch} sequences of {length} random tokens repeated twice"
    measured_on = {name: (f"the texts of {texts}" if name in on_texts else described) for name in PATTERNS}
    notes = []
    if any(site.kind == "cross" for site in model_sites(model).values()):
        notes.append("cross-attention heads are not scored (their queries and keys are different sequences)")
    bidirectional = sorted({site.kind for site in sites if not tally.causal[site.name]})
    for name, pattern in PATTERNS.items():
        if pattern.causal_only and bidirectional:
            notes.append(f"{name}: not scored for bidirectional attention ({', '.join(bidirectional)} heads)")
    return Detection(tally.rows(), measured_on, notes)


def _repeated_random(loaded: LoadedRun, reader: Reader, length: int | None, batch: int, seed: int) -> Tensor:
    """(batch, T): each row the framing of r_1 .. r_n r_1 .. r_n, n = ``length`` distinct random tokens
    (None: :data:`LENGTH`, or as many as the context and the vocabulary hold)."""
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


def _text_ids(loaded: LoadedRun, reader: Reader, texts: str | Path | None) -> list[list[int]]:
    lines = [line for line in read_lines(Path(texts)).items if line.strip()]  # type: ignore[arg-type]
    if not lines:
        raise UsageError(f"--texts: {texts} holds no text")
    chosen = []
    for number, line in enumerate(lines, start=1):
        ids = reader.text(loaded, line)
        check_input_tokens(len(ids), context=loaded.model.config.max_len, what=f"--texts: text {number} of {texts}")
        if len(ids) > 1:  # a lone token has no query to score
            chosen.append(ids)
    if not chosen:
        raise UsageError(f"--texts: every text of {texts} is a single token; nothing to score")
    return chosen


class _Tally:
    """Per attention module: sum over queries of each candidate's attention mass, and the queries."""

    def __init__(self, sites: list[Site], model: Any, window: int) -> None:
        self.sites, self.window = sites, window
        stacks = model.site_stacks()
        # An Encoder stack says whether it is causal; an encoder-decoder's Decoder always is.
        self.causal = {site.name: getattr(stacks[site.stack][0], "causal", True) for site in sites}
        self.mass: dict[str, dict[str, Tensor]] = {site.name: {} for site in sites}  # pattern -> (C, H)
        self.count: dict[str, dict[str, Tensor]] = {site.name: {} for site in sites}  # pattern -> (C,)
        self.labels: dict[tuple[str, bool], list[int | None]] = {}  # (pattern, causal) -> candidates' labels

    def measure(self, reader: Reader, model: Any, ids: Tensor, names: list[str]) -> None:
        """One forward pass on ``ids``, adding the patterns ``names`` of every module."""
        targets = {causal: self._targets(ids, names, causal) for causal in set(self.causal.values())}
        removers = [add_hook(site, self._reducer(site, targets[self.causal[site.name]])) for site in self.sites]
        try:
            reader.run(model, ids)
        finally:
            for remove in removers:
                remove()

    def _targets(self, ids: Tensor, names: list[str], causal: bool) -> dict[str, Tensor]:
        """pattern -> (C, B, T, T) masks, for the patterns scored with this causality."""
        chosen = {}
        for name in names:
            if PATTERNS[name].causal_only and not causal:
                continue
            candidates = pattern_targets(name, ids, causal=causal, window=self.window)
            self.labels[name, causal] = [label for label, _ in candidates]
            chosen[name] = torch.stack([mask for _, mask in candidates])
        return chosen

    def _reducer(self, site: Site, targets: dict[str, Tensor]) -> Callable[[Tensor], Tensor]:
        mass, count = self.mass[site.name], self.count[site.name]

        def reduce(weights: Tensor) -> Tensor:  # (B, H, T_q, T_k), this layer's only
            kept = weights.detach()
            for name, masks in targets.items():  # one candidate at a time: no more than one layer's size
                added = torch.stack(
                    [kept.masked_fill(~mask[:, None], 0.0).sum((0, 2, 3), dtype=torch.float64) for mask in masks]
                )  # (C, H)
                queries = masks.any(-1).sum((1, 2)).double()  # (C,)
                mass[name] = mass[name] + added if name in mass else added
                count[name] = count[name] + queries if name in count else queries
            return weights

        return reduce

    def rows(self) -> list[HeadPatterns]:
        rows = []
        for site in self.sites:
            heads = site.module.heads
            scores: dict[str, list[tuple[float, int | None]]] = {}
            for name in PATTERNS:
                if name not in self.mass[site.name]:
                    scores[name] = [(math.nan, None)] * heads
                    continue
                per = (self.mass[site.name][name] / self.count[site.name][name].clamp_min(1)[:, None]).cpu()  # (C, H)
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
