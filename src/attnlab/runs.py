"""RunDir: the one place that reads and writes a run directory.

Layout::

    RUN/
      config.json                 the fully resolved experiment config
      tokenizer.json              the tokenizer or task vocabulary, when there is one
      model.safetensors           the latest weights (what `eval`, `generate`, `heads`, `view` load)
      checkpoint.json             {"latest": "step-00000100", "step": 100}: the commit record
      checkpoints/step-XXXXXXXX/  model.safetensors, trainer_state.safetensors, trainer_state.json
      metrics.jsonl               one JSON object per logged step or evaluation
      plots/  analysis/
      .lock                       the writer's lock (attnlab.runlock): one writer at a time

Why a checkpoint is a directory plus a pointer: resuming needs the weights *and* the optimizer, RNG
and data state from the same step. Each file is written atomically, but several files cannot be
renamed at once, so a checkpoint directory is written completely first and ``checkpoint.json`` is
then replaced atomically to point at it. A kill -9 at any instant leaves the pointer at a complete
checkpoint. The previous checkpoint is only deleted after the pointer has moved on.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from attnlab.errors import CheckpointError, UsageError
from attnlab.runlock import LOCK_NAME, RunLock
from attnlab.storage import (
    atomic_write_json,
    atomic_write_text,
    ensure_folder,
    fsync_directory,
    load_tensors,
    read_json,
    save_tensors,
)

__all__ = ["RunDir", "CheckpointFiles", "weights_to_tensors", "load_weights_into"]

_ALIASES_KEY = "attnlab.aliases"


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


class RunDir:
    """A run directory. Create one with :meth:`create`, open an existing one with :meth:`open`."""

    CONFIG = "config.json"
    TOKENIZER = "tokenizer.json"
    MODEL = "model.safetensors"
    POINTER = "checkpoint.json"
    METRICS = "metrics.jsonl"
    LOCK = LOCK_NAME  # the writer's lock (attnlab.runlock); its presence alone means nothing

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    # ---- opening ------------------------------------------------------------------------------

    @classmethod
    def create(cls, path: str | os.PathLike[str], *, overwrite: bool = False) -> RunDir:
        run = cls(path)
        if run.path.exists() and not run.path.is_dir():
            raise UsageError(f"run directory {run.path} is a file; choose another --out")
        if run.path.exists() and any(p.name != cls.LOCK for p in run.path.iterdir()) and not overwrite:
            raise UsageError(f"run directory {run.path} already exists and is not empty; choose another --out")
        ensure_folder(run.path)
        return run

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> RunDir:
        run = cls(path)
        if not run.path.is_dir():
            raise UsageError(f"run not found: {run.path}")
        if not (run.path / cls.CONFIG).is_file():
            raise UsageError(f"{run.path} is not a run directory: it has no {cls.CONFIG}")
        return run

    def lock(self, *, enabled: bool = True) -> RunLock:
        """The writer's lock on this run: hold it (``with run.lock(): ...``) while writing."""
        return RunLock(self.path, enabled=enabled)

    # ---- folders ------------------------------------------------------------------------------

    @property
    def plots(self) -> Path:
        return self._folder("plots")

    @property
    def analysis(self) -> Path:
        return self._folder("analysis")

    def _folder(self, name: str) -> Path:
        return ensure_folder(self.path / name)

    # ---- config and tokenizer -----------------------------------------------------------------

    def write_config(self, config: Mapping[str, Any]) -> None:
        atomic_write_json(self.path / self.CONFIG, dict(config))

    def read_config(self) -> dict[str, Any]:
        return read_json(self.path / self.CONFIG, what="run config")

    def write_tokenizer(self, text: str) -> None:
        atomic_write_text(self.path / self.TOKENIZER, text)

    @property
    def tokenizer_path(self) -> Path:
        return self.path / self.TOKENIZER

    # ---- weights ------------------------------------------------------------------------------

    def save_weights(self, model: nn.Module) -> None:
        tensors, metadata = weights_to_tensors(model)
        save_tensors(self.path / self.MODEL, tensors, metadata)

    def load_weights(self, model: nn.Module) -> None:
        path = self.path / self.MODEL
        if not path.exists() and self.latest_checkpoint() is not None:
            path = self.latest_checkpoint().model  # type: ignore[union-attr]
        load_weights_into(model, path)

    # ---- checkpoints --------------------------------------------------------------------------

    def write_checkpoint(
        self,
        step: int,
        model: nn.Module,
        trainer_tensors: Mapping[str, Tensor],
        trainer_state: Mapping[str, Any],
        *,
        keep: int = 2,
    ) -> CheckpointFiles:
        """Write a complete checkpoint, move the pointer to it, publish its weights, prune old ones."""
        files = CheckpointFiles(step, self.path / "checkpoints" / f"step-{step:08d}")
        latest = self.latest_checkpoint()
        if latest is not None and latest.step == step:  # already committed (e.g. the final step twice)
            return latest
        staging = files.directory.with_name(files.directory.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        weights, metadata = weights_to_tensors(model)
        save_tensors(staging / files.model.name, weights, metadata)
        save_tensors(staging / files.trainer_tensors.name, trainer_tensors)
        atomic_write_json(staging / files.trainer_json.name, {**trainer_state, "step": step})
        shutil.rmtree(files.directory, ignore_errors=True)
        os.replace(staging, files.directory)
        fsync_directory(files.directory.parent)
        self.point_to(files)
        self._prune_checkpoints(keep, current=files.directory.name)
        return files

    def point_to(self, files: CheckpointFiles) -> None:
        """Make ``files`` the latest checkpoint (what ``--resume`` starts from) and publish its weights."""
        atomic_write_json(self.path / self.POINTER, {"latest": files.directory.name, "step": files.step})
        self._publish_weights(files.model)

    def checkpoints(self) -> list[CheckpointFiles]:
        """Every complete checkpoint, oldest first."""
        folder = self.path / "checkpoints"
        if not folder.is_dir():
            return []
        found = [CheckpointFiles(int(p.name[len("step-"):]), p) for p in folder.iterdir()
                 if re.fullmatch(r"step-\d{8}", p.name) and p.is_dir()]
        return sorted(found, key=lambda files: files.step)

    def latest_checkpoint(self) -> CheckpointFiles | None:
        pointer = self.path / self.POINTER
        if not pointer.exists():
            return None
        record = read_json(pointer, what="checkpoint pointer")
        try:
            directory, step = self.path / "checkpoints" / str(record["latest"]), int(record["step"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"checkpoint pointer {pointer} is corrupted") from None
        if not directory.is_dir():
            raise CheckpointError(f"checkpoint pointer {pointer} names a missing directory {directory}")
        return CheckpointFiles(step, directory)

    def read_trainer_state(self, files: CheckpointFiles) -> tuple[dict[str, Tensor], dict[str, Any]]:
        tensors, _ = load_tensors(files.trainer_tensors, what="trainer state")
        return tensors, read_json(files.trainer_json, what="trainer state")

    def _publish_weights(self, source: Path) -> None:
        """model.safetensors := the checkpoint's weights (a hard link, renamed into place atomically)."""
        tmp = self.path / f".{self.MODEL}.link"
        tmp.unlink(missing_ok=True)
        try:
            os.link(source, tmp)
        except OSError:  # a filesystem without hard links: copy (still renamed atomically)
            shutil.copyfile(source, tmp)
        os.replace(tmp, self.path / self.MODEL)
        fsync_directory(self.path)

    def _prune_checkpoints(self, keep: int, *, current: str) -> None:
        complete = [files.directory for files in self.checkpoints()]
        stale = [p for p in (self.path / "checkpoints").iterdir()
                 if p.name.startswith("step-") and p.name.endswith(".partial")]  # left by a crash mid-write
        for old in complete[: max(0, len(complete) - keep)] + stale:
            if old.name != current:
                shutil.rmtree(old, ignore_errors=True)

    # ---- metrics ------------------------------------------------------------------------------

    def append_metrics(self, record: Mapping[str, Any]) -> None:
        """Append one JSON line with a single write, flushed to disk."""
        line = json.dumps(dict(record), sort_keys=True) + "\n"
        with open(self.path / self.METRICS, "a", encoding="utf-8") as handle:
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())

    def read_metrics(self) -> list[dict[str, Any]]:
        """All complete metric records; a torn last line (a crash mid-write) is ignored."""
        path = self.path / self.METRICS
        if not path.exists():
            return []
        records = []
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        for number, line in enumerate(lines, start=1):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                if number == len(lines) and not line.endswith("\n"):
                    break
                raise CheckpointError(f"{path}:{number}: not a JSON object") from None
        return records

    def truncate_metrics(self, last_step: int) -> None:
        """Drop records after ``last_step`` (on resume, so no step is logged twice)."""
        kept = [r for r in self.read_metrics() if int(r.get("step", 0)) <= last_step]
        atomic_write_text(self.path / self.METRICS, "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))

    def __iter__(self) -> Iterator[Path]:
        return iter(sorted(self.path.iterdir()))


def weights_to_tensors(model: nn.Module) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The state dict with tied tensors stored once; aliases go in the metadata."""
    tensors: dict[str, Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[int, int, tuple[int, ...]], str] = {}
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in seen and tensor.numel() > 0:
            aliases[name] = seen[key]
        else:
            seen[key] = name
            tensors[name] = tensor
    return tensors, {"format": "pt", _ALIASES_KEY: json.dumps(aliases)}


def load_weights_into(model: nn.Module, path: Path) -> None:
    """Load a safetensors file into ``model``; a missing, extra or mis-shaped tensor is named."""
    tensors, metadata = load_tensors(path, what="weights")
    try:
        aliases = json.loads(metadata.get(_ALIASES_KEY, "{}"))
    except json.JSONDecodeError:
        raise CheckpointError(f"weights {path} have corrupted metadata") from None
    for alias, canonical in aliases.items():
        if canonical in tensors:
            tensors[alias] = tensors[canonical]
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"weights {path} do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for name in expected:  # in the model's order, so the first mismatch named is always the same
        tensor = tensors[name]
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"weights {path}: tensor {name!r} has shape {tuple(tensor.shape)}, the model expects "
                f"{tuple(expected[name].shape)}"
            )
    model.load_state_dict(tensors, strict=True)
