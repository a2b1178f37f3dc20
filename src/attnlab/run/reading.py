"""Reading a run directory, each file verified against its manifest (:class:`RunReader`).

Integrity: every file a command reads is read once with :meth:`RunReader.read_verified`, which checks
the bytes against the manifest of their folder (:mod:`attnlab.run.manifest`) before they are parsed;
any difference is a :class:`~attnlab.errors.CheckpointError` naming the file (exit 3).
``model.safetensors`` is published before ``manifest.json`` records it (:mod:`attnlab.run.writing`),
so in between it is accepted when it matches the record of the checkpoint the pointer names: a kill -9
at any instant leaves a run that verifies. A run written before manifests existed opens with one
:class:`AttnlabWarning`; its next checkpoint gives it a manifest (recording its config and tokenizer
as they are then).

What a run must hold once it has it: when a checkpoint is committed (the pointer moved to it), the
run's manifest records that checkpoint's manifest.json; from then on ``checkpoint.json`` and that
manifest are required (:meth:`RunReader.committed_checkpoints`), so deleting either is damage, not an
old run. metrics.jsonl is checked against the record the latest checkpoint keeps of it
(:mod:`attnlab.run.metrics_log`).

Choosing a checkpoint (``attnlab eval --checkpoint``): ``last`` is the one ``checkpoint.json`` names,
``step-N`` that step's, and ``best`` the one whose recorded validation is best
(:meth:`RunReader.best_checkpoint`).
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from attnlab.errors import AttnlabWarning, CheckpointError, UsageError
from attnlab.kernels.calibration import KERNEL_MODES, KernelRecord
from attnlab.run.layout import CheckpointFiles, RunLayout
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
from attnlab.run.metrics_log import MetricsCheck, MetricsRecord, check_metrics_bytes
from attnlab.run.storage import file_identity, map_tensors, parse_json, parse_tensors, read_bytes, read_json
from attnlab.run.weights import load_tensors_into

__all__ = ["RunReader"]


class RunReader(RunLayout):
    """What reads a run's files, each checked against its manifest (a base of
    :class:`~attnlab.run.directory.RunDir`)."""

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

    def read_kernels(self) -> KernelRecord | None:
        """The kernel choices kernels.json records (verified), to run this run's model with; None for
        a run that has none (imported, or trained before runs recorded them).

        Raises:
            CheckpointError: the file differs from its manifest record or is malformed; names it.
        """
        path = self.path / self.KERNELS
        if not os.path.lexists(path):
            return None
        data = parse_json(self.read_verified(self.KERNELS, what="kernel choices"), path=path, what="kernel choices")
        choices = data.get("choices") if isinstance(data, dict) else None
        mode = data.get("mode") if isinstance(data, dict) else None
        if (
            mode not in KERNEL_MODES
            or not isinstance(choices, dict)
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in choices.items())
        ):
            raise CheckpointError(f"kernel choices {path} are corrupted: expected a mode and choices by shape class")
        return KernelRecord(mode, choices)

    # ---- manifests ---------------------------------------------------------------------------

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

    # ---- weights ------------------------------------------------------------------------------

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

    # ---- checkpoints --------------------------------------------------------------------------

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


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
