"""Every flag (``--truncate``) and config key (``train.truncate``) an error or warning suggests exists.

The messages are read from attnlab's source with :mod:`ast`: the string constants and the constant
parts of f-strings inside each ``raise`` statement and each ``warn(...)`` call. A flag must be an
option of some command of the ``attnlab`` app; a ``section.key`` must be a key of that section of an
experiment config (any task's options, any model kind's fields, :class:`TrainConfig`'s fields).
"""

from __future__ import annotations

import ast
import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path

import attnlab

SOURCE = Path(attnlab.__file__).parent

FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
KEY = re.compile(r"(?<![\w.])(task|model|train)\.([a-z_][a-z0-9_]*)")
FILE_SUFFIXES = frozenset({"safetensors", "json", "jsonl", "txt", "csv", "png", "toml", "py"})
"""``model.safetensors``, ``train.txt``: file names, not config keys."""


def _strings(node: ast.AST) -> Iterator[str]:
    """The string constants under ``node``; an f-string's constant parts joined around a NUL."""
    inside_fstrings = {id(part) for sub in ast.walk(node) if isinstance(sub, ast.JoinedStr) for part in sub.values}
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str) and id(sub) not in inside_fstrings:
            yield sub.value
        elif isinstance(sub, ast.JoinedStr):
            yield "".join(part.value if isinstance(part, ast.Constant) else "\0" for part in sub.values)


def _is_message(node: ast.AST) -> bool:
    """A ``raise`` statement or a ``warn(...)`` / ``warnings.warn(...)`` call."""
    if isinstance(node, ast.Raise):
        return True
    if isinstance(node, ast.Call):
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        return name == "warn"
    return False


def suggestions(source: str, where: str = "<string>") -> list[tuple[str, str]]:
    """``(suggestion, "file:line")`` for each flag and ``section.key`` the messages in ``source`` name.

    Args:
        source: Python source code.
        where: its file name, for the locations.
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        if not _is_message(node):
            continue
        for text in _strings(node):
            found += [(flag, f"{where}:{node.lineno}") for flag in FLAG.findall(text)]
            found += [
                (match.group(0), f"{where}:{node.lineno}")
                for match in KEY.finditer(text)
                if match.group(2) not in FILE_SUFFIXES
            ]
    return found


def all_suggestions() -> list[tuple[str, str]]:
    found = []
    for path in sorted(SOURCE.rglob("*.py")):
        found += suggestions(path.read_text(encoding="utf-8"), str(path.relative_to(SOURCE)))
    return found


def cli_flags() -> set[str]:
    """Every option name (``--out``, ``--no-progress``) of every command of the ``attnlab`` app."""
    from typer.main import get_command

    from attnlab.cli import app

    flags: set[str] = set()
    pending = [get_command(app)]
    while pending:
        command = pending.pop()
        for param in command.params:
            flags.update(name for name in (*param.opts, *getattr(param, "secondary_opts", ())) if name.startswith("--"))
        pending.extend(getattr(command, "commands", {}).values())
    return flags


def config_keys() -> set[str]:
    """Every ``section.key`` an experiment config may hold."""
    from attnlab.experiment import TASK_DECIDES, TrainConfig
    from attnlab.nn import MODELS
    from attnlab.tasks.registry import TASKS, TEXT_TASK_EXTRAS, task_options

    task = {"name"} | {key for name in TASKS for key in task_options(name)}
    task |= {key for extras in TEXT_TASK_EXTRAS.values() for key in extras}
    model = {"kind"} | {name for config_cls, _ in MODELS.values() for name in config_cls.field_names()}
    model -= set(TASK_DECIDES)
    train = {field.name for field in dataclasses.fields(TrainConfig)}
    return {
        f"{section}.{key}" for section, keys in (("task", task), ("model", model), ("train", train)) for key in keys
    }


def test_every_suggested_flag_exists():
    flags = cli_flags()
    missing = [(flag, where) for flag, where in all_suggestions() if flag.startswith("--") and flag not in flags]
    assert not missing, f"messages suggest flags no command has: {missing}"


def test_every_suggested_config_key_exists():
    keys = config_keys()
    missing = [(key, where) for key, where in all_suggestions() if not key.startswith("--") and key not in keys]
    assert not missing, f"messages suggest config keys that do not exist: {missing}"


def test_the_scanner_finds_known_suggestions():
    found = {suggestion for suggestion, _ in all_suggestions()}
    # The too-long-input error of attnlab.tasks.batching suggests both.
    assert {"--truncate", "train.truncate", "--set"} <= found
    assert len(found) >= 20


def test_the_scanner_reports_what_does_not_exist():
    source = """
import warnings
def f(x):
    if x:
        raise ValueError(f"x: {x} is too big; try --no-such-flag or model.no_such_key, not model.safetensors")
    warnings.warn("set train.no_such_option=1", UserWarning)
    print("--not-a-message model.not_a_message")  # neither raised nor warned: not collected
"""
    found = [suggestion for suggestion, _ in suggestions(source)]
    assert found == ["--no-such-flag", "model.no_such_key", "train.no_such_option"]
    assert "--no-such-flag" not in cli_flags()
    assert not {"model.no_such_key", "train.no_such_option"} & config_keys()
    assert {"--truncate", "--out", "--set", "--no-progress"} <= cli_flags()
    assert {"train.truncate", "model.max_len", "model.kind", "task.name"} <= config_keys()
