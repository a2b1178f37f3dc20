"""The errors attnlab raises for a person to read.

Library code raises these; only :mod:`attnlab.cli` turns them into a one-line message and
the class's :attr:`~AttnlabError.exit_code`. Each message names the field, file or line at fault.
``ConfigError`` and ``DataError`` are also ``ValueError`` so that plain Python callers can catch
them as such.

Exit codes (the README and ``attnlab --help`` list them):

* 0: success;
* 1: an internal error (a bug in attnlab: the CLI prints its type and message on one line;
  ``ATTNLAB_TRACEBACK=1`` shows the traceback);
* 2: bad usage or input (a key, value, flag, path or text that cannot be used as given; also
  click's usage errors, a file the system refuses to open or create, and memory that runs out);
* 3: corrupt or unreadable data (a run directory, checkpoint or file that fails verification);
* 4: a diverged run (the loss became NaN or Inf).
"""

from __future__ import annotations

EXIT_INTERNAL = 1
EXIT_USAGE = 2
EXIT_CORRUPT = 3
EXIT_DIVERGED = 4


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


class AttnlabWarning(UserWarning):
    """Something a person should know that does not stop the work (an old run without a manifest,
    a resume at another thread count). Raised with :func:`warnings.warn`; the CLI prints each as one
    ``warning: ...`` line on stderr, Python callers see an ordinary warning."""
