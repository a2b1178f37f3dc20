"""``verify_run``: check every file of a run directory against its manifests and say what is wrong.

It reads each file the way the commands do (:meth:`attnlab.run.directory.RunDir.read_verified`: the bytes
once, checked against the manifest of their folder, then parsed), so a run that verifies clean is
one every command can open. Checked: ``manifest.json`` itself, ``config.json``, ``tokenizer.json``,
``model.safetensors``, ``checkpoint.json`` (well formed, naming a checkpoint that exists; required
once the run's manifest records a committed checkpoint), ``metrics.jsonl`` (its lines exactly as the
latest checkpoint recorded them, :mod:`attnlab.run.metrics_log`; every line a JSON object, a torn
last line allowed; the lines written after the last checkpoint are only parsed, and the verdict says
how many) and every checkpoint (its ``manifest.json``, required and checked against the run's
manifest once committed, and the files it lists). Every run must hold ``config.json`` and weights
(``model.safetensors``, or a checkpoint ``checkpoint.json`` names): a run without them (an import
or a training run stopped before writing them) is damaged, listed in its manifest or not, and a
file present but missing from its manifest is damaged too (foreign). Skipped: ``.lock`` and other hidden files (the run
lock, temporary files of an interrupted write), ``plots/``, ``analysis/``, ``tensorboard/`` (event
files for TensorBoard, which no command reads) and
``checkpoints/step-N.partial/`` (a checkpoint an interrupted write left, never read, removed by the
next checkpoint).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attnlab.errors import AttnlabWarning, CheckpointError, UsageError
from attnlab.run import manifest as manifests
from attnlab.run.directory import RunDir
from attnlab.run.storage import parse_json, parse_tensors

__all__ = ["FileCheck", "VerifyReport", "verify_run"]

OK, DAMAGED, UNVERIFIED = "ok", "damaged", "unverified"
SKIPPED_FOLDERS = ("plots", "analysis", "tensorboard")
_CHECKPOINT_FILES = ("model.safetensors", "trainer_state.safetensors", "trainer_state.json")


@dataclass(frozen=True)
class FileCheck:
    """The verdict on one file: ``ok``, ``damaged`` (``detail`` says what differs) or ``unverified``
    (no manifest covers it; ``detail`` says why)."""

    path: str
    status: str
    detail: str = ""

    def to_dict(self) -> dict[str, str]:
        return {"path": self.path, "status": self.status, "detail": self.detail}


@dataclass
class VerifyReport:
    """Every file checked, in order, and the warnings (a run or checkpoint without a manifest)."""

    run: Path
    files: list[FileCheck] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def problems(self) -> list[FileCheck]:
        return [check for check in self.files if check.status == DAMAGED]

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {
            "run": str(self.run),
            "ok": self.ok,
            "files": [check.to_dict() for check in self.files],
            "problems": [check.to_dict() for check in self.problems],
            "warnings": list(self.warnings),
        }


def verify_run(path: str | os.PathLike[str]) -> VerifyReport:
    """Check the run directory ``path``; see the module docstring for what is checked.

    Returns:
        The report; ``report.ok`` is False when any file is damaged, missing or unreadable.

    Raises:
        UsageError: ``path`` is not a folder, or has neither config.json nor manifest.json.
    """
    run = RunDir(path)
    if not run.path.is_dir():
        raise UsageError(f"run not found: {run.path}")
    if not any(os.path.lexists(run.path / name) for name in (RunDir.CONFIG, RunDir.MANIFEST)):
        raise UsageError(f"{run.path} is not a run directory: it has neither {RunDir.CONFIG} nor {RunDir.MANIFEST}")
    report = VerifyReport(run.path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _verify_top_level(run, report)
        _verify_checkpoints(run, report)
    for warning in caught:
        message = str(warning.message)
        if issubclass(warning.category, AttnlabWarning) and message not in report.warnings:
            report.warnings.append(message)
    return report


def _check(report: VerifyReport, relative: str, read: Callable[[], object]) -> bool:
    """Run ``read``; record ``relative`` as ok or damaged (with the error's message)."""
    try:
        read()
    except CheckpointError as error:
        report.files.append(FileCheck(relative, DAMAGED, str(error)))
        return False
    report.files.append(FileCheck(relative, OK))
    return True


def _verify_top_level(run: RunDir, report: VerifyReport) -> None:
    manifest_ok = _check(report, RunDir.MANIFEST, lambda: manifests.read_manifest(run.path))
    listed: set[str] = set()
    if manifest_ok:
        manifest = manifests.read_manifest(run.path)
        listed = set(manifest.files) if manifest is not None else set()
        if manifest is None:
            report.files.pop()  # no manifest: nothing to check it against, which the warning says
    readers: dict[str, Callable[[], object]] = {
        RunDir.CONFIG: run.read_config,
        RunDir.TOKENIZER: lambda: _read_tokenizer(run),
        RunDir.MODEL: lambda: parse_tensors(
            run.read_verified(RunDir.MODEL, what="weights"), path=run.path / RunDir.MODEL, what="weights"
        ),
        RunDir.PROVENANCE: run.read_provenance,
        RunDir.KERNELS: run.read_kernels,
    }
    present = {name for name in readers if os.path.lexists(run.path / name)}
    listed = {name for name in listed if not name.startswith("checkpoints/")}  # checked with their checkpoint
    names = listed | present | _required(run)
    for name in [n for n in readers if n in names] + sorted(names - set(readers)):
        if not manifest_ok:
            report.files.append(FileCheck(name, UNVERIFIED, f"{RunDir.MANIFEST} is damaged"))
            continue
        if name == RunDir.MODEL and name not in present | listed:
            message = (
                f"weights not found: {run.path / name} (nor a checkpoint: an import or a training run "
                "stopped before writing them)"
            )
            report.files.append(FileCheck(name, DAMAGED, message))
            continue
        if (
            _check(report, name, readers.get(name, lambda name=name: run.read_verified(name)))
            and name == RunDir.PROVENANCE
        ):
            report.files[-1] = FileCheck(name, OK, _describe_sources(run.read_provenance() or []))
    pointer_ok = True
    if manifest_ok and (os.path.lexists(run.path / RunDir.POINTER) or run.committed_checkpoints()):
        pointer_ok = _check(report, RunDir.POINTER, run.latest_checkpoint)
    if not (manifest_ok and pointer_ok):
        if os.path.lexists(run.path / RunDir.METRICS):
            damaged = RunDir.MANIFEST if not manifest_ok else RunDir.POINTER
            report.files.append(FileCheck(RunDir.METRICS, UNVERIFIED, f"{damaged} is damaged"))
    else:
        _check_metrics(run, report)
    known = set(readers) | listed | {RunDir.MANIFEST, RunDir.POINTER, RunDir.METRICS, "checkpoints", *SKIPPED_FOLDERS}
    for entry in sorted(run.path.iterdir()):
        if entry.name not in known and not entry.name.startswith("."):
            report.files.append(FileCheck(entry.name, UNVERIFIED, "not covered by a manifest; no command reads it"))


def _required(run: RunDir) -> set[str]:
    """The files every run holds, listed in its manifest or not: config.json, and weights
    (model.safetensors, or a checkpoint ``checkpoint.json`` names, which every command falls back to)."""
    required = {RunDir.CONFIG}
    if not os.path.lexists(run.path / RunDir.POINTER):
        required.add(RunDir.MODEL)
    return required


def _check_metrics(run: RunDir, report: VerifyReport) -> None:
    """metrics.jsonl against the record of the latest checkpoint; the verdict says how far it covers."""
    files = run.latest_checkpoint()
    if files is not None:
        holder = files.trainer_json.relative_to(run.path).as_posix()
        try:
            run.read_verified(holder, what="trainer state")
        except CheckpointError:  # the record is unreadable: that file is named, not this one
            if os.path.lexists(run.path / RunDir.METRICS):
                report.files.append(FileCheck(RunDir.METRICS, UNVERIFIED, f"{holder}, which records it, is damaged"))
            return
    try:
        check = run.check_metrics()
    except CheckpointError as error:
        report.files.append(FileCheck(RunDir.METRICS, DAMAGED, str(error)))
        return
    if os.path.lexists(run.path / RunDir.METRICS):
        report.files.append(FileCheck(RunDir.METRICS, OK, check.describe()))


def _describe_sources(sources: list[dict[str, Any]]) -> str:
    """``imported from PATH (sha256 9f86d0..., checked against package X 1.0)``, each source."""
    return "imported from " + "; ".join(
        f"{s['path']} (sha256 {s['sha256']}" + (f", checked against {s['checked']})" if s.get("checked") else ")")
        for s in sources
    )


def _read_tokenizer(run: RunDir) -> object:
    from attnlab.run.loaded import saved_tokenizer  # the tokenizer libraries load only when needed

    return saved_tokenizer(run)


def _verify_checkpoints(run: RunDir, report: VerifyReport) -> None:
    folder = run.path / "checkpoints"
    try:
        committed = run.committed_checkpoints()
    except CheckpointError:  # a damaged run manifest: reported already
        committed = []
    for name in committed:
        if not (folder / name).is_dir():
            message = f"checkpoint not found: {folder / name} (listed in {RunDir.MANIFEST})"
            report.files.append(FileCheck(f"checkpoints/{name}", DAMAGED, message))
    if not os.path.lexists(folder):
        return
    if not folder.is_dir():
        report.files.append(FileCheck("checkpoints", DAMAGED, f"{folder} is not a folder"))
        return
    for entry in sorted(folder.iterdir()):
        relative = f"checkpoints/{entry.name}"
        if entry.name.startswith(".") or (entry.name.endswith(".partial") and entry.is_dir()):
            continue  # an interrupted write's leftovers: never read, removed by the next checkpoint
        if not entry.is_dir() or not entry.name.startswith("step-"):
            report.files.append(FileCheck(relative, UNVERIFIED, "not a checkpoint folder; no command reads it"))
            continue
        _verify_checkpoint(run, entry, report)


def _verify_checkpoint(run: RunDir, directory: Path, report: VerifyReport) -> None:
    prefix = f"checkpoints/{directory.name}"
    if not _check(report, f"{prefix}/{RunDir.MANIFEST}", lambda: run.checkpoint_manifest(directory)):
        for name in _CHECKPOINT_FILES:
            report.files.append(FileCheck(f"{prefix}/{name}", UNVERIFIED, f"{prefix}/{RunDir.MANIFEST} is damaged"))
        return
    manifest = run.checkpoint_manifest(directory)
    if manifest is None:
        report.files.pop()
    names = set(_CHECKPOINT_FILES) | (set(manifest.files) if manifest is not None else set())
    for name in sorted(names):
        relative = f"{prefix}/{name}"
        _check(report, relative, lambda relative=relative, name=name: _parse(run, relative, name))
    for entry in sorted(directory.iterdir()):
        if entry.name not in names and entry.name != RunDir.MANIFEST and not entry.name.startswith("."):
            report.files.append(
                FileCheck(f"{prefix}/{entry.name}", UNVERIFIED, "not covered by the checkpoint's manifest")
            )


def _parse(run: RunDir, relative: str, name: str) -> object:
    data = run.read_verified(relative)
    if name.endswith(".safetensors"):
        return parse_tensors(data, path=run.path / relative)
    if name.endswith(".json"):
        return parse_json(data, path=run.path / relative)
    return data
