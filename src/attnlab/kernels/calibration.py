"""Which of several implementations of one function is fastest here: measured on this machine, once.

Where more than one implementation computes the same function for a call (soft attention by the
explicit formula, PyTorch's fused kernel or attnlab's C++ kernels; a linear map on aten's or
oneDNN's GEMM; SwiGLU and RoPE in one pass or by PyTorch's ops), which is fastest depends on the
processor (an AVX2 Zen 3 and an AVX-512 Zen 4 rank them differently), on the thread count and on
the shapes. Rather than constants tuned on one CPU, the choice is timed at the first call of each
*shape class* (the caller's key: the device, dtype, whether a gradient is wanted, and the sizes
rounded up to powers of two by :func:`bucket`), among the implementations whose ``applies``
predicate takes that call, and remembered:

* in memory, :data:`CHOICES` (key -> name), for the process's life: the hot path is one dict
  lookup (:func:`chosen`);
* on disk, one JSON file per machine (:func:`cache_path`), named by a hash of what makes one
  machine's answers differ from another's: the kernels' build (:func:`attnlab.kernels.native.build_spec`,
  whose name carries the CPU capability and a key over the sources, flags, compiler, torch and
  Python), torch's version, the CPU capability and model, and the thread count. A machine measures
  each class once (a class timed while other work competes for the cores is timed again by the next
  process: :func:`machine_busy`); the file is written through a temporary file and ``os.replace``, and an
  unreadable or corrupt file is ignored (the classes are measured again and the file rewritten).

The timing (:func:`measure`) runs each candidate once to warm it, then in interleaved rounds,
at most :data:`ROUNDS` or until :data:`BUDGET_S` has passed, and compares their median times; the
fastest candidate wins, unless an earlier listed one is within :data:`TIE` of it (callers list
their fixed preference first, so noise does not flip a choice between equals). Callers time
the call's own inputs, detached (forward only under ``no_grad``, or forward and backward on fresh
leaves where a gradient is wanted), so the timing records nothing in the caller's graph and draws no random numbers: the
choice changes a result only by the candidates' own rounding.

No measurement is taken (:func:`can_measure` is False) while ``torch.compile`` traces, while a
dispatch mode is active (``FlopCounterMode``, fake tensors) or inside a functorch transform, nor
with ``ATTNLAB_CALIBRATE=0`` (a documented override, read once when this module is imported:
:data:`MEASURING`): the caller's first candidate (its fixed preference) is taken and nothing is
remembered.

**A model's or run's own choices** (:class:`KernelRecord`). Timing makes a choice depend on what
else the machine was doing; a run must not. A record holds one model's choices and a *mode*:
``fixed`` (every class takes the caller's first candidate, never timed: the same kernels on every
run of this machine, loaded or not, which is what makes training bit-reproducible by default) or
``measured`` (timed as above, then kept). Inside ``with using(record):`` (entered by a model that
carries one, :attr:`attnlab.nn.models.TransformerModel.kernel_record`) :func:`chosen`,
:func:`recall` and :func:`choose` answer from the record first and add each new class's answer to
it; a training run writes its record into the run directory (``kernels.json``, in the manifest), and
resuming it, training ``--like`` it, evaluating or loading it read the choices back.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cache
from pathlib import Path

import torch

from attnlab.errors import ConfigError
from attnlab.kernels import native

__all__ = [
    "CHOICES",
    "MEASURING",
    "KERNEL_MODES",
    "KernelRecord",
    "using",
    "active_record",
    "cpu_model",
    "ROUNDS",
    "BUDGET_S",
    "TIE",
    "cache_bytes",
    "bucket",
    "chosen",
    "choose",
    "first",
    "machine_busy",
    "recall",
    "measure",
    "can_measure",
    "cache_path",
    "forget",
]

MEASURING = os.environ.get("ATTNLAB_CALIBRATE", "1") != "0"
"""Whether shape classes may be timed at all: False with the override ``ATTNLAB_CALIBRATE=0``, read
once, when this module is imported (then every class takes its caller's first candidate)."""

CHOICES: dict[tuple, str] = {}
"""Shape class -> the name of the implementation measured fastest for it (this process's answers,
and those read from the disk cache)."""

ROUNDS = 25
"""Timed rounds per candidate (after one warm-up call each), fewer where :data:`BUDGET_S` runs out."""
BUDGET_S = 0.05
"""Seconds after which no further round starts: a class is measured in microseconds to milliseconds,
and never much over this."""

TIE = 0.05
"""A candidate listed earlier wins over a faster later one that is less than this fraction faster:
timings of equals differ by a few percent from run to run, and a caller's order is its preference
(switching a decoding step's maps between two GEMM libraries costs time of its own, so the
kernels of one regime are listed first)."""

_FILE_VERSION = 2  # 2: linear maps timed with their weights out of the core's cache
_disk: tuple[Path, dict[str, str]] | None = None  # the cache file read last, and its choices


def bucket(n: int) -> int:
    """``n`` rounded up to a power of two (0 stays 0): 1, 2, 4 (3 and 4), 8 (5 to 8), ..."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def chosen(key: tuple) -> str | None:
    """The implementation chosen for the shape class ``key``, or None (not chosen yet): the active
    :class:`KernelRecord`'s answer inside :func:`using`, else this process's."""
    record = _ACTIVE.get()
    return CHOICES.get(key) if record is None else record.get(key)


def recall(key: tuple, names: list[str]) -> str | None:
    """The answer for the class ``key`` that needs no timing, if it is one of ``names`` (the
    candidates that apply now): the active record's (in its ``fixed`` mode, the first name, now
    recorded), or one remembered in memory or in the disk cache; None where it must be measured.
    Callers whose timed candidates cost something to prepare ask this first."""
    record = _ACTIVE.get()
    if record is not None:
        known = record.get(key)
        if known in names:
            return known
        if record.mode == "fixed":
            return first(key, names)
    known = CHOICES.get(key)
    if known not in names:
        stored = _read().get(_entry(key)) if can_measure() else None
        known = stored if stored in names else None
        if known is not None:
            CHOICES[key] = known
    if known is not None and record is not None:
        record.add(key, known)
    return known


def choose(key: tuple, candidates: dict[str, Callable[[], object]], *, tie: float | None = None) -> str:
    """The fastest of ``candidates`` (name -> a call to time) for the class ``key``: the active
    record's, remembered, read from the disk cache, or measured now (and remembered on both, and
    in the active record). With one candidate, or where nothing may be measured
    (:func:`can_measure`), the first one, not remembered; a ``fixed`` record takes the first one
    and records it."""
    names = list(candidates)
    if len(names) == 1 or not can_measure():
        return first(key, names)
    known = recall(key, names)
    if known is not None:
        return known
    busy = machine_busy()  # before timing: the candidates' own threads count in the load after
    winner = measure(candidates, tie=tie)
    CHOICES[key] = winner
    if not busy:
        _write(_entry(key), winner)
    record = _ACTIVE.get()
    if record is not None:
        record.add(key, winner)
    return winner


# --------------------------------------------------------------------------------------------
# a model's or run's own choices
# --------------------------------------------------------------------------------------------


def first(key: tuple, names: list[str]) -> str:
    """``names[0]``, the caller's preference, where nothing is timed (one candidate, or
    :func:`can_measure` False): recorded in the active record, which lists every class it met."""
    record = _ACTIVE.get()
    return names[0] if record is None else record.add(key, names[0])


KERNEL_MODES = ("fixed", "measured")
"""How a :class:`KernelRecord` answers a class it has not met: ``fixed``, the caller's first
candidate (never timed: reproducible); ``measured``, the fastest on this machine (timed once)."""


class KernelRecord:
    """The kernels one model (or one run) uses: shape class -> implementation name, and a mode.

    Args:
        mode: one of :data:`KERNEL_MODES` (a ConfigError names ``kernels`` otherwise).
        choices: entries read back (``entry string -> name``, as :meth:`to_dict` writes them).

    Attributes:
        mode: ``fixed`` or ``measured``.
        choices: entry -> name, every class answered so far (what the run directory records).
        changed: whether a class was added since the record was last written (:meth:`to_dict`).
    """

    def __init__(self, mode: str = "fixed", choices: Mapping[str, str] | None = None) -> None:
        if mode not in KERNEL_MODES:
            raise ConfigError(f"kernels: unknown {mode!r}; allowed: {', '.join(KERNEL_MODES)}")
        self.mode = mode
        self.choices: dict[str, str] = dict(choices or {})
        self.changed = False
        self._keys: dict[tuple, str] = {}  # the hot path: the caller's key tuple -> name

    def get(self, key: tuple) -> str | None:
        """The name recorded for ``key``, or None."""
        name = self._keys.get(key)
        if name is None:
            name = self.choices.get(_entry(key))
            if name is not None:
                self._keys[key] = name
        return name

    def add(self, key: tuple, name: str) -> str:
        """Record ``name`` for ``key`` (returned)."""
        self._keys[key] = name
        entry = _entry(key)
        if self.choices.get(entry) != name:
            self.choices[entry] = name
            self.changed = True
        return name

    def to_dict(self) -> dict[str, object]:
        """``{"mode", "machine", "choices"}``: what a run's kernels.json holds (and marks it written)."""
        self.changed = False
        return {"mode": self.mode, "machine": machine_description(), "choices": dict(sorted(self.choices.items()))}

    def __repr__(self) -> str:
        return f"KernelRecord(mode={self.mode!r}, {len(self.choices)} classes)"


