"""Options that many commands share, defined once: ``--device``, ``--dtype``, ``--revision``,
``--verify``, ``--json`` and ``--progress``.

* ``--device auto|cpu|cuda|cuda:N`` on every command that runs a model; click checks the name and
  resolves it (:func:`attnlab.devices.resolve_device`) before the command starts, so a bad name or a
  GPU that is not there is click's one-line usage error naming ``--device`` (exit code 2).
* ``--json``: the command prints one JSON object on stdout and nothing else; progress bars, notes
  and warnings go to stderr (:func:`print_json`).
* ``--progress/--no-progress``: progress bars, always on stderr; on unless ``--no-progress``.

No torch at import: the device is resolved inside the option's callback, which resolves only
when the command runs (``--help`` exits before it; shell completion leaves the name unresolved).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from attnlab.errors import UsageError

DEVICE_METAVAR = "[auto|cpu|cuda|cuda:N]"
DEVICE_HELP = "Where to run the model: auto (the GPU when there is one, else the CPU), cpu, cuda or cuda:N."
PROGRESS_HELP = "Show progress bars (on stderr)."
JSON_HELP = "Print one JSON object on stdout (progress and notes go to stderr)."


def _resolve_device(ctx: typer.Context, value: str | None) -> str | None:
    """The ``--device`` callback: the resolved name (``auto`` -> ``cpu`` or ``cuda``), None if not given.

    Shell completion parses the command line too (resilient parsing): the name is then left as given.
    """
    if value is None or ctx.resilient_parsing:
        return value
    # Imported when the command runs: the help pages load no torch (see attnlab.cli).
    from attnlab.devices import resolve_device

    try:
        return str(resolve_device(value))
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None


def device_option(default: str | None = "auto", help: str = DEVICE_HELP) -> Any:  # noqa: A002 - typer's name
    """The ``--device`` option; its value reaches the command resolved: ``cpu``, ``cuda`` or ``cuda:N``."""
    return typer.Option(default, "--device", metavar=DEVICE_METAVAR, callback=_resolve_device, help=help)


DTYPES = ("float32", "bfloat16", "float16")
SOURCE_HELP = (
    "The model: a run directory, a Hugging Face model folder, the NAME or ORG/NAME of a model in the local "
    "Hugging Face cache (never downloaded), or a GGUF file."
)


def _check_dtype(ctx: typer.Context, value: str | None) -> str | None:
    if value is None or ctx.resilient_parsing or value in DTYPES:
        return value
    raise typer.BadParameter(f"unknown {value!r}; allowed: {', '.join(DTYPES)}")


def dtype_option() -> Any:
    """The ``--dtype`` option: the model's weights and computation in this dtype (default: as stored)."""
    return typer.Option(
        None,
        "--dtype",
        metavar="[float32|bfloat16|float16]",
        callback=_check_dtype,
        help="Run the model in this dtype (default: as its weights are stored; a run's are float32).",
    )


def revision_option() -> Any:
    """The ``--revision`` option: a snapshot of a model in the Hugging Face cache."""
    return typer.Option(
        None, "--revision", help="For a model in the Hugging Face cache: the snapshot (a commit or a ref such as main)."
    )


def verify_option() -> Any:
    """The ``--verify/--no-verify`` option: check source files that have a known SHA-256 (a named
    package's, a Hugging Face cache blob's: :mod:`attnlab.pretrained.provenance`) when they are opened."""
    return typer.Option(
        True,
        "--verify/--no-verify",
        help="Check files of named packages and Hugging Face cache blobs against their SHA-256 (hashes are cached).",
    )


def progress_option(help: str = PROGRESS_HELP) -> Any:  # noqa: A002 - typer's name
    """The ``--progress/--no-progress`` option (on by default; bars on stderr)."""
    return typer.Option(True, "--progress/--no-progress", help=help)


def json_option(help: str = JSON_HELP) -> Any:  # noqa: A002 - typer's name
    """The ``--json`` flag."""
    return typer.Option(False, "--json", help=help)


def print_json(result: Any) -> None:
    """Print ``result`` as one line of JSON on stdout (keys sorted; paths and other objects as strings)."""
    typer.echo(json.dumps(result, sort_keys=True, default=str))


# ---- placing a model over devices (attnlab.pretrained.placement) ---------------------------------------


def attention_option() -> Any:
    """``--attention``: soft attention's implementation, set once when the model is opened."""
    return typer.Option(
        None,
        "--attention",
        metavar="auto|sdpa|explicit|native",
        help="Soft attention's implementation, chosen once when the model is opened: auto (the kernel "
        "choice), sdpa, explicit or native (attnlab's C++ kernels). Default: a run's \\[runtime], else auto.",
    )


def device_map_option() -> Any:
    """The ``--device-map`` option of the commands that open a model."""
    return typer.Option(
        None,
        "--device-map",
        metavar="MAP",
        help="Place a Hugging Face model's layers over devices: auto, balanced, sequential, or a JSON object "
        '{"module": "device"} (cpu, cuda:N, disk); the plan is printed before any weight is read.',
    )


def max_memory_option() -> Any:
    """The ``--max-memory`` option (with ``--device-map``)."""
    return typer.Option(
        None,
        "--max-memory",
        metavar="DEVICE=SIZE,...",
        help="Each device's budget with --device-map, e.g. cuda:0=70GiB,cpu=20GiB.",
    )


def offload_folder_option() -> Any:
    """The ``--offload-folder`` option (with ``--device-map``)."""
    return typer.Option(
        None,
        "--offload-folder",
        help="With --device-map: where the layers no budget holds are written (safetensors) and mapped from.",
    )


def placed(
    device: str | None,
    device_map: str | None,
    max_memory: str | None,
    offload_folder: Path | None,
    *,
    tokens: int = 0,
    cached: tuple[str, ...] = (),
) -> dict[str, Any]:
    """``open_model``'s device and placement for the options: ``device`` alone, or a placement
    (parsed here: one UsageError naming the flag) whose plan is printed on stderr before any weight
    is read; ``tokens``, ``cached``: the positions the command keeps in its KV cache and the sites it
    caches over them (held back from the budgets)."""
    from attnlab.pretrained.placement import PlacementRequest  # lazy: torch is imported when a command runs

    if device_map is None:
        if max_memory is not None or offload_folder is not None:
            flag = "--max-memory" if max_memory is not None else "--offload-folder"
            raise UsageError(f"{flag}: only with --device-map")
        return {"device": device}
    chosen: Any = device_map
    if device_map.lstrip().startswith("{"):
        try:
            chosen = json.loads(device_map)
        except json.JSONDecodeError as error:
            raise UsageError(f"--device-map: not a JSON object: {error.msg} (column {error.colno})") from None
        if not isinstance(chosen, dict) or not all(isinstance(v, (str, int)) for v in chosen.values()):
            raise UsageError('--device-map: expected {"module": "device", ...}')
        chosen = {str(k): f"cuda:{v}" if isinstance(v, int) else v for k, v in chosen.items()}
    budget = None
    if max_memory is not None:
        budget = {}
        for part in max_memory.split(","):
            name, equals, size = part.strip().partition("=")
            if not equals or not name or not size:
                raise UsageError(f"--max-memory: {part.strip()!r} is not DEVICE=SIZE (e.g. cpu=20GiB)")
            budget[name.strip()] = size.strip()
    request = PlacementRequest(chosen, budget, offload_folder, tokens, cached)
    return {"device": None, "placement": request, "on_plan": _print_plan}


def _print_plan(placement: Any) -> None:
    typer.echo("placement:\n" + "\n".join(f"  {line}" for line in placement.describe().splitlines()), err=True)
