"""RunDir: the one place that reads and writes a run directory.

:class:`RunDir` opens a run (:meth:`RunDir.create`, :meth:`RunDir.open`, :meth:`RunDir.staged`) and
is the three parts of the work together, each in its module:

* :mod:`attnlab.run.layout`: the run's files and folders (:class:`~attnlab.run.layout.CheckpointFiles`).
* :mod:`attnlab.run.reading`: every file read once and verified against its manifest; choosing a
  checkpoint; metrics.jsonl checked.
* :mod:`attnlab.run.writing`: each file written atomically and recorded in the manifest; checkpoints
  committed by a pointer and pruned; metrics appended.

Weights to and from tensors (tied tensors, older names) are :mod:`attnlab.run.weights`.

A run written all at once (``attnlab import``) is written by :meth:`RunDir.staged` under a
hidden temporary name beside its own and renamed into place once its weights and manifest are
written: a full disk or a kill leaves no run without weights under the name asked for.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from attnlab.errors import UsageError
from attnlab.run.lock import RunLock
from attnlab.run.storage import atomic_directory, ensure_folder
from attnlab.run.writing import RunWriter

__all__ = ["RunDir", "validation_record"]


class RunDir(RunWriter):
    """A run directory. Create one with :meth:`create`, open an existing one with :meth:`open`."""

    # ---- opening ------------------------------------------------------------------------------

    @classmethod
    def create(cls, path: str | os.PathLike[str], *, overwrite: bool = False) -> RunDir:
        """A run directory made now and written in place (a training run, read while it trains);
        a run written all at once is made with :meth:`staged`."""
        run = cls(path)
        cls._check_new(run.path, overwrite=overwrite)
        ensure_folder(run.path)
        (run.path / cls.MANIFEST).unlink(missing_ok=True)  # an overwritten run's records start afresh
        return run

    @classmethod
    @contextmanager
    def staged(cls, path: str | os.PathLike[str], *, overwrite: bool = False, lock: bool = True) -> Iterator[RunDir]:
        """A new run written whole or not at all (what an import writes): the run yielded lives in
        a hidden sibling ``.NAME.tmp-XXXXXXXX`` of ``path`` (:func:`~attnlab.run.storage.atomic_directory`),
        under its writer's lock, and appears at ``path`` when the block ends without error (its
        config, tokenizer, provenance, weights and manifest all written); on any error, a full disk
        included, nothing is left. Afterwards the run's :attr:`path` is ``path``.

        With ``overwrite`` an existing run's files are replaced one by one, each whole, under the
        lock of that run as well (a writer there is refused first), its other files kept as
        :meth:`create` keeps them.

        Args:
            path: the run directory to write.
            overwrite: replace the files of a run that stands there (``--force``).
            lock: hold the writer's lock on the run yielded; False when the code that fills it
                makes it with :meth:`create` and locks it itself (``import_bert``, ``import_gguf``
                given ``run.path``).

        Raises:
            UsageError: ``path`` is a file, or a non-empty folder without ``overwrite`` (checked
                again when the run is put in place), or another process writes there.
        """
        final = Path(path)
        cls._check_new(final, overwrite=overwrite)
        with ExitStack() as stack:
            if final.is_dir():
                stack.enter_context(RunLock(final))
            run = cls(stack.enter_context(atomic_directory(final, keep={cls.LOCK})))
            with run.lock(enabled=lock):
                yield run
            if not overwrite:
                cls._check_new(final, overwrite=False)  # a run that appeared there meanwhile is kept
        run.path = final

    @classmethod
    def _check_new(cls, path: Path, *, overwrite: bool) -> None:
        """Refuse a file at ``path``, or (unless ``overwrite``) a folder holding anything but a lock
        (and the hidden ``.NAME.tmp-*`` folder a staged write builds in it)."""
        if path.exists() and not path.is_dir():
            raise UsageError(f"run directory {path} is a file; choose another --out")
        staging = f".{path.name}.tmp-"
        held = (
            [p for p in path.iterdir() if p.name != cls.LOCK and not p.name.startswith(staging)]
            if path.exists()
            else []
        )
        if held and not overwrite:
            raise UsageError(f"run directory {path} already exists and is not empty; choose another --out")

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> RunDir:
        """An existing run. A config.json that is there but damaged (a folder, say) is found when read."""
        run = cls(path)
        if not run.path.is_dir():
            raise UsageError(f"run not found: {run.path}")
        if not os.path.lexists(run.path / cls.CONFIG):
            raise UsageError(f"{run.path} is not a run directory: it has no {cls.CONFIG}")
        return run

    def lock(self, *, enabled: bool = True) -> RunLock:
        """The writer's lock on this run: hold it (``with run.lock(): ...``) while writing."""
        return RunLock(self.path, enabled=enabled)


def validation_record(step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
    """What a checkpoint records of the validation at its step (``metrics`` from
    :func:`attnlab.evaluation.evaluate`): step, split, accuracy, loss."""
    return {"step": step, "split": metrics["split"], "accuracy": metrics["accuracy"], "loss": metrics["loss"]}