_ACTIVE: ContextVar[KernelRecord | None] = ContextVar("attnlab_kernel_record", default=None)


@contextmanager
def using(record: KernelRecord | None) -> Iterator[KernelRecord | None]:
    """Answer shape classes from ``record`` inside the block (None: this process's choices)."""
    token = _ACTIVE.set(record)
    try:
        yield record
    finally:
        _ACTIVE.reset(token)


def active_record() -> KernelRecord | None:
    """The record :func:`using` made active here, or None."""
    return _ACTIVE.get()


def machine_description() -> dict[str, object]:
    """What makes one machine's kernels differ from another's: the kernels' build, the CPU, torch
    and the thread count (written beside a run's choices, for a reader comparing machines)."""
    return {
        "cpu": cpu_model(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "build": native.build_spec().name,
    }


def machine_busy() -> bool:
    """Whether other work competes for this process's cores: the 1-minute load average above the
    cores this process may run on. A choice timed then is used by this process but not written to
    the disk cache: contention ranks kernels that run on all cores (the few-rows kernel) far below
    single-threaded ones (MKL's matrix-vector product), and the disk would keep that rank for
    every later process on a quiet machine (a Zen 4 under a test suite's load timed a bf16 map on
    two threads at 10x its quiet time)."""
    try:
        load = os.getloadavg()[0]
        cores = len(os.sched_getaffinity(0))
    except (OSError, AttributeError):  # platforms without them: trust the timing
        return False
    return load > cores


def measure(candidates: dict[str, Callable[[], object]], *, tie: float | None = None) -> str:
    """The name of the fastest call in ``candidates``: one warm-up call each, then interleaved
    rounds (at most :data:`ROUNDS`, none started after :data:`BUDGET_S`), each one's median time
    compared (not its best: a kernel that is fast only when nothing ran on the other threads just
    before was picked by its best time and lost in the model); the earliest listed within
    ``tie`` (default :data:`TIE`) of the fastest wins."""
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for run in candidates.values():
        run()
    start = time.perf_counter()
    for _ in range(ROUNDS):
        for name, run in candidates.items():
            begun = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - begun)
        if time.perf_counter() - start > BUDGET_S:
            break
    best = {name: statistics.median(seconds) for name, seconds in times.items()}
    fastest = min(best.values())
    margin = TIE if tie is None else tie
    return next(name for name, seconds in best.items() if seconds <= fastest * (1.0 + margin))


