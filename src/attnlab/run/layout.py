"""The layout of a run directory: the names of its files and folders, and where its checkpoints are.

Layout::

    RUN/
      manifest.json               size and SHA-256 of config.json, tokenizer.json, model.safetensors,
                                  provenance.json and each committed checkpoint's manifest.json
      config.json                 the fully resolved experiment config
      tokenizer.json              the tokenizer or task vocabulary, when there is one
      model.safetensors           the latest weights (what `eval`, `generate`, `heads`, `view` load)
      checkpoint.json             {"latest": "step-00000100", "step": 100}: the commit record
      checkpoints/step-XXXXXXXX/  model.safetensors, trainer_state.safetensors, trainer_state.json
                                  (with "validation" when the run was evaluated at that step, and
                                  "metrics": the lines, size and SHA-256 metrics.jsonl had then),
                                  manifest.json (their sizes and SHA-256)
      metrics.jsonl               one JSON object per logged step or evaluation
      provenance.json             for an imported model: its source files' paths, sizes, SHA-256
      plots/  analysis/
      tensorboard/                TensorBoard event files, with train.log_to = ["jsonl", "tensorboard"]
      .lock                       the writer's lock (attnlab.run.lock): one writer at a time

:class:`RunLayout` holds these names and the paths made of them; what reads the files is
:mod:`attnlab.run.reading`, what writes them :mod:`attnlab.run.writing`, and
:class:`~attnlab.run.directory.RunDir` (opening a run) is all of them together.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from attnlab.run import manifest as manifests
from attnlab.run.lock import LOCK_NAME
from attnlab.run.metrics_log import MetricsTally
from attnlab.run.storage import ensure_folder

__all__ = ["CheckpointFiles", "RunLayout"]


@dataclass(frozen=True)
class CheckpointFiles:
    """The files of one complete checkpoint."""

    step: int
    directory: Path

    @property
    def model(self) -> Path:
        return self.directory / "model.safetensors"

    @property
    def trainer_tensors(self) -> Path:
        return self.directory / "trainer_state.safetensors"

    @property
    def trainer_json(self) -> Path:
        return self.directory / "trainer_state.json"


class RunLayout:
    """The names of a run's files and the paths made of them (the base of
    :class:`~attnlab.run.directory.RunDir`, which opens a run)."""

    CONFIG = "config.json"
    TOKENIZER = "tokenizer.json"
    MODEL = "model.safetensors"
    POINTER = "checkpoint.json"
    METRICS = "metrics.jsonl"
    PROVENANCE = "provenance.json"
    KERNELS = "kernels.json"  # the kernel chosen for each shape class (attnlab.kernels.calibration)
    MANIFEST = manifests.NAME
    LOCK = LOCK_NAME  # the writer's lock (attnlab.run.lock); its presence alone means nothing

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._warned: set[Path] = set()
        self._metrics_tally: MetricsTally | None = None  # what this process appended (append_metrics)

    # ---- folders ------------------------------------------------------------------------------

    @property
    def plots(self) -> Path:
        return self._folder("plots")

    @property
    def analysis(self) -> Path:
        return self._folder("analysis")

    def _folder(self, name: str) -> Path:
        return ensure_folder(self.path / name)

    @property
    def tokenizer_path(self) -> Path:
        return self.path / self.TOKENIZER

    # ---- places ------------------------------------------------------------------------------

    def _relative(self, path: Path) -> str:
        return path.relative_to(self.path).as_posix()

    def _manifest_place(self, relative: str) -> tuple[Path, str]:
        """The folder whose manifest covers ``relative``, and the name it has there."""
        parts = PurePosixPath(relative).parts
        if len(parts) == 1:
            return self.path, parts[0]
        if len(parts) == 3 and parts[0] == "checkpoints" and parts[2] == self.MANIFEST:
            return self.path, relative  # a checkpoint's manifest: recorded in the run's
        if len(parts) == 3 and parts[0] == "checkpoints":
            return self.path / parts[0] / parts[1], parts[2]
        raise ValueError(f"{relative}: no manifest covers this path")

    def checkpoints(self) -> list[CheckpointFiles]:
        """Every complete checkpoint, oldest first."""
        folder = self.path / "checkpoints"
        if not folder.is_dir():
            return []
        found = [
            CheckpointFiles(int(p.name[len("step-") :]), p)
            for p in folder.iterdir()
            if re.fullmatch(r"step-\d{8}", p.name) and p.is_dir()
        ]
        return sorted(found, key=lambda files: files.step)

    def __iter__(self) -> Iterator[Path]:
        return iter(sorted(self.path.iterdir()))
