"""Writing matplotlib figures: headless backend, PNG through a temporary file and a rename."""

from __future__ import annotations

from pathlib import Path

import matplotlib

from attnlab.run.storage import atomic_write

matplotlib.use("Agg")  # files only; never a window
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

__all__ = ["plt", "Figure", "save_figure"]


def save_figure(fig: Figure, path: Path, *, dpi: int = 110) -> Path:
    """Write ``fig`` as PNG atomically (a reader never sees half an image), then close it.

    Raises:
        UsageError: ``path`` cannot be written (see :func:`attnlab.run.storage.atomic_write`).
    """
    path = Path(path)
    try:
        atomic_write(path, lambda handle: fig.savefig(handle, format="png", dpi=dpi), "wb")
    finally:
        plt.close(fig)
    return path
