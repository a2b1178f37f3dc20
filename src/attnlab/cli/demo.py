"""``attnlab demo``: train a small encoder-decoder on `reverse` and show what it learned.

No arguments, no network: it trains for about two minutes on two CPU cores, prints the held-out
(test split) sequence accuracy, decodes three test examples and saves an attention heatmap.
"""

from __future__ import annotations

import time
from pathlib import Path

import typer

from attnlab.cli.app import app
from attnlab.cli.options import device_option, json_option, print_json, progress_option

DEMO_CONFIG = {
    "task": {
        "name": "reverse",
        "max_train_length": 8,
        "num_symbols": 8,
        "train_size": 4000,
        "valid_size": 200,
        "test_size": 200,
        "length_generalisation_size": 200,
        "seed": 0,
    },
    "model": {
        "kind": "encoder_decoder",
        "layers": 2,
        "d_model": 64,
        "heads": 4,
        "d_ff": 128,
        "dropout": 0.0,
        "positional": "sinusoidal",
    },
    "train": {
        "steps": 1200,
        "batch_size": 64,
        "lr": 2e-3,
        "schedule": "noam",
        "warmup": 100,
        "log_every": 50,
        "eval_every": 0,
        "checkpoint_every": 400,
        "seed": 0,
    },
}
"""The demo's experiment: the same keys as a configs/*.toml file."""


@app.command()
def demo(
    out: Path = typer.Option(None, "--out", help="Run directory to create (default runs/demo-<time>)."),
    progress: bool = progress_option(),
    device: str = device_option(),
    as_json: bool = json_option(
        "Print one JSON object: run, seconds, test accuracy, three decoded examples, the pictures (notes on stderr)."
    ),
) -> None:
    """Train a small encoder-decoder to reverse strings, report its accuracy, and draw its attention."""
    from attnlab.analysis.maps import attention_view
    from attnlab.evaluation.evaluate import evaluate
    from attnlab.experiment import ExperimentConfig
    from attnlab.figures import layer_grid
    from attnlab.run.loaded import open_run
    from attnlab.run.output_paths import check_output_path
    from attnlab.training.trainer import train

    experiment = ExperimentConfig.from_dict({**DEMO_CONFIG, "train": {**DEMO_CONFIG["train"], "device": device}})
    run_path = out or Path("runs") / f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    check_output_path(run_path, kind="run", flag="--out")
    typer.echo(f"training an encoder-decoder to reverse strings of up to 8 symbols ({run_path})", err=as_json)
    started = time.perf_counter()
    train(experiment, run_path, progress=progress)
    loaded = open_run(run_path, device=device)
    metrics = evaluate(loaded.model, loaded.task, "test", kind="encoder_decoder", tokenizer=None, progress=progress)
    seconds = time.perf_counter() - started
    examples = loaded.task.split("test")[:3]
    decoded = []
    for example in examples:
        text = loaded.codec.decode(list(example.source[:-1]))
        decoded.append((text, attention_view(loaded, text).output))
    view = attention_view(loaded, loaded.codec.decode(list(examples[0].source[:-1])))
    last_cross = [r for r in view.records if r.kind == "cross"][-1]
    queries, keys = view.axes["cross"]
    path = loaded.run.plots / "attention.png"
    layer_grid(
        last_cross.weights[0].cpu().numpy(),
        queries,
        keys,
        title=f"encoder-decoder attention, layer {last_cross.layer}",
        path=path,
    )
    if as_json:
        print_json(
            {
                "run": str(loaded.run.path),
                "seconds": seconds,
                "split": "test",
                "examples": metrics["examples"],
                "accuracy": metrics["accuracy"],
                "decoded": [{"input": text, "output": output} for text, output in decoded],
                "heatmap": str(path),
                "plots": str(loaded.run.plots),
            }
        )
        return
    typer.echo(f"trained in {seconds:.0f} s")
    typer.echo(f"held-out sequence accuracy (test split, {metrics['examples']} strings): {metrics['accuracy']:.3f}")
    for text, output in decoded:
        typer.echo(f"  {text} -> {output}")
    typer.echo(f"attention heatmap: {path}")
    typer.echo(f"loss and accuracy curves: {loaded.run.plots}")
