"""``attention``: forward and backward of one attention layer for T = 1k ... 32k (B = 1, H = 8, d_k = 64).

The complexity analysis of Li's slides, measured: attention does O(T_q T_k d) work, and a naive
implementation also keeps the O(T_q T_k) weight matrix. attnlab's soft attention runs PyTorch's
fused kernel (O(T) memory); its hard attention scores queries chunk by chunk and never holds the
T x T weights. The naive reference materialises softmax(Q K^T / sqrt(d)) and is skipped where that
matrix would not fit comfortably in memory.

Each point runs in a fresh subprocess, so its peak resident set size is its own (see :func:`peak_rss`).
"""

from __future__ import annotations

import json
import math
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from attnlab.bench.harness import MIN_REPEATS, BenchResult
from attnlab.nn.attention import attention

__all__ = ["run_attention", "SYSTEMS", "point", "peak_rss", "loglog_slope"]

FULL_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
QUICK_LENGTHS = (256, 512)
SYSTEMS = ("soft", "hard", "naive")
NAIVE_LIMIT_BYTES = 4 * 2**30  # the naive reference is skipped where its T x T matrices pass this
HEADS, HEAD_DIM = 8, 64


def peak_rss() -> int:
    """This process's peak resident set size, in bytes.

    On Linux, ``VmHWM`` of ``/proc/self/status``: the high-water mark of this process's own memory.
    ``ru_maxrss`` is not that in a subprocess: Linux carries the parent's RSS at fork into the child's
    ``ru_maxrss``, so every point run from a 1.6 GiB ``bench all`` reported 1.6 GiB. Elsewhere,
    ``ru_maxrss`` (bytes on macOS, KiB on other systems).
    """
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # "VmHWM:  8732 kB"
    except OSError:
        pass
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024


def point(system: str, length: int, repeats: int) -> dict[str, float]:
    """Time forward+backward of one system at one length; runs inside the measuring subprocess."""

    def make() -> tuple[torch.Tensor, ...]:
        return tuple(torch.randn(1, HEADS, length, HEAD_DIM, requires_grad=True) for _ in range(3))

    def naive(q, k, v):  # noqa: ANN001, ANN202
        weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(HEAD_DIM), dim=-1)  # (1, H, T, T)
        return weights @ v

    forward = {
        "soft": lambda q, k, v: attention(q, k, v),
        "hard": lambda q, k, v: attention(q, k, v, normalizer="hardmax"),
        "naive": naive,
    }[system]
    baseline_rss = peak_rss()
    small = tuple(torch.randn(1, HEADS, 256, HEAD_DIM, requires_grad=True) for _ in range(3))
    forward(*small).sum().backward()  # warm-up: kernels and allocator, at a small size
    del small
    times = []
    for _ in range(repeats):
        q, k, v = make()
        start = time.perf_counter()
        forward(q, k, v).sum().backward()
        times.append(time.perf_counter() - start)
        del q, k, v  # with their gradients, before the next repetition draws new ones beside them
    peak = peak_rss()
    return {"seconds": statistics.median(times), "peak_rss": peak, "baseline_rss": baseline_rss}


def loglog_slope(points: list[tuple[float, float]]) -> float:
    """The least-squares slope of log y against log x: the exponent k of y ~ x^k.

    Fitted over every point rather than read from the last two, so that one slow repetition at the
    longest T does not decide the exponent.
    """
    xs, ys = [math.log(x) for x, _ in points], [math.log(y) for _, y in points]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    if spread == 0:
        raise ValueError("points: a slope needs at least two different x")
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread


def _measure(system: str, length: int, repeats: int) -> dict[str, float]:
    code = (
        "import json; from attnlab.bench.attention import point; "
        f"print(json.dumps(point({system!r}, {length}, {repeats})))"
    )
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    if completed.returncode != 0:
        raise RuntimeError(f"attention benchmark point {system} T={length} failed: {completed.stderr.strip()[-400:]}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


def run_attention(quick: bool = False, repeats: int = MIN_REPEATS, plot: Path | None = None) -> BenchResult:
    lengths = QUICK_LENGTHS if quick else FULL_LENGTHS
    result = BenchResult("attention")
    measured: dict[str, list[tuple[int, float, float]]] = {s: [] for s in SYSTEMS}
    baselines: list[int] = []
    for length in lengths:
        for system in SYSTEMS:
            naive_bytes = 3 * HEADS * length * length * 4  # scores, weights and their gradient
            if system == "naive" and naive_bytes > NAIVE_LIMIT_BYTES:
                result.notes.append(
                    f"naive skipped at T={length}: it would hold ~{naive_bytes / 2**30:.0f} GiB of T x T tensors"
                )
                continue
            values = _measure(system, length, repeats)
            result.add(system, f"seconds_T{length}", values["seconds"], "s")
            result.add(system, f"peak_rss_T{length}", values["peak_rss"] / 2**20, "MiB")
            baselines.append(values["baseline_rss"])
            measured[system].append((length, values["seconds"], values["peak_rss"]))
    longest = lengths[-1]
    for system in ("soft", "hard"):
        result.ratios[f"{system}_peak_rss_GiB_T{longest}"] = result.value(system, f"peak_rss_T{longest}") / 1024
        if not quick:
            result.targets[f"{system}_peak_rss_GiB_T{longest}"] = ("<=", 1.0)
    for system, points in measured.items():
        if len(points) >= 2:  # 2 for quadratic work
            result.ratios[f"{system}_time_exponent"] = loglog_slope([(t, s) for t, s, _ in points])
    result.notes.append(
        f"peak RSS includes the interpreter and torch: {max(baselines) / 2**20:.0f} MiB before a point's first tensor"
    )
    if plot is not None:
        _plot(measured, plot)
        result.notes.append(f"plot: {plot}")
    return result


def _plot(measured: dict[str, list[tuple[int, float, float]]], path: Path) -> None:
    from attnlab.figures import plt, save_figure  # matplotlib stays out of the measuring subprocesses

    fig, (time_axis, memory_axis) = plt.subplots(1, 2, figsize=(10, 4))
    for system, points in measured.items():
        if not points:
            continue
        lengths = [p[0] for p in points]
        time_axis.loglog(lengths, [p[1] for p in points], "o-", label=system, base=2)
        memory_axis.loglog(lengths, [p[2] / 2**20 for p in points], "o-", label=system, base=2)
    if measured["soft"]:
        t0, s0 = measured["soft"][0][0], measured["soft"][0][1]
        reference = [t0 * 2**i for i in range(len(measured["soft"]))]
        time_axis.loglog(reference, [s0 * (t / t0) ** 2 for t in reference], ":", color="grey", label="~T^2", base=2)
    time_axis.set(xlabel="sequence length T", ylabel="forward + backward (s)", title="time: O(T^2 d) work")
    memory_axis.set(xlabel="sequence length T", ylabel="peak RSS (MiB)", title="memory: O(T) fused vs O(T^2) naive")
    for axis in (time_axis, memory_axis):
        axis.grid(alpha=0.3, which="both")
        axis.legend()
    fig.tight_layout()
    save_figure(fig, path)
