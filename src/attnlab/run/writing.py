"""Writing a run directory: each file atomically, then its record in the manifest (:class:`RunWriter`).

Why a checkpoint is a directory plus a pointer: resuming needs the weights *and* the optimizer, RNG
and data state from the same step. Each file is written atomically, but several files cannot be
renamed at once, so a checkpoint directory is written completely first and ``checkpoint.json`` is
then replaced atomically to point at it. A kill -9 at any instant leaves the pointer at a complete
checkpoint. The previous checkpoint is only deleted after the pointer has moved on.

A checkpoint's manifest is written in its staging folder, so it is complete before the pointer moves.
``model.safetensors`` is published before ``manifest.json`` records it, so in between it is accepted
when it matches the record of the checkpoint the pointer names (:mod:`attnlab.run.reading`). A
checkpoint's record leaves the run's manifest before the checkpoint is pruned or written again, so a
kill at any instant still leaves a run that verifies.

Pruning old checkpoints (``train.keep_checkpoints``) keeps the latest ones and the best one
(:meth:`~attnlab.run.reading.RunReader.best_checkpoint`). metrics.jsonl is appended one flushed line
at a time, and counted in the record each checkpoint keeps of it (:mod:`attnlab.run.metrics_log`).
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from attnlab.errors import AttnlabWarning, CheckpointError
from attnlab.kernels.calibration import KernelRecord
from attnlab.run import manifest as manifests
from attnlab.run.layout import CheckpointFiles
from attnlab.run.manifest import FileRecord, Manifest, parse_manifest, read_manifest, record_of, record_of_file
from attnlab.run.metrics_log import KEY as METRICS_KEY
from attnlab.run.metrics_log import MetricsTally
from attnlab.run.reading import RunReader
from attnlab.run.storage import (
    atomic_write_bytes,
    atomic_write_json,
    fsync_directory,
    read_bytes,
    stream_tensors,
    tensors_to_bytes,
)
from attnlab.run.weights import state_to_tensors, weights_to_tensors

__all__ = ["RunWriter"]


class RunWriter(RunReader):
    """What writes a run's files, each atomically and then recorded in its manifest (a base of
    :class:`~attnlab.run.directory.RunDir`)."""

    # ---- writing (each file, then its record in manifest.json) ------------------------------------

    def write_config(self, config: Mapping[str, Any]) -> None:
        self._write_file(self.CONFIG, (json.dumps(dict(config), indent=2, sort_keys=True) + "\n").encode("utf-8"))

    def write_tokenizer(self, text: str) -> None:
        self._write_file(self.TOKENIZER, text.encode("utf-8"))

    def write_kernels(self, record: KernelRecord) -> None:
        """kernels.json: the kernel chosen for each shape class and the record's mode (and the
        machine that chose them), recorded in the manifest; rewritten whole when a class is added."""
        text = json.dumps(record.to_dict(), indent=2, sort_keys=True) + "\n"
        self._write_file(self.KERNELS, text.encode("utf-8"))

    def write_provenance(self, sources: list[Mapping[str, Any]]) -> None:
        """provenance.json: the files an imported model was read from, each ``{"path", "size",
        "sha256", "checked"}`` (:mod:`attnlab.pretrained.provenance`), recorded in the manifest."""
        text = json.dumps({"sources": [dict(source) for source in sources]}, indent=2, sort_keys=True) + "\n"
        self._write_file(self.PROVENANCE, text.encode("utf-8"))

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