def can_measure() -> bool:
    """Whether timing may run now: not while ``torch.compile`` traces, a dispatch mode is active
    (``FlopCounterMode``, ``FakeTensorMode``) or a functorch transform runs, and not with
    ``ATTNLAB_CALIBRATE=0`` (:data:`MEASURING`)."""
    return (
        MEASURING
        and not torch.compiler.is_compiling()
        and torch._C._len_torch_dispatch_stack() == 0
        and torch._C._functorch.peek_interpreter_stack() is None
    )


@cache
def cache_bytes() -> int:
    """The bytes of this core's last private cache level (L2 on the EPYCs met; sysfs's
    ``cpu0/cache``), 1 MiB where the system does not say. Timings that cycle through more data
    than this read it from the shared cache or memory, as a model's weights are read in a forward
    pass, rather than from a cache that holds them between one timed call and the next."""
    private = 0
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            shared = (index / "shared_cpu_list").read_text().strip()
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        if shared == "0" and size.endswith("K") and size[:-1].isdigit():  # held by cpu0 alone
            private = max(private, int(size[:-1]) * 1024)
    return private or 1 << 20


def forget() -> None:
    """Drop this process's answers (the disk cache is read again at the next measurement)."""
    global _disk
    CHOICES.clear()
    _disk = None


