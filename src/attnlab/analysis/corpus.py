"""Corpus runs: sums over the texts of a file of any size, on several processes, resumable.

A corpus run computes quantities that are sums over the texts of a file,

    S = sum_x s(x),

in float64: a language model's summed next-token loss and its token count (``eval --texts``),
each head's summed |dL(x)/dxi_h| (``heads importance --texts``, Michel et al. 2019), the summed
loss under each ablation mask (``heads ablate --texts``), each head's attention mass on each
pattern's targets and the queries that have targets (``heads detect --texts``,
:class:`attnlab.analysis.detectors.DetectSums`). Whatever is reported is a function of the sums
(a perplexity exp(S_nll / S_tokens), a mean S / S_texts, a score S_mass / S_queries), so N
processes that each sum a shard and add their sums give the one-process result (to float noise:
the batches differ).

The file is read as a stream (:func:`attnlab.reading.stream_lines`) in *windows* of
``batch_size * WINDOW_BATCHES * N`` non-blank lines: memory holds one window, whatever the file's
size. Sharding: within a window, process r of N takes the window's lines r, r + N, r + 2N, ...
(round robin, so every process gets as many lines, and short and long lines alike); it sorts its
texts by length (little padding) and sums its batches. At the end of each window the N partial
sums are added (``all_reduce`` in float64, gloo on the CPU, NCCL on GPUs), so every process holds
the totals of all the lines read so far.

Every process reads and encodes every line of a window and measures only its own: a bad line (not
UTF-8, too long) is the same error on every process, at the same place, and no process waits
for one that stopped.

Resuming: after each window the first process writes the *state* (the totals, the byte offset
and line number where the next window starts, and the run's identity) atomically
(:func:`attnlab.run.storage.atomic_write_json`). ``resume=True`` starts from it: the totals are
those of the windows already done and reading starts at the offset, so nothing is read twice and
nothing is lost. At the same process count and batch size every window is measured as it was,
and the result equals the uninterrupted run's exactly (float64 sums in the same order); another
process count is accepted (the state is global: totals and one position) and agrees to float
noise. The state is removed when the run ends.

A run on several processes ends with its launcher: a worker whose launcher was killed outright
dies with it (:mod:`attnlab.lifeline`), and :func:`run_corpus` and :func:`finish` check once more
before the results and the state's removal, so such a run leaves its last state for ``--resume``
and no result.

The work a run does is a :class:`CorpusObjective`: the zeros of its sums, how a line becomes an
item, and the float64 sums of a batch of items.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from attnlab.errors import CheckpointError, DataError, UsageError
from attnlab.lifeline import stop_if_orphaned
from attnlab.reading import Line, stream_lines
from attnlab.run.storage import atomic_write_json, read_json
from attnlab.tasks.text import MAX_LINE_CHARS
from attnlab.training.distributed import DistInfo, all_reduce_sum

__all__ = [
    "WINDOW_BATCHES",
    "CorpusObjective",
    "corpus_identity",
    "check_corpus",
    "run_corpus",
    "finish",
]

WINDOW_BATCHES = 8
"""Batches per process in one window: the lines sorted together by length, and the run's step
between two saved states."""

STATE_FORMAT = 1
"""The version of the state file's layout."""

LINES, SKIPPED = "lines", "skipped"
"""The sums every run keeps itself: non-blank lines read, and lines the objective passed over."""


class CorpusObjective(Protocol):
    """What a corpus run computes.

    ``zeros`` gives every sum (name -> float64 tensor of its shape, zero), ``encode`` turns one
    line into an item (anything with a length, the length its batches are sorted by) or None to
    pass it over, and ``measure`` gives the float64 sums of a batch of items, a subset of the
    names of ``zeros``.
    """

    def zeros(self) -> dict[str, Tensor]: ...

    def encode(self, text: str, *, where: str) -> Any | None: ...

    def measure(self, items: Sequence[Any]) -> Mapping[str, Tensor]: ...


