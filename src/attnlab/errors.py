"""The errors attnlab raises for a person to read.

Library code raises these; only :mod:`attnlab.cli` turns them into a one-line message and
the class's :attr:`~AttnlabError.exit_code`. Each message names the field, file or line at fault.
``ConfigError`` and ``DataError`` are also ``ValueError`` so that plain Python callers can catch
them as such.

Exit codes (the README and ``attnlab --help`` list them):

* 0: success;
* 1: an internal error (a bug in attnlab: the CLI prints its type and message on one line;
  ``ATTNLAB_TRACEBACK=1`` shows the traceback);
* 2: bad usage or input (a key, value, flag, path or text that cannot be used as given, a number
  outside its field's documented range or cap (:mod:`attnlab.resources`); also click's usage
  errors and a file the system refuses to open or create);
* 3: corrupt or unreadable data (a run directory, checkpoint or file that fails verification);
* 4: not enough resources (:class:`ResourceError`): a valid request that this machine cannot hold,
  refused before work by a resource estimate (memory), memory that ran out during the work, or no
  room to write (a full disk, a quota or a file-size limit: ENOSPC, EDQUOT, EFBIG);
* 5: a diverged run (the loss became NaN or Inf).

Beside them, :func:`check_value_types`: the one type check of configuration values (the model
configs, the task options, ``[train]``), whose failure is the commonest ``ConfigError``; it also
holds every integer within the range a config may give (:mod:`attnlab.limits`), seeds in theirs. It lives
here, at the bottom of the imports, so that the model (:mod:`attnlab.nn`) and the tasks
(:mod:`attnlab.tasks`) share it without importing each other.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from typing import Any

from attnlab.limits import MAX_CONFIG_INT, MAX_SEED, describe_int

EXIT_INTERNAL = 1
EXIT_USAGE = 2
EXIT_CORRUPT = 3
EXIT_RESOURCES = 4
EXIT_DIVERGED = 5


class AttnlabError(Exception):
    """Base class: an error whose message is meant for a person, not a traceback."""

    exit_code: int = EXIT_USAGE


class ConfigError(AttnlabError, ValueError):
    """An invalid configuration key or value."""


class DataError(AttnlabError, ValueError):
    """A bad input file or example: names the file and, where there is one, the line."""


class CheckpointError(AttnlabError):
    """A missing, truncated or corrupted checkpoint or run directory."""

    exit_code = EXIT_CORRUPT


class UsageError(AttnlabError):
    """A request that cannot be carried out as asked (bad head index, bad percentage, ...)."""


class ModelRequestError(UsageError, ValueError):
    """A request a model cannot serve, from :mod:`attnlab.nn` (a UsageError, exit 2, and a
    ValueError, which callers that name the flag catch to say which one): a site name or glob that
    matches none of its named sites, a selection or value that does not fit a site, a head mask of
    the wrong kind or shape."""


class ResourceError(AttnlabError):
    """A request that is valid but needs more than this machine has (a memory estimate above the
    memory available, an allocation that failed, or a disk with no room for a file it writes):
    reduce the size named in the message, or free space where it names."""

    exit_code = EXIT_RESOURCES


class AttnlabWarning(UserWarning):
    """Something a person should know that does not stop the work (an old run without a manifest,
    a resume at another thread count). Raised with :func:`warnings.warn`; the CLI prints each as one
    ``warning: ...`` line on stderr, Python callers see an ordinary warning."""


def check_field_types(config: Any) -> None:
    """Reject values of the wrong type (a TOML string where an int belongs, a float for an int)."""
    check_value_types(type(config), {f.name: getattr(config, f.name) for f in dataclasses.fields(config)})


def check_value_types(cls: type, values: Mapping[str, Any]) -> None:
    """The check of :func:`check_field_types`, on values meant for dataclass ``cls``'s fields
    before it is built (its ``__post_init__`` may compare them)."""
    hints = typing.get_type_hints(cls)
    for name, value in values.items():
        expected = _runtime_types(hints[name])
        ok = isinstance(value, expected) and not (isinstance(value, bool) and bool not in expected)
        if not ok:
            names = " or ".join("None" if t is type(None) else t.__name__ for t in expected)
            raise ValueError(f"{name}: expected {names}, got {value!r}")
        if isinstance(value, float) and not math.isfinite(value):  # TOML has nan and inf literals
            raise ValueError(f"{name}: must be a finite number, got {value!r}")
        if isinstance(value, int) and not isinstance(value, bool):
            _check_int_range(name, value)


def _check_int_range(name: str, value: int) -> None:
    """A seed lies in [0, :data:`~attnlab.limits.MAX_SEED`]; any other integer within
    +-:data:`~attnlab.limits.MAX_CONFIG_INT` (it becomes a tensor size or a 64-bit integer)."""
    if name == "seed" and not 0 <= value <= MAX_SEED:
        raise ValueError(f"seed: must lie in [0, {MAX_SEED:,}] (attnlab.limits.MAX_SEED), got {describe_int(value)}")
    if abs(value) > MAX_CONFIG_INT:
        raise ValueError(
            f"{name}: {describe_int(value)} is too large for this key "
            f"(integers lie within +-{MAX_CONFIG_INT:,}, attnlab.limits.MAX_CONFIG_INT)"
        )


def _runtime_types(hint: Any) -> tuple[type, ...]:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return tuple(t for arg in typing.get_args(hint) for t in _runtime_types(arg))
    if typing.get_origin(hint) is not None:  # list[str], dict[str, list[int]]: check the container
        return (typing.get_origin(hint),)
    if hint is float:  # a float option accepts an int (TOML `lr = 1`)
        return (float, int)
    return (hint,)
