"""Every numeric option of every command has a range checked at parse time (issue 37, "Bounded
everything"): a huge value, a negative one and a 5,000-digit one are one ``error:`` line naming the
option, exit code 2, before the command starts. The options are found by walking the CLI, so a new
option without a cap fails here."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, get_args

import pytest
import typer

from attnlab.cli import main
from attnlab.cli.app import app

NEGATIVE_ALLOWED: frozenset[str] = frozenset()
"""Options (``command --option``) where a negative number means something; none today."""

HUGE = str(10**30)
"""Past every cap, and past int64: the overflow that once reached torch.manual_seed."""

DIGITS = "9" * 5_000
"""Past Python's 4,300-digit limit on converting a string to an int."""


def _numeric(param: Any) -> type | None:
    """``int`` or ``float`` for an option that takes numbers (one or a list), else None."""
    annotation = getattr(param, "type_descriptor", None) and param.type_descriptor.annotation
    for kind in (int, float):
        if annotation is kind or kind in get_args(annotation):
            return kind
    return None


def _commands(command: Any, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    if getattr(command, "commands", None):
        return [leaf for name, sub in sorted(command.commands.items()) for leaf in _commands(sub, (*path, name))]
    return [(path, command)]


def _numeric_options() -> list[tuple[tuple[str, ...], Any, Any]]:
    root = typer.main.get_command(app)
    return [
        (path, command, param)
        for path, command in _commands(root)
        for param in command.params
        if param.param_type_name == "option" and _numeric(param) is not None
    ]


OPTIONS = _numeric_options()


def _filler(command: Any, tested: Any) -> list[str]:
    """Values for the command's other required options and its arguments, so that only the tested
    option can be wrong."""
    args: list[str] = []
    for param in command.params:
        if param is tested or not param.required:
            continue
        if param.param_type_name == "argument":
            args.append("x")
        else:
            value = str(param.min if _numeric(param) is not None and param.min is not None else 1)
            choices = param.type_descriptor.choices if param.type_descriptor.is_choice else None
            if _numeric(param) is None:
                value = str(getattr(choices[0], "value", choices[0])) if choices else "x"
            args += [param.opts[0], value]
    return args


def _ids() -> list[str]:
    return [" ".join((*path, param.opts[0])) for path, _, param in OPTIONS]


def test_the_walk_finds_the_options_of_every_kind():
    """The walk reaches subcommands and lists, ints and floats: a broken walk cannot pass vacuously."""
    found = set(_ids())
    for name in ("generate --seed", "generate --temperature", "heads prune --percent", "word2vec --epochs"):
        assert name in found, sorted(found)
    assert len(found) >= 20


@pytest.mark.parametrize(("path", "command", "param"), OPTIONS, ids=_ids())
def test_every_numeric_option_has_a_documented_range(path, command, param):
    name = " ".join((*path, param.opts[0]))
    assert param.max is not None and math.isfinite(param.max), f"{name}: no cap (max=)"
    assert param.min is not None, f"{name}: no lower bound (min=)"
    assert param.min >= 0 or name in NEGATIVE_ALLOWED, f"{name}: negative values allowed"


@pytest.mark.parametrize(("path", "command", "param"), OPTIONS, ids=_ids())
def test_out_of_range_values_are_one_usage_error_naming_the_option(path, command, param, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    values = [HUGE, DIGITS]
    if " ".join((*path, param.opts[0])) not in NEGATIVE_ALLOWED:
        values.append("-1")
    if _numeric(param) is float:
        values += ["nan", "inf", "1e999"]
    for value in values:
        with pytest.raises(SystemExit) as exited:
            main([*path, param.opts[0], value, *_filler(command, param)])
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert exited.value.code == 2, (value[:20], err)
        assert len(lines) == 1 and lines[0].startswith("error: "), err
        assert f"Invalid value for '{param.opts[0]}'" in lines[0], lines[0]  # click's parse-time check
        assert len(lines[0]) < 400, lines[0]  # the 5,000 digits are not echoed
    assert list(Path(tmp_path).iterdir()) == []  # no work started: nothing written
