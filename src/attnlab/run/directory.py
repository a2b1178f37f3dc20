"""RunDir: the one place that reads and writes a run directory.

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

Why a checkpoint is a directory plus a pointer: resuming needs the weights *and* the optimizer, RNG
and data state from the same step. Each file is written atomically, but several files cannot be
renamed at once, so a checkpoint directory is written completely first and ``checkpoint.json`` is
then replaced atomically to point at it. A kill -9 at any instant leaves the pointer at a complete
checkpoint. The previous checkpoint is only deleted after the pointer has moved on.

A run written all at once (``attnlab import``) is written by :meth:`RunDir.staged` under a
hidden temporary name beside its own and renamed into place once its weights and manifest are
written: a full disk or a kill leaves no run without weights under the name asked for.

Choosing a checkpoint (``attnlab eval --checkpoint``): ``last`` is the one ``checkpoint.json`` names,
``step-N`` that step's, and ``best`` the one whose recorded validation is best
(:meth:`RunDir.best_checkpoint`). Pruning old checkpoints (``train.keep_checkpoints``) keeps the
latest ones and the best one.

Integrity: every file a command reads is read once with :meth:`RunDir.read_verified`, which checks
the bytes against the manifest of their folder (:mod:`attnlab.run.manifest`) before they are parsed;
any difference is a :class:`~attnlab.errors.CheckpointError` naming the file (exit 3). A
checkpoint's manifest is written in its staging folder, so it is complete before the pointer moves.
``model.safetensors`` is published before ``manifest.json`` records it, so in between it is accepted
when it matches the record of the checkpoint the pointer names: a kill -9 at any instant leaves a
run that verifies. A run written before manifests existed opens with one :class:`AttnlabWarning`;
its next checkpoint gives it a manifest (recording its config and tokenizer as they are then).

What a run must hold once it has it: when a checkpoint is committed (the pointer moved to it), the
run's manifest records that checkpoint's manifest.json; from then on ``checkpoint.json`` and that
manifest are required (:meth:`RunDir.committed_checkpoints`), so deleting either is damage, not an
old run. A checkpoint's record leaves the run's manifest before the checkpoint is pruned or written
again, so a kill at any instant still leaves a run that verifies. metrics.jsonl is checked against
the record the latest checkpoint keeps of it (:mod:`attnlab.run.metrics_log`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from torch import Tensor, nn

from attnlab.errors import AttnlabWarning, CheckpointError, UsageError
from attnlab.nn.models import optional_state_keys
from attnlab.run import manifest as manifests
from attnlab.run.lock import LOCK_NAME, RunLock
from attnlab.run.manifest import (
    FileRecord,
    Manifest,
    check_record,
    describe_difference,
    parse_manifest,
    read_manifest,
    record_of,
    record_of_file,
)
from attnlab.run.metrics_log import KEY as METRICS_KEY
from attnlab.run.metrics_log import MetricsCheck, MetricsRecord, MetricsTally, check_metrics_bytes
from attnlab.run.storage import (
    atomic_directory,
    atomic_write_bytes,
    atomic_write_json,
    ensure_folder,
    file_identity,
    fsync_directory,
    map_tensors,
    parse_json,
    parse_tensors,
    read_bytes,
    read_json,
    stream_tensors,
    tensors_to_bytes,
)

__all__ = [
    "RunDir",
    "CheckpointFiles",
    "validation_record",
    "weights_to_tensors",
    "load_weights_into",
    "load_tensors_into",
    "RENAMED_PREFIXES",
]

_ALIASES_KEY = "attnlab.aliases"

RENAMED_PREFIXES: tuple[tuple[str, str], ...] = (("body.", "decoder."),)
"""State-dict prefixes renamed since weights were first written, (old, new): a decoder-only
model's stack was ``body`` until it took the name its sites have (``decoder``). Weights that hold
no key under the new prefix are read with the old one renamed (:func:`load_tensors_into`); the file
itself is never rewritten, so its manifest record still verifies."""


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
    PROVENANCE = "provenance.json"
    MANIFEST = manifests.NAME
    LOCK = LOCK_NAME  # the writer's lock (attnlab.run.lock); its presence alone means nothing

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._warned: set[Path] = set()
        self._metrics_tally: MetricsTally | None = None  # what this process appended (append_metrics)

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

    # ---- folders ------------------------------------------------------------------------------

    @property
    def plots(self) -> Path:
        return self._folder("plots")

    @property
    def analysis(self) -> Path:
        return self._folder("analysis")

    def _folder(self, name: str) -> Path:
        return ensure_folder(self.path / name)

    # ---- verified reading ---------------------------------------------------------------------

    def read_verified(self, relative: str, *, what: str = "file") -> bytes:
        """The bytes of ``relative`` (a path inside the run), read once and checked against its manifest.

        Parse the bytes returned, never the file again: what was checked is what is used.
        ``model.safetensors`` may also match the record of the checkpoint ``checkpoint.json`` names
        (it is published just before the run's manifest records it). A folder without a manifest
        (a run written before manifests) is read unverified, with one :class:`AttnlabWarning`.

        Raises:
            CheckpointError: the file is missing, not a regular file, unreadable, not listed in the
                manifest, or its size or SHA-256 differs; the message names the file.
        """
        data = read_bytes(self.path / relative, what=what)
        self._check_against_manifest(relative, lambda: record_of(data))
        return data

    def _check_against_manifest(self, relative: str, record: Callable[[], FileRecord]) -> None:
        """The checks of :meth:`read_verified` on the file's record (``record()``: computed only
        when its folder has a manifest)."""
        folder, name = self._manifest_place(relative)
        manifest = read_manifest(folder) if folder == self.path else self.checkpoint_manifest(folder)
        if manifest is None:
            self._warn_unverified(folder)
            return
        actual = record()
        try:
            check_record(manifest, name, actual, path=self.path / relative)
        except CheckpointError:
            if not (relative == self.MODEL and actual == self._pointed_checkpoint_record()):
                raise

    def read_config(self) -> Any:
        """The parsed config.json, verified (its sections are checked by ``ExperimentConfig.from_dict``)."""
        path = self.path / self.CONFIG
        return parse_json(self.read_verified(self.CONFIG, what="run config"), path=path, what="run config")

    def read_tokenizer_bytes(self) -> bytes | None:
        """The verified bytes of tokenizer.json; None when the run has none (a task vocabulary run)."""
        if not os.path.lexists(self.tokenizer_path):
            manifest = read_manifest(self.path)
            if manifest is not None and self.TOKENIZER in manifest.files:
                raise CheckpointError(f"tokenizer not found: {self.tokenizer_path} (listed in {self.MANIFEST})")
            return None
        return self.read_verified(self.TOKENIZER, what="tokenizer")

    def read_tokenizer_text(self) -> str | None:
        """The verified text of tokenizer.json; None when the run has none (a task vocabulary run)."""
        data = self.read_tokenizer_bytes()
        if data is None:
            return None
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as error:
            raise CheckpointError(
                f"tokenizer {self.tokenizer_path} is corrupted: bytes that are not UTF-8 (offset {error.start})"
            ) from None

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

    def checkpoint_manifest(self, folder: Path) -> Manifest | None:
        """The manifest of the checkpoint ``folder``, checked against its record in the run's
        manifest (written when the checkpoint was committed: :meth:`point_to`); None for a
        checkpoint written before manifests, which the run's manifest does not list.

        Raises:
            CheckpointError: the run's manifest lists it and it is missing or differs, or it is
                malformed; the message names it.
        """
        relative = self._relative(folder / self.MANIFEST)
        run_manifest = read_manifest(self.path)
        listed = run_manifest.files.get(relative) if run_manifest is not None else None
        path = folder / self.MANIFEST
        if not os.path.lexists(path):
            if listed is not None:
                raise CheckpointError(
                    f"manifest not found: {path} (the checkpoint was committed: {self.path / self.MANIFEST} lists it)"
                )
            return None
        data = read_bytes(path, what="manifest")
        difference = describe_difference(listed, data) if listed is not None else None
        if difference:
            raise CheckpointError(f"manifest {path} is damaged: {difference} ({self.path / self.MANIFEST})")
        return parse_manifest(data, path=path)

    def committed_checkpoints(self) -> list[str]:
        """The checkpoints (``step-N``) the run's manifest records as committed, oldest first: once
        there is one, ``checkpoint.json`` and each listed checkpoint's manifest must be there."""
        manifest = read_manifest(self.path)
        names = manifest.files if manifest is not None else {}
        pattern = re.compile(rf"checkpoints/(step-\d{{8}})/{re.escape(self.MANIFEST)}")
        return sorted(match.group(1) for name in names if (match := pattern.fullmatch(name)))

    def _warn_unverified(self, folder: Path) -> None:
        if folder != self.path and not self._has_manifest():
            folder = self.path  # a run written before manifests: one warning covers all its files
        if folder in self._warned:
            return
        self._warned.add(folder)
        where = f"run {self.path}" if folder == self.path else f"checkpoint {folder}"
        # stacklevel 2: one place in this module for every caller, so Python's default filter shows
        # the warning once per process even when several RunDir objects open the same run
        warnings.warn(
            f"{where} has no {self.MANIFEST} (written before attnlab verified run files): "
            f"its files are read unverified",
            AttnlabWarning,
            stacklevel=2,
        )

    def _has_manifest(self) -> bool:
        return os.path.lexists(self.path / self.MANIFEST)

    # ---- writing (each file, then its record in manifest.json) ------------------------------------

    def write_config(self, config: Mapping[str, Any]) -> None:
        self._write_file(self.CONFIG, (json.dumps(dict(config), indent=2, sort_keys=True) + "\n").encode("utf-8"))

    def write_tokenizer(self, text: str) -> None:
        self._write_file(self.TOKENIZER, text.encode("utf-8"))

    def write_provenance(self, sources: list[Mapping[str, Any]]) -> None:
        """provenance.json: the files an imported model was read from, each ``{"path", "size",
        "sha256", "checked"}`` (:mod:`attnlab.pretrained.provenance`), recorded in the manifest."""
        text = json.dumps({"sources": [dict(source) for source in sources]}, indent=2, sort_keys=True) + "\n"
        self._write_file(self.PROVENANCE, text.encode("utf-8"))

    def read_provenance(self) -> list[dict[str, Any]] | None:
        """The sources provenance.json records (verified); None for a run that has none (trained here).

        Raises:
            CheckpointError: the file differs from its manifest record or is malformed; names it.
        """
        path = self.path / self.PROVENANCE
        if not os.path.lexists(path):
            return None
        record = parse_json(self.read_verified(self.PROVENANCE, what="provenance"), path=path, what="provenance")
        sources = record.get("sources") if isinstance(record, dict) else None
        if not isinstance(sources, list) or not all(
            isinstance(s, dict) and isinstance(s.get("path"), str) and isinstance(s.get("sha256"), str) for s in sources
        ):
            raise CheckpointError(f"provenance {path} is corrupted: expected sources with a path and a sha256")
        return sources

    @property
    def tokenizer_path(self) -> Path:
        return self.path / self.TOKENIZER

    def _write_file(self, relative: str, data: bytes) -> None:
        atomic_write_bytes(self.path / relative, data)
        self._record({relative: record_of(data)})

    def _record(self, records: Mapping[str, FileRecord]) -> None:
        """Add ``records`` to the run's manifest (written atomically)."""
        current = read_manifest(self.path)
        if current is None:
            current = self._adopt(exclude=records)
        manifests.write_manifest(self.path, current.with_records(records))

    def _adopt(self, *, exclude: Mapping[str, FileRecord]) -> Manifest:
        """A first manifest for a run that has none: the files a command reads, as they are now."""
        return Manifest(
            {
                name: record_of_file(self.path / name)  # read in blocks: model.safetensors may be large
                for name in (self.CONFIG, self.TOKENIZER, self.MODEL)
                if name not in exclude and (self.path / name).is_file()
            }
        )

    # ---- weights ------------------------------------------------------------------------------

    def save_weights(self, model: nn.Module) -> None:
        self.save_state_dict(model.state_dict())

    def save_state_dict(self, state: Mapping[str, Tensor]) -> None:
        """Write model.safetensors from a state dict (tied tensors stored once), as :meth:`save_weights`
        does from a model: an import writes weights without building the model first."""
        tensors, metadata = state_to_tensors(state)
        stream_tensors(self.path / self.MODEL, tensors, metadata)
        self._record({self.MODEL: record_of_file(self.path / self.MODEL)})

    def load_weights(self, model: nn.Module) -> None:
        """Load model.safetensors (or, when it is missing, the latest checkpoint's), verified."""
        if not os.path.lexists(self.path / self.MODEL):
            latest = self.latest_checkpoint()
            if latest is not None:
                self.load_checkpoint_weights(model, latest)
                return
        self._load_verified_weights(model, self.MODEL)

    def load_checkpoint_weights(self, model: nn.Module, files: CheckpointFiles) -> None:
        """Load the weights of checkpoint ``files``, verified against its manifest."""
        self._load_verified_weights(model, self._relative(files.model))

    def _load_verified_weights(self, model: nn.Module, relative: str) -> None:
        """Hash the file in blocks against its manifest, memory-map it, and put the mapped tensors
        in the model in place of its own (no copy of the weights is held: `attnlab generate` peaks
        near one weights' size). The file's identity (inode, size, mtime) is the same before the
        hash and after the mapping, or the load is refused: what was checked is what is used."""
        path = self.path / relative
        before = file_identity(path, what="weights")
        self._verify_file(relative, what="weights")
        tensors, metadata = map_tensors(path, what="weights")
        if file_identity(path, what="weights") != before:
            raise CheckpointError(f"weights {path} changed while they were read; load them again")
        load_tensors_into(model, tensors, metadata, path=path, assign=True)

    def _verify_file(self, relative: str, *, what: str) -> None:
        """:meth:`read_verified`'s checks for a file hashed in blocks (never held in memory whole)."""
        path = self.path / relative

        def record() -> FileRecord:
            try:
                return record_of_file(path)
            except OSError as error:
                raise CheckpointError(f"{what} {path}: cannot read: {error.strerror or error}") from None

        self._check_against_manifest(relative, record)

    def _pointed_checkpoint_record(self) -> FileRecord | None:
        """The manifest record of the weights of the checkpoint the pointer names (None: none).
        ``model.safetensors`` may match it instead of its own record: it is published just before
        the run's manifest records it."""
        try:
            files = self.latest_checkpoint()
            manifest = self.checkpoint_manifest(files.directory) if files is not None else None
        except CheckpointError:  # a damaged pointer or manifest there: the mismatch found first is named
            return None
        return manifest.files.get(self.MODEL) if manifest is not None else None

    def _relative(self, path: Path) -> str:
        return path.relative_to(self.path).as_posix()

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
        """Write a complete checkpoint with its manifest, move the pointer to it, publish its weights,
        prune old ones."""
        files = CheckpointFiles(step, self.path / "checkpoints" / f"step-{step:08d}")
        latest = self.latest_checkpoint()
        if latest is not None and latest.step == step:  # already committed (e.g. the final step twice)
            return latest
        staging = files.directory.with_name(files.directory.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        weights, metadata = weights_to_tensors(model)
        metrics = self._tally().record().to_dict()  # metrics.jsonl as it is now (:mod:`attnlab.run.metrics_log`)
        state_text = json.dumps({**trainer_state, "step": step, METRICS_KEY: metrics}, indent=2, sort_keys=True) + "\n"
        contents = {
            files.model.name: tensors_to_bytes(weights, metadata),
            files.trainer_tensors.name: tensors_to_bytes(trainer_tensors),
            files.trainer_json.name: state_text.encode("utf-8"),
        }
        for name, data in contents.items():
            atomic_write_bytes(staging / name, data)
        manifests.write_manifest(staging, manifests.build_manifest(contents))  # before the rename: complete
        # a checkpoint written again (a step reached again after a fallback) is not required meanwhile
        self._forget_checkpoints([files.directory])
        shutil.rmtree(files.directory, ignore_errors=True)
        os.replace(staging, files.directory)
        fsync_directory(files.directory.parent)
        self.point_to(files)
        self._prune_checkpoints(keep, current=files.directory.name)
        return files

    def point_to(self, files: CheckpointFiles) -> None:
        """Make ``files`` the latest checkpoint (what ``--resume`` starts from) and publish its weights.

        Order: the pointer, then model.safetensors (a link to the checkpoint's weights), then its
        record in manifest.json, copied from the checkpoint's manifest (so never from bytes read
        back), with the record of the checkpoint's manifest: from then on the run requires the
        pointer and that manifest (:meth:`committed_checkpoints`). Until those records are written
        the published weights match the pointed checkpoint's and the checkpoint is not required.
        """
        atomic_write_json(self.path / self.POINTER, {"latest": files.directory.name, "step": files.step})
        self._publish_weights(files.model)
        manifest_path = files.directory / self.MANIFEST
        records: dict[str, FileRecord] = {}
        manifest = None
        if os.path.lexists(manifest_path):
            data = read_bytes(manifest_path, what="manifest")
            manifest = parse_manifest(data, path=manifest_path)
            records[self._relative(manifest_path)] = record_of(data)
        record = manifest.files.get(files.model.name) if manifest is not None else None
        if record is None:  # a checkpoint written before manifests
            record = record_of(read_bytes(self.path / self.MODEL, what="weights"))
        self._record({self.MODEL: record, **records})

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

    def latest_checkpoint(self) -> CheckpointFiles | None:
        """The checkpoint ``checkpoint.json`` names; None when there is no pointer.

        Raises:
            CheckpointError: the pointer is malformed (its name and step disagree, say) or names a
                missing directory.
        """
        pointer = self.path / self.POINTER
        if not os.path.lexists(pointer):
            committed = self.committed_checkpoints()
            if committed:
                raise CheckpointError(
                    f"checkpoint pointer not found: {pointer} (the run has committed checkpoints: "
                    f"{self.path / self.MANIFEST} lists {', '.join(committed)})"
                )
            return None
        record = read_json(pointer, what="checkpoint pointer")
        name = record.get("latest") if isinstance(record, dict) else None
        step = record.get("step") if isinstance(record, dict) else None
        if (
            not isinstance(name, str)
            or not re.fullmatch(r"step-\d{8}", name)
            or isinstance(step, bool)
            or not isinstance(step, int)
            or int(name[len("step-") :]) != step
        ):
            raise CheckpointError(
                f"checkpoint pointer {pointer} is corrupted: expected "
                f'{{"latest": "step-NNNNNNNN", "step": N}} with the same N'
            )
        directory = self.path / "checkpoints" / name
        if not directory.is_dir():
            raise CheckpointError(f"checkpoint pointer {pointer} names a missing directory {directory}")
        return CheckpointFiles(step, directory)

    def read_trainer_state(self, files: CheckpointFiles) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """The optimizer, RNG and data state of checkpoint ``files``, verified against its manifest."""
        tensors_path, json_path = files.trainer_tensors, files.trainer_json
        tensors, _ = parse_tensors(
            self.read_verified(self._relative(tensors_path), what="trainer state"),
            path=tensors_path,
            what="trainer state",
        )
        state = parse_json(
            self.read_verified(self._relative(json_path), what="trainer state"), path=json_path, what="trainer state"
        )
        if not isinstance(state, dict) or state.get("step") != files.step:
            raise CheckpointError(f"trainer state {json_path} is corrupted: it is not the state of step {files.step}")
        return tensors, state

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
        """Remove all but the ``keep`` latest checkpoints and the best one (by recorded validation,
        :meth:`best_checkpoint`), and any staging folder a crash left."""
        complete = [files.directory for files in self.checkpoints()]
        with warnings.catch_warnings():  # an old checkpoint read only to rank it: nothing for people
            warnings.simplefilter("ignore", AttnlabWarning)
            best = self.best_checkpoint(strict=False)
        spared = {current} | ({best.directory.name} if best is not None else set())
        stale = [
            p
            for p in (self.path / "checkpoints").iterdir()
            if p.name.startswith("step-") and p.name.endswith(".partial")
        ]  # left by a crash mid-write
        doomed = [old for old in complete[: max(0, len(complete) - keep)] + stale if old.name not in spared]
        self._forget_checkpoints(doomed)
        for old in doomed:
            _remove_folder(old)

    def _forget_checkpoints(self, folders: list[Path]) -> None:
        """Drop the records of the checkpoints ``folders`` from the run's manifest before they are
        removed or rewritten: a kill in between leaves a run that verifies."""
        manifest = read_manifest(self.path)
        if manifest is None:
            return
        names = {self._relative(f.with_name(f.name.removesuffix(".partial")) / self.MANIFEST) for f in folders}
        if names & set(manifest.files):
            manifests.write_manifest(self.path, manifest.without(names))

    # ---- choosing a checkpoint ----------------------------------------------------------------

    def checkpoint_validation(self, files: CheckpointFiles) -> dict[str, Any] | None:
        """The validation recorded with checkpoint ``files`` (its trainer_state.json, verified):
        ``{"step", "split", "accuracy", "loss"}``, or None when the run was not evaluated at that step.

        Raises:
            CheckpointError: the trainer state is damaged or its record malformed.
        """
        path = files.trainer_json
        state = parse_json(
            self.read_verified(self._relative(path), what="trainer state"), path=path, what="trainer state"
        )
        record = state.get("validation") if isinstance(state, dict) else None
        if record is None:
            return None
        if not (
            isinstance(record, dict)
            and record.get("step") == files.step
            and all(_is_number(record.get(key)) for key in ("accuracy", "loss"))
        ):
            raise CheckpointError(f"trainer state {path} is corrupted: its validation record is malformed")
        return record

    def best_checkpoint(self, *, strict: bool = True) -> CheckpointFiles | None:
        """The checkpoint whose recorded validation is best: the highest accuracy, then the lowest
        loss, then the earliest step; None when no checkpoint records one.

        Args:
            strict: raise on a damaged checkpoint; otherwise pass over it (what pruning does: a
                damaged checkpoint cannot be the one to keep).

        Raises:
            CheckpointError: (``strict``) a checkpoint's trainer state is damaged.
        """
        ranked = []
        for files in self.checkpoints():
            try:
                record = self.checkpoint_validation(files)
            except CheckpointError:
                if strict:
                    raise
                continue
            if record is not None:
                ranked.append(((-record["accuracy"], record["loss"], files.step), files))
        return min(ranked, key=lambda pair: pair[0])[1] if ranked else None

    def choose_checkpoint(self, name: str, *, flag: str = "--checkpoint") -> CheckpointFiles:
        """The checkpoint called ``name``: ``last`` (the one ``checkpoint.json`` names), ``best``
        (:meth:`best_checkpoint`) or ``step-N`` (N with or without leading zeros).

        Raises:
            UsageError: no such checkpoint; the message names ``flag`` and the available ones.
        """
        found = self.checkpoints()
        has_pointer = os.path.lexists(self.path / self.POINTER)
        names = (["last"] if has_pointer else []) + ["best", *(f"step-{files.step}" for files in found)]
        available = ", ".join(names) if found else "none"
        match = re.fullmatch(r"step-(\d{1,12})", name)
        chosen: CheckpointFiles | None = None
        if name == "last":
            chosen = self.latest_checkpoint()  # raises when the pointer of a run that has one is gone
            if chosen is None and found:
                raise UsageError(
                    f"{flag} last: {self.path} has no {self.POINTER} (which names the last checkpoint); "
                    f"available: {available}"
                )
        elif name == "best":
            chosen = self.best_checkpoint()
            if chosen is None and found:
                raise UsageError(
                    f"{flag} best: no checkpoint of {self.path} records a validation (train with train.eval_every "
                    f"a multiple of train.checkpoint_every); available: {available}"
                )
        elif match:
            chosen = next((files for files in found if files.step == int(match.group(1))), None)
        else:
            raise UsageError(f"{flag}: {name!r} is not last, best or step-N; available: {available}")
        if chosen is None:
            raise UsageError(f"{flag}: {self.path} has no checkpoint {name}; available: {available}")
        return chosen

    # ---- metrics ------------------------------------------------------------------------------

    def append_metrics(self, record: Mapping[str, Any]) -> None:
        """Append one JSON line with a single write, flushed to disk, and count it in the record the
        next checkpoint keeps of metrics.jsonl (:mod:`attnlab.run.metrics_log`)."""
        line = (json.dumps(dict(record), sort_keys=True) + "\n").encode("utf-8")
        tally = self._tally()
        with open(self.path / self.METRICS, "ab") as handle:
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())
        tally.add(line)

    def _tally(self) -> MetricsTally:
        """The running record of metrics.jsonl. A file this process did not start or truncate
        (:meth:`truncate_metrics` sets the tally on resume) is counted as it is on disk."""
        if self._metrics_tally is None:
            path = self.path / self.METRICS
            self._metrics_tally = MetricsTally(read_bytes(path, what="metrics") if os.path.lexists(path) else b"")
        return self._metrics_tally

    def read_metrics(self) -> list[dict[str, Any]]:
        """All complete metric records, checked against the record of the checkpoint ``checkpoint.json``
        names; a torn last line (a crash mid-write) is ignored (:meth:`check_metrics`)."""
        return self.check_metrics().records

    def check_metrics(self) -> MetricsCheck:
        """metrics.jsonl checked: its first lines exactly as the latest checkpoint recorded them
        (:mod:`attnlab.run.metrics_log`), every line a JSON object (a torn last line allowed).
        A checkpoint written before metrics were recorded leaves the file only parsed, with one
        :class:`AttnlabWarning`.

        Raises:
            CheckpointError: the file is missing, cut or differs from the record, or a line is not
                UTF-8, JSON or an object; names the file (and the line).
        """
        return self._checked_metrics()[0]

    def _checked_metrics(self) -> tuple[MetricsCheck, bytes, MetricsRecord | None]:
        path = self.path / self.METRICS
        files = self.latest_checkpoint()
        record = self._metrics_record(files) if files is not None else None
        name = files.directory.name if files is not None and record is not None else None
        if not os.path.lexists(path):
            if record is not None and record.size > 0:
                raise CheckpointError(
                    f"metrics not found: {path} (checkpoint {name} recorded {record.lines} lines, {record.size} bytes)"
                )
            return MetricsCheck([], 0, 0, name), b"", record
        data = read_bytes(path, what="metrics")
        return check_metrics_bytes(data, record, path=path, checkpoint=name), data, record

    def _metrics_record(self, files: CheckpointFiles) -> MetricsRecord | None:
        """The record checkpoint ``files`` keeps of metrics.jsonl (its trainer_state.json, verified);
        None, with one warning, for a checkpoint written before it kept one."""
        path = files.trainer_json
        state = parse_json(
            self.read_verified(self._relative(path), what="trainer state"), path=path, what="trainer state"
        )
        value = state.get(METRICS_KEY) if isinstance(state, dict) else None
        if value is None:
            if path not in self._warned and self._has_manifest():  # else the run's one warning says it all
                self._warned.add(path)
                warnings.warn(
                    f"checkpoint {files.directory} records no {self.METRICS} (written before attnlab recorded "
                    f"metrics): its lines are only parsed",
                    AttnlabWarning,
                    stacklevel=2,
                )
            return None
        return MetricsRecord.from_dict(value, path=path)

    def truncate_metrics(self, last_step: int) -> None:
        """On resume from the latest checkpoint (of step ``last_step``): keep exactly the lines it
        recorded (checked), dropping the ones written after it, so no step is logged twice. A
        checkpoint written before metrics were recorded keeps the records up to ``last_step``.

        Raises:
            CheckpointError: metrics.jsonl differs from the checkpoint's record, or has a line that
                is not a JSON object (a torn last line is dropped).
        """
        path = self.path / self.METRICS
        check, data, record = self._checked_metrics()
        if record is not None:
            kept = data[: record.size]
        else:
            for entry in check.records:
                step = entry.get("step", 0)
                if isinstance(step, bool) or not isinstance(step, (int, float)):
                    raise CheckpointError(f"{path}: a record has step {step!r}, not a number")
            lines = [json.dumps(r, sort_keys=True) + "\n" for r in check.records if r.get("step", 0) <= last_step]
            kept = "".join(lines).encode("utf-8")
        if kept != data or not os.path.lexists(path):
            atomic_write_bytes(path, kept)
        self._metrics_tally = MetricsTally(kept)  # the bytes just checked (or written) by this process

    def __iter__(self) -> Iterator[Path]:
        return iter(sorted(self.path.iterdir()))


