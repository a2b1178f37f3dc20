"""Names a package offers without importing their modules until first used (PEP 562).

``import attnlab`` loads no PyTorch, yet ``attnlab.EncoderDecoder`` works; ``from attnlab.run
import open_run`` works, yet ``from attnlab.run.storage import atomic_write`` (which modules low in
the layers use) loads none of the task and model code ``open_run`` needs. A package lists each
name with the module that defines it::

    __getattr__, __dir__ = lazy_exports(__name__, {"open_run": "attnlab.run.loaded"})

Each name is imported on first access, then kept in the package like any attribute.
"""

from __future__ import annotations

import importlib
import sys

TYPE_CHECKING = False  # not typing's: `import attnlab` imports no typing (the names below are annotations)
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping
    from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, homes: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` of ``package`` that give each name of ``homes``
    (name -> the module defining it) from its module, imported on first use."""

    def __getattr__(name: str) -> Any:  # noqa: N807 - the module hook of PEP 562
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(homes[name]), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:  # noqa: N807
        return sorted(set(vars(sys.modules[package])) | set(homes))

    return __getattr__, __dir__
