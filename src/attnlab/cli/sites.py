"""``attnlab sites``: the named sites of a run's model (attnlab.nn.hooks), with their shapes."""

from __future__ import annotations

from pathlib import Path

import typer

from attnlab.cli.app import app
from attnlab.cli.options import (
    SOURCE_HELP,
    device_map_option,
    device_option,
    dtype_option,
    json_option,
    max_memory_option,
    offload_folder_option,
    placed,
    print_json,
    revision_option,
    verify_option,
)


@app.command()
def sites(
    run: Path = typer.Argument(..., help=SOURCE_HELP),
    match: str = typer.Option(None, "--match", help="Only sites matching this name or glob, e.g. '*.attn.z'."),
    device: str = device_option(),
    device_map: str | None = device_map_option(),
    max_memory: str | None = max_memory_option(),
    offload_folder: Path | None = offload_folder_option(),
    dtype: str | None = dtype_option(),
    revision: str | None = revision_option(),
    verify: bool = verify_option(),
    as_json: bool = json_option("Print one JSON object: the sites with their shapes."),
) -> None:
    """List every named site of a run's model (what attnlab.trace caches and edits), with its shape.

    Shapes come from one forward pass of a few tokens; B is the batch, T the positions (T_k the
    keys of scores and pattern).
    """
    # Imported when the command runs: the help pages load no torch (see attnlab.cli).
    from attnlab.errors import UsageError
    from attnlab.nn.hooks import resolve_sites, site_shapes
    from attnlab.pretrained.sources import open_model

    loaded = open_model(
        run, dtype=dtype, revision=revision, verify=verify, **placed(device, device_map, max_memory, offload_folder)
    )
    shapes = site_shapes(loaded.model)
    named = {name: site for name, (site, _) in shapes.items()}
    try:
        names = resolve_sites(named, [match or "*"])
    except ValueError as error:
        raise UsageError(f"--match: {error}") from None
    rows = [
        {
            "name": name,
            "shape": shapes[name][1],
            "kind": named[name].kind,
            "layer": named[name].layer,
            "heads": named[name].head_axis is not None,
        }
        for name in names
    ]
    if as_json:
        print_json({"run": str(run), "sites": rows})
        return
    width = max(len(row["name"]) for row in rows)
    for row in rows:
        typer.echo(f"{row['name']:<{width}}  {row['shape']}" + (f"  heads of {row['kind']}" if row["heads"] else ""))
