"""Writing matplotlib figures: headless backend, PNG through a temporary file and a rename."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never a window
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

__all__ = ["plt", "Figure", "save_figure"]


def save_figure(fig: Figure, path: Path, *, dpi: int = 110) -> Path:
    """Write ``fig`` as PNG atomically (a reader never sees half an image), then close it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=dpi)
    plt.close(fig)
    tmp.replace(path)
    return path
