"""``attnlab bench``: measure attnlab against PyTorch and Hugging Face in the same run."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from attnlab.cli.app import app
from attnlab.cli.choices import Benchmark
from attnlab.cli.options import progress_option
from attnlab.errors import UsageError


@app.command()
def bench(
    name: Benchmark = typer.Argument(
        ..., help="The benchmark to run, or all of them (but lm, hf, sweep, tl, bridge and gpu, run by name)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (a list of them for `all`)."),
    quick: bool = typer.Option(False, "--quick", help="Small sizes: a smoke test of every code path."),
    save: Path = typer.Option(None, "--save", help="Write <name>.json (and plots) into this folder."),
    progress: bool = progress_option(
        "On stderr: with `all` a bar over the benchmarks; with `tl` its steps, a bar over each task and "
        "each row as it is measured."
    ),
    python: str = typer.Option(
        None,
        "--python",
        metavar="PATH",
        help="tl only: run TransformerLens by this Python (an environment with torch, transformers and "
        "transformer_lens; attnlab not needed). Default: attnlab's own Python.",
    ),
) -> None:
    """Time attnlab and the systems a user would pick instead: medians of 5+ runs, and their ratios.

    Every system runs on the CPU (the figures compare CPU implementations), so there is no --device;
    except gpu, which runs attnlab and transformers on a CUDA GPU (benchmarks/gpu.sh).
    """
    # Imported when the command runs: the help pages load no torch (see attnlab.cli).
    from tqdm import tqdm

    from attnlab.bench import BENCHMARKS, NOT_IN_ALL, run_benchmark
    from attnlab.bench.harness import format_table
    from attnlab.run.output_paths import check_output_path
    from attnlab.run.storage import atomic_write_text
    from attnlab.runtime import keep_freed_memory

    name = name.value
    names = [b for b in BENCHMARKS if b not in NOT_IN_ALL] if name == "all" else [name]
    if python is not None and name != "tl":
        raise UsageError(f"--python: only `bench tl` runs its peers in another Python, not `bench {name}`")
    if save is not None:
        check_output_path(save, kind="folder", flag="--save")
    keep_freed_memory()  # as `attnlab train` does; every system timed here shares this process
    outputs = []
    for benchmark in tqdm(names, desc="bench", unit="benchmark", disable=not progress or len(names) == 1):
        if benchmark == "tl":  # its own options: the Python of TransformerLens, progress
            from attnlab.bench.tl import run_tl  # as attnlab.bench does: a benchmark's module when it runs

            result = run_tl(quick, python=python, progress=progress)
        else:
            result = run_benchmark(benchmark, quick=quick, plots=save)
        outputs.append(result.to_json())
        if save is not None:
            atomic_write_text(save / f"{benchmark}.json", result.dumps() + "\n")
        if not as_json:
            typer.echo(format_table(result))
    if as_json:
        typer.echo(json.dumps(outputs[0] if len(outputs) == 1 else outputs))