# --------------------------------------------------------------------------------------------
# the disk cache: one JSON file per machine key
# --------------------------------------------------------------------------------------------


def cache_path() -> Path:
    """``$ATTNLAB_CALIBRATION_DIR`` (default ``~/.cache/attnlab/calibration``) / ``{machine key}.json``."""
    root = os.environ.get("ATTNLAB_CALIBRATION_DIR") or Path.home() / ".cache" / "attnlab" / "calibration"
    return Path(root) / f"{_machine_key()}.json"


def _machine_key() -> str:
    """16 hex digits over what makes one machine's timings differ from another's: the build and
    the processor, and the thread count now (a process may change it)."""
    return hashlib.sha256(f"{_build_and_processor()}\n{torch.get_num_threads()}".encode()).hexdigest()[:16]


@cache
def _build_and_processor() -> str:
    parts = (
        native.build_spec().name,  # the CPU capability and a key over the kernels' build
        str(torch.__version__),
        torch.backends.cpu.get_cpu_capability(),
        cpu_model(),
    )
    return "\n".join(parts)


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``'s "model name", else ``platform.processor()``, else
    ``unknown``): part of the cache's key, and the machine a benchmark records."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _entry(key: tuple) -> str:
    return "|".join(map(str, key))


def _read() -> dict[str, str]:
    """The cache file's choices (read once per process); empty where it is missing or unreadable."""
    global _disk
    path = cache_path()
    if _disk is None or _disk[0] != path:
        _disk = (path, _load(path))
    return _disk[1]


def _load(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != _FILE_VERSION or not isinstance(data.get("choices"), dict):
        return {}
    return {str(entry): name for entry, name in data["choices"].items() if isinstance(name, str)}


def _write(entry: str, name: str) -> None:
    """Add one answer to the cache file: merged with what other processes wrote meanwhile, written
    to a temporary file and renamed over it. A file that cannot be written is left as it is (the
    answer stays in memory)."""
    path = cache_path()
    choices = _load(path)
    choices[entry] = name
    _read()[entry] = name
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        partial.write_text(json.dumps({"version": _FILE_VERSION, "choices": choices}, indent=0), encoding="utf-8")
        os.replace(partial, path)
    except OSError:
        pass