def validation_record(step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
    """What a checkpoint records of the validation at its step (``metrics`` from
    :func:`attnlab.evaluation.evaluate`): step, split, accuracy, loss."""
    return {"step": step, "split": metrics["split"], "accuracy": metrics["accuracy"], "loss": metrics["loss"]}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _remove_folder(folder: Path) -> None:
    """Remove an old checkpoint folder so that a kill at any instant leaves it whole or out of sight:
    renamed first to ``step-N.partial`` (skipped by every reader and by ``verify``, removed by the
    next checkpoint), then deleted file by file."""
    doomed = folder if folder.name.endswith(".partial") else folder.with_name(folder.name + ".partial")
    if doomed != folder:
        shutil.rmtree(doomed, ignore_errors=True)
        try:
            os.replace(folder, doomed)
        except OSError:
            return  # gone already, or not ours to move: the next checkpoint tries again
    shutil.rmtree(doomed, ignore_errors=True)


def weights_to_tensors(model: nn.Module) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The state dict with tied tensors stored once; aliases go in the metadata."""
    return state_to_tensors(model.state_dict())


def state_to_tensors(state: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, str]]:
    """A state dict with tied tensors (one storage, offset and shape) stored once; aliases go in
    the metadata."""
    tensors: dict[str, Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[int, int, tuple[int, ...]], str] = {}
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in seen and tensor.numel() > 0:
            aliases[name] = seen[key]
        else:
            seen[key] = name
            tensors[name] = tensor
    return tensors, {"format": "pt", _ALIASES_KEY: json.dumps(aliases)}


def load_weights_into(model: nn.Module, path: Path) -> None:
    """Load a safetensors file into ``model``, unverified (for files outside a run: use
    :meth:`RunDir.load_weights` for a run's); a missing, extra or mis-shaped tensor is named."""
    tensors, metadata = parse_tensors(read_bytes(path, what="weights"), path=path, what="weights")
    load_tensors_into(model, tensors, metadata, path=path)


def load_tensors_into(
    model: nn.Module, tensors: dict[str, Tensor], metadata: Mapping[str, str], *, path: Path, assign: bool = False
) -> None:
    """Load tensors read from ``path`` into ``model``; a missing, extra or mis-shaped tensor is named.

    With ``assign`` the model's parameters and buffers take the given tensors' storage (of the
    same dtype; others are copied) instead of a copy of them: for memory-mapped tensors
    (:func:`attnlab.run.storage.map_tensors`). Tied parameters stay one parameter. Older weights'
    keys are read under their new names (:data:`RENAMED_PREFIXES`).
    """
    try:
        aliases = json.loads(metadata.get(_ALIASES_KEY, "{}"))
        if not isinstance(aliases, dict):
            raise ValueError("not an object")
    except (ValueError, RecursionError):
        raise CheckpointError(f"weights {path} have corrupted metadata") from None
    for alias, canonical in aliases.items():
        if isinstance(canonical, str) and canonical in tensors:
            tensors[alias] = tensors[canonical]
    tensors = _renamed(tensors)
    expected = model.state_dict()
    # A key that older weights lack (a record added since) keeps its reset value: not missing.
    missing = sorted(set(expected) - set(tensors) - optional_state_keys(model))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"weights {path} do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for name in expected:  # in the model's order, so the first mismatch named is always the same
        if name not in tensors:  # an optional record older weights lack
            continue
        tensor = tensors[name]
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"weights {path}: tensor {name!r} has shape {tuple(tensor.shape)}, the model expects "
                f"{tuple(expected[name].shape)}"
            )
    if not assign:
        model.load_state_dict(tensors, strict=True)
        return
    with torch.no_grad():
        for name, held in [*model.named_parameters(), *model.named_buffers()]:
            if name in tensors:
                _take(held, tensors[name])


def _renamed(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """``tensors`` with the keys of older weights renamed by :data:`RENAMED_PREFIXES`, each prefix
    only when no key already has its new name."""
    for old, new in RENAMED_PREFIXES:
        if any(name.startswith(new) for name in tensors):
            continue
        tensors = {new + name[len(old) :] if name.startswith(old) else name: t for name, t in tensors.items()}
    return tensors


def _take(held: Tensor, tensor: Tensor) -> None:
    """Make ``held`` (a parameter or buffer) hold ``tensor``'s values, sharing its storage when it can."""
    if tensor.dtype == held.dtype and tensor.device == held.device:
        held.data = tensor
    else:
        held.copy_(tensor)
