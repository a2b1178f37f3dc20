"""Timing, machine facts, and the result format every benchmark shares.

A benchmark times each system in the same process on the same machine, reports the median of at
least 5 timed repetitions after warm-up, and derives ratios from those medians. Systems that are
compared are timed in interleaved rounds (:func:`interleaved_median_times`): on a shared machine
whose speed drifts over minutes, a slow spell then falls on every system of a round instead of on
whichever happened to run during it. The JSON form is

    {"benchmark": ..., "machine": {...}, "results": [{"system", "metric", "value", "unit"}],
     "ratios": {...}, "targets": {...}}

Timings are never asserted in tests: speed depends on the machine and its load.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from attnlab import runtime
from attnlab.bench.peer_scripts.rss_peak import high_water_growth
from attnlab.kernels import calibration, native
from attnlab.kernels.linear import linear_setting

__all__ = [
    "MIN_REPEATS",
    "Measurement",
    "BenchResult",
    "Timed",
    "interleaved_median_times",
    "machine_info",
    "format_table",
    "format_row",
    "hf_greedy_generate",
    "peak_rss_growth",
]

MIN_REPEATS = 5


@dataclass(frozen=True)
class Measurement:
    system: str
    metric: str
    value: float
    unit: str


@dataclass
class BenchResult:
    """One benchmark's measurements, ratios between them, and the targets they are held to.

    ``targets`` maps a ratio name to (comparison, bound), e.g. ``{"vs_torch": (">=", 1.15)}``.
    ``echo``, where given, receives each measurement as it is added (a benchmark that streams its
    rows while it runs); it is not part of the result.
    """

    benchmark: str
    results: list[Measurement] = field(default_factory=list)
    ratios: dict[str, float] = field(default_factory=dict)
    targets: dict[str, tuple[str, float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    machine: dict[str, Any] = field(default_factory=lambda: machine_info())
    echo: Callable[[Measurement], None] | None = field(default=None, repr=False, compare=False)

    def add(self, system: str, metric: str, value: float, unit: str) -> None:
        measurement = Measurement(system, metric, value, unit)
        self.results.append(measurement)
        if self.echo is not None:
            self.echo(measurement)

    def value(self, system: str, metric: str) -> float:
        return next(m.value for m in self.results if m.system == system and m.metric == metric)

    def met(self) -> dict[str, bool]:
        """Whether each ratio meets its target."""
        checks = {">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b}
        return {
            name: checks[op](self.ratios[name], bound)
            for name, (op, bound) in self.targets.items()
            if name in self.ratios
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "benchmark": self.benchmark,
            "machine": self.machine,
            "results": [asdict(m) for m in self.results],
            "ratios": self.ratios,
            "targets": {
                k: {"op": op, "bound": bound, "met": self.met().get(k)} for k, (op, bound) in self.targets.items()
            },
            "notes": self.notes,
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2)


@dataclass(frozen=True)
class Timed:
    """What a system returns when it was timed elsewhere (in another process, say): its own
    ``seconds`` replace the wall clock around the call, for ``units`` units of work."""

    seconds: float
    units: int = 1


def interleaved_median_times(
    systems: dict[str, Callable[[], object]],
    *,
    repeats: int = MIN_REPEATS,
    warmup: int | dict[str, int] = 1,
    tick: Callable[[], None] | None = None,
) -> dict[str, float]:
    """Median wall-clock seconds of each system, timed in ``repeats`` interleaved rounds.

    Every round times each system once; the order rotates from round to round so that no system
    always runs first (after a cold cache) or last. ``warmup`` runs (per system, or one count for
    all) come before the first round.

    A system that returns an int did that many equal units of work in the call (a slice of a long
    loop of identical steps, say); its repetition is then the call's time divided by that count, so
    the median is seconds per unit. A system that returns a :class:`Timed` gives its own time
    (and units).

    Args:
        systems: name -> a call doing the work once.
        repeats: the timed rounds (at least :data:`MIN_REPEATS`).
        warmup: untimed calls before the first round.
        tick: called after every call, warm-up or timed (a progress bar's step).

    Returns:
        system name -> median seconds (per call, or per unit for systems that count their units).
    """
    if repeats < MIN_REPEATS:
        raise ValueError(f"repeats: a benchmark times at least {MIN_REPEATS} repetitions, got {repeats}")
    names = list(systems)
    for name in names:
        for _ in range(warmup if isinstance(warmup, int) else warmup.get(name, 1)):
            systems[name]()
            if tick is not None:
                tick()
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(repeats):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            units = systems[name]()
            elapsed = time.perf_counter() - start
            if tick is not None:
                tick()
            if isinstance(units, Timed):
                elapsed, units = units.seconds, units.units
            if isinstance(units, int):
                if units < 1:
                    raise ValueError(
                        f"{name}: a system that counts its units of work must do at least one, got {units}"
                    )
                elapsed /= units
            times[name].append(elapsed)
    return {name: statistics.median(seconds) for name, seconds in times.items()}


def machine_info() -> dict[str, Any]:
    """What the numbers depend on: torch version, threads, CPU model and the vector instructions
    PyTorch runs on it, the GEMM kernel setting of attnlab's linear maps (``ATTNLAB_LINEAR``), whether attnlab's C++ CPU
    kernels (:mod:`attnlab.kernels.native`) are built, devices."""
    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": calibration.cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "linear_kernel": linear_setting(),
        "native_kernels": native.available(),
        "cpus": os.cpu_count(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def format_table(result: BenchResult) -> str:
    """A plain-text table of the measurements, then the ratios against their targets."""
    lines = [
        f"benchmark: {result.benchmark}   (torch {result.machine['torch']}, {result.machine['threads']} threads, "
        f"{result.machine['cpu']})"
    ]
    width = max([len(m.system) for m in result.results] + [6])
    lines += [format_row(m, width) for m in result.results]
    met = result.met()
    for name, ratio in result.ratios.items():
        target = result.targets.get(name)
        verdict = "" if target is None else f"   target {target[0]} {target[1]:g}: {'met' if met[name] else 'MISSED'}"
        lines.append(f"  ratio {name:<30} {ratio:8.3f}{verdict}")
    lines += [f"  note: {note}" for note in result.notes]
    return "\n".join(lines)


def format_row(measurement: Measurement, width: int = 6) -> str:
    """One measurement as a line of :func:`format_table` (the system's column ``width`` wide)."""
    m = measurement
    return f"  {m.system:<{width}}  {m.metric:<22} {m.value:>14.4g} {m.unit}"


@torch.inference_mode()
def hf_greedy_generate(model: Any, tokens: Any, new_tokens: int, **token_ids: int) -> None:
    """Hugging Face's ``generate`` as the benchmarks time it: greedy, with its KV cache, every row
    making exactly ``new_tokens`` steps (min = max), no padding; ``token_ids``: its
    ``eos_token_id`` / ``pad_token_id``."""
    model.generate(
        input_ids=tokens,
        attention_mask=torch.ones_like(tokens),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        num_beams=1,
        use_cache=True,
        **token_ids,
    )


def peak_rss_growth(run: Callable[[], object]) -> int | None:
    """The peak resident set size during ``run()`` above the RSS before it, in bytes; None where
    Linux's ``/proc/self/clear_refs`` (which restarts the high-water mark) or glibc is missing.

    Every allocation of 128 KiB or more is mapped on its own from the first call on (glibc's mmap
    threshold fixed, and the heap's free pages returned before each run), so that a tensor freed
    before the call is not resident, and one freed during it leaves the RSS: the growth is what
    the call itself holds at its peak. The setting stays for the rest of the process: measure
    memory after the timings.
    """
    if not runtime.map_allocations_from(128 * 1024):
        return None
    runtime.release_freed_memory()
    return high_water_growth(run)