def corpus_identity(path: str | os.PathLike[str], **settings: Any) -> dict[str, Any]:
    """What a saved state must match to be resumed: the file (its absolute path, size and
    modification time, so a changed file is not resumed) and the run's ``settings`` (JSON values:
    the command, the model, the masks, ... whatever changes the sums)."""
    path = Path(path)
    info = path.stat()
    return {"texts": str(path.resolve()), "bytes": info.st_size, "mtime_ns": info.st_mtime_ns, **settings}


def check_corpus(path: str | os.PathLike[str], *, max_line_chars: int = MAX_LINE_CHARS) -> int:
    """Read the file once, as a run will: the number of non-blank lines.

    A cheap first pass that finds a bad file before any model work (and before any process is
    started): what a run would stop at hours in is refused at once.

    Raises:
        DataError: a file that cannot be read or is not a regular file, a line that is not UTF-8
            or too long (naming the file and line), or a file without a non-blank line.
    """
    count = sum(1 for _ in stream_lines(path, max_line_chars=max_line_chars))
    if count == 0:
        raise DataError(f"{os.fspath(path)}: empty file (no line with text)")
    return count


def run_corpus(
    path: str | os.PathLike[str],
    objective: CorpusObjective,
    *,
    batch_size: int,
    identity: Mapping[str, Any],
    state: Path | None = None,
    resume: bool = False,
    info: DistInfo | None = None,
    progress: bool = False,
    desc: str = "corpus",
    after_window: Callable[[int], None] | None = None,
) -> dict[str, Tensor]:
    """The float64 sums of ``objective`` over the file ``path`` (see the module docstring).

    Args:
        path: a UTF-8 text file, one text per non-blank line.
        objective: what to sum.
        batch_size: items per batch on each process.
        identity: what this run is (:func:`corpus_identity`); a state is resumed only by the same.
        state: where the state is written after each window (None: nowhere, not resumable).
        resume: start from ``state``.
        info: this process among the processes (default: one process).
        progress: a bar of the bytes read, on the first process.
        desc: the bar's label.
        after_window: called with the number of windows done after each (and after its state is
            written); an exception it raises stops the run there, as an interruption would.

    Returns:
        The totals over every line, the same on every process: the objective's sums and
        ``lines`` (non-blank lines read) and ``skipped`` (lines ``encode`` passed over).

    Raises:
        DataError: a bad line (not UTF-8, too long, or what ``encode`` refuses), naming it.
        UsageError: ``resume`` without a state, or with the state of another run.
        CheckpointError: a state file that cannot be read.
    """
    info = info or DistInfo()
    if batch_size < 1:
        raise UsageError(f"batch_size: must be >= 1, got {batch_size}")
    totals = {**objective.zeros(), LINES: _zero(), SKIPPED: _zero()}
    offset, number = 0, 1
    if resume:
        offset, number = _load_state(state, identity, totals)
    window_size = batch_size * WINDOW_BATCHES * info.world_size
    lines = stream_lines(path, max_line_chars=MAX_LINE_CHARS, start=offset, number=number)
    bar = _bar(path, offset, desc, progress and info.is_main)
    windows = 0
    try:
        while window := _take(lines, window_size):
            encoded = [objective.encode(line.text, where=f"{os.fspath(path)}:{line.number}") for line in window]
            mine = [item for item in encoded[info.rank :: info.world_size] if item is not None]
            partial = _measure(objective, mine, batch_size)
            for name, value in _reduce(partial, info).items():
                totals[name] += value
            totals[LINES] += len(window)
            totals[SKIPPED] += sum(item is None for item in encoded)
            offset, number = window[-1].end, window[-1].number + 1
            if state is not None and info.is_main:
                _save_state(state, identity, offset, number, totals)
            windows += 1
            if bar is not None:
                bar.update(offset - bar.n)
            if after_window is not None:
                after_window(windows)
    finally:
        if bar is not None:
            bar.close()
    if totals[LINES] == 0:
        raise DataError(f"{os.fspath(path)}: empty file (no line with text)")
    stop_if_orphaned()  # a worker whose launcher is gone reports nothing
    return totals


