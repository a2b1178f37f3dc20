"""The errors attnlab raises for a person to read.

Library code raises these; only :mod:`attnlab.cli` turns them into a one-line message and
exit code 2. Each message names the field, file or line at fault. ``ConfigError`` and
``DataError`` are also ``ValueError`` so that plain Python callers can catch them as such.
"""

from __future__ import annotations


class AttnlabError(Exception):
    """Base class: an error whose message is meant for a person, not a traceback."""


class ConfigError(AttnlabError, ValueError):
    """An invalid configuration key or value."""


class DataError(AttnlabError, ValueError):
    """A bad input file or example: names the file and, where there is one, the line."""


class CheckpointError(AttnlabError):
    """A missing, truncated or corrupted checkpoint or run directory."""


class UsageError(AttnlabError):
    """A request that cannot be carried out as asked (bad head index, bad percentage, ...)."""
