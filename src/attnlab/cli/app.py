"""The Typer application that every command module registers on.

Kept apart from ``cli/__init__.py`` so that command modules can import ``app`` without a cycle.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from enum import Enum
from typing import Any, get_args, get_origin

import typer
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

from attnlab import __version__

EXIT_CODES = (
    "Exit codes: 0 success; 1 internal error (set ATTNLAB_TRACEBACK=1 to see the traceback); "
    "2 bad usage or input (a number outside its documented cap included); 3 corrupt or unreadable data; "
    "4 not enough memory for the request (estimated before the work, or run out); 5 a diverged run (NaN or Inf loss). "
    "Every error is one 'error: ...' line on stderr."
)
"""The exit codes of every command (:mod:`attnlab.errors`), shown under ``attnlab --help``."""

_TYPE_NAMES = {str: "TEXT", int: "INTEGER", float: "FLOAT", bool: "BOOLEAN"}
"""Click's names for the value types, as its help pages show them."""


def _type_name(param: Any) -> str:
    """A parameter's value type as click names it: ``TEXT``, ``INTEGER RANGE``, ``PATH``, ``[a|b|c]``."""
    descriptor = param.type_descriptor
    if descriptor.is_choice:
        return "[" + "|".join(c.value if isinstance(c, Enum) else str(c) for c in descriptor.choices) + "]"
    if descriptor.is_path:
        return "PATH"
    annotation = descriptor.annotation
    if get_origin(annotation) is list:
        (annotation,) = get_args(annotation) or (str,)
    name = _TYPE_NAMES.get(annotation, getattr(annotation, "__name__", str(annotation)).upper())
    return f"{name} RANGE" if descriptor.is_ranged else name


class ClassicArgument(TyperArgument):
    """An argument shown as click shows it: ``RUN TEXTS...`` in the usage line, its type as ``PATH``."""

    def _usage_display_name(self) -> str:
        name = self.metavar or self.name.upper()
        name = name if self.required else f"[{name}]"
        return name + ("..." if self.nargs != 1 else "")

    def display_type_rich(self, ctx: Any) -> str | None:  # noqa: ARG002 - typer's signature
        return _type_name(self)

    def display_type(self, ctx: Any) -> str:  # noqa: ARG002 - typer's signature
        return _type_name(self)


class ClassicOption(TyperOption):
    """An option shown as click shows it: a flag without a type, a value as ``INTEGER`` or ``[a|b]``."""

    def display_type_rich(self, ctx: Any) -> str | None:  # noqa: ARG002 - typer's signature
        if self.is_flag:
            return None
        return self.metavar or _type_name(self)


def _classic_params(params: list[Any]) -> list[Any]:
    """``params`` with typer's argument and option classes swapped for the classic-help ones."""
    for param in params:
        if type(param) is TyperArgument:
            param.__class__ = ClassicArgument
        elif type(param) is TyperOption:
            param.__class__ = ClassicOption
    return params


class ClassicCommand(TyperCommand):
    """A command whose parameters (``--help`` included) show click's classic help."""

    def get_params(self, ctx: Any) -> list[Any]:
        return _classic_params(super().get_params(ctx))


class ClassicGroup(TyperGroup):
    """A group whose parameters and commands show click's classic help.

    typer 0.29 shows required arguments as ``{run}``, types as ``<path>`` and flags as ``<bool>``;
    the root group, built last from all commands, gives every command below it click's classic help
    (``Usage: attnlab encode [OPTIONS] RUN TEXTS...``, ``PATH``, no type on a flag).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _classic_commands(self)

    def get_params(self, ctx: Any) -> list[Any]:
        return _classic_params(super().get_params(ctx))


def _classic_commands(group: TyperGroup) -> None:
    """Give every command below ``group`` the classic help (typer builds them as its own classes)."""
    for command in group.commands.values():
        if type(command) is TyperCommand:
            command.__class__ = ClassicCommand
        elif type(command) is TyperGroup:
            command.__class__ = ClassicGroup
            _classic_commands(command)


@dataclass(frozen=True)
class CommandLine:
    """The arguments ``attnlab`` was run with (the context's ``obj``): what a command spread over
    N processes runs again in each (:mod:`attnlab.cli.processes`)."""

    args: tuple[str, ...]


def command_line(ctx: typer.Context) -> list[str]:
    """The arguments of this run of ``attnlab`` (``sys.argv[1:]`` when :func:`attnlab.cli.main`
    was not the entry point)."""
    obj = ctx.find_object(CommandLine)
    return list(obj.args) if obj is not None else sys.argv[1:]


app = typer.Typer(
    cls=ClassicGroup,
    name="attnlab",
    help="attnlab: an open laboratory for attention and Transformers.",
    epilog=EXIT_CODES,
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"attnlab {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """attnlab: build, train, decode, inspect and ablate attention models."""