def finish(state: Path | None, info: DistInfo | None = None) -> None:
    """Remove a finished run's state (on the first process), once its results are written; not in
    a worker whose launcher is gone (it ends there, see :mod:`attnlab.lifeline`)."""
    if state is not None and (info is None or info.is_main):
        stop_if_orphaned()
        state.unlink(missing_ok=True)


def _zero() -> Tensor:
    return torch.zeros((), dtype=torch.float64)


def _take(lines: Any, count: int) -> list[Line]:
    window = []
    for line in lines:
        window.append(line)
        if len(window) == count:
            break
    return window


def _measure(objective: CorpusObjective, items: list[Any], batch_size: int) -> dict[str, Tensor]:
    """This process's sums over its items of a window, in batches of similar lengths."""
    partial = objective.zeros()
    items = sorted(items, key=len)  # stable: equal lengths keep the file's order
    for start in range(0, len(items), batch_size):
        for name, value in objective.measure(items[start : start + batch_size]).items():
            partial[name] += value.detach().to(device="cpu", dtype=torch.float64)
    return partial


def _reduce(partial: dict[str, Tensor], info: DistInfo) -> dict[str, Tensor]:
    """The sums of every process, added in float64 (one all_reduce of all the sums at once)."""
    if not info.enabled:
        return partial
    names = sorted(partial)
    flat = torch.cat([partial[name].reshape(-1) for name in names])
    if dist.get_backend() == "nccl":
        flat = flat.to(torch.device("cuda", info.local_rank))
    flat = all_reduce_sum(flat, info).cpu()
    out, start = {}, 0
    for name in names:
        size = partial[name].numel()
        out[name] = flat[start : start + size].reshape(partial[name].shape)
        start += size
    return out


def _bar(path: str | os.PathLike[str], offset: int, desc: str, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm  # only the first process draws

    size = os.stat(path).st_size
    # Shown after a second: a short run, or a bad line found at once, draws no bar.
    return tqdm(total=size, initial=offset, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, delay=1.0)


def _save_state(state: Path, identity: Mapping[str, Any], offset: int, number: int, totals: dict[str, Tensor]) -> None:
    atomic_write_json(
        state,
        {
            "format": STATE_FORMAT,
            "identity": dict(identity),
            "offset": offset,
            "line": number,
            "sums": {name: {"shape": list(t.shape), "values": t.reshape(-1).tolist()} for name, t in totals.items()},
        },
    )


def _load_state(state: Path | None, identity: Mapping[str, Any], totals: dict[str, Tensor]) -> tuple[int, int]:
    """Fill ``totals`` from the saved state; the offset and line number to read on from."""
    if state is None or not state.exists():
        raise UsageError(f"--resume: no interrupted run to continue ({state} not found); run without --resume")
    saved = read_json(state, what="corpus run state")
    try:
        if saved["format"] != STATE_FORMAT:
            raise CheckpointError(f"corpus run state {state}: format {saved['format']!r}, expected {STATE_FORMAT}")
        differ = sorted(
            key for key in {*identity, *saved["identity"]} if saved["identity"].get(key) != identity.get(key)
        )
        if differ:
            raise UsageError(
                f"--resume: {state} was written by another run (it differs in {', '.join(differ)}); "
                "run without --resume to start again"
            )
        offset, number = int(saved["offset"]), int(saved["line"])
        for name in totals:
            entry = saved["sums"][name]
            value = torch.tensor(entry["values"], dtype=torch.float64).reshape(entry["shape"])
            if value.shape != totals[name].shape:
                raise ValueError(f"{name} has shape {list(value.shape)}, expected {list(totals[name].shape)}")
            totals[name] = value
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        raise CheckpointError(f"corpus run state {state} is corrupted ({error})") from None
    return offset, number
