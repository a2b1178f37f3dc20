"""Manifests: the size and SHA-256 of every file a run directory's commands read.

A manifest is one JSON file::

    {"format": 1, "files": {"config.json": {"size": 1234, "sha256": "9f86d0..."}, ...}, "checksum": "..."}

keyed by paths relative to the folder that holds the manifest. ``checksum`` is the SHA-256 of the
``files`` object in canonical JSON (sorted keys, no spaces): damage to the manifest itself is named
as such, never blamed on a file it lists. A writer records the bytes it
writes (never bytes read back from disk, which could already be damaged); a reader reads a file's
bytes once, checks them against the manifest and parses those same bytes (no check-then-reopen
race). Any difference is a :class:`attnlab.errors.CheckpointError` (exit 3) naming the file and
what differs.

Two kinds exist in a run (see :mod:`attnlab.run.directory`): ``RUN/manifest.json`` for ``config.json``,
``tokenizer.json`` and ``model.safetensors``, and ``checkpoints/step-N/manifest.json`` for the files
of one checkpoint, written inside the staging folder before it is renamed into place.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attnlab.errors import CheckpointError
from attnlab.run.storage import atomic_write_text, parse_json, read_bytes

__all__ = [
    "FORMAT",
    "NAME",
    "FileRecord",
    "Manifest",
    "record_of",
    "build_manifest",
    "check_bytes",
    "check_record",
    "write_manifest",
    "read_manifest",
    "parse_manifest",
]

FORMAT = 1
"""The manifest format this version writes and reads."""

NAME = "manifest.json"
"""A manifest's file name, in the folder it covers."""

_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class FileRecord:
    """What a file's bytes must be: their number and their SHA-256 (lower-case hex)."""

    size: int
    sha256: str

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 0:
            raise ValueError(f"size must be an integer >= 0, got {self.size!r}")
        if not isinstance(self.sha256, str) or not _SHA256.fullmatch(self.sha256):
            raise ValueError(f"sha256 must be 64 lower-case hex digits, got {self.sha256!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"size": self.size, "sha256": self.sha256}


@dataclass(frozen=True)
class Manifest:
    """The records of the files of one folder, by path relative to it (``/``-separated)."""

    files: Mapping[str, FileRecord] = field(default_factory=dict)

    def with_records(self, records: Mapping[str, FileRecord]) -> Manifest:
        """A manifest with ``records`` added or replacing the ones of the same paths."""
        return Manifest({**self.files, **records})

    def without(self, names: set[str] | frozenset[str]) -> Manifest:
        """A manifest without the records of ``names``."""
        return Manifest({name: record for name, record in self.files.items() if name not in names})

    def to_dict(self) -> dict[str, Any]:
        files = {name: self.files[name].to_dict() for name in sorted(self.files)}
        return {"format": FORMAT, "files": files, "checksum": _checksum(files)}

    def to_text(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"


def record_of(data: bytes) -> FileRecord:
    """The record of ``data``: its length and SHA-256."""
    return FileRecord(len(data), hashlib.sha256(data).hexdigest())


def record_of_file(path: str | Path) -> FileRecord:
    """The record of the file ``path``, read in blocks (for files too large to hold twice).

    ``hashlib.file_digest`` reads into one reused 256 KiB buffer: reading 16 MiB blocks as bytes
    objects held two of them at once and, once freed, raised glibc's mmap threshold, after which
    the heap kept some 15 MB of freed blocks resident through a whole ``attnlab generate``."""
    with open(path, "rb") as handle:
        digest = hashlib.file_digest(handle, "sha256")
        size = handle.tell()
    return FileRecord(size, digest.hexdigest())


def build_manifest(contents: Mapping[str, bytes]) -> Manifest:
    """A manifest of files given as ``{relative path: bytes}``."""
    return Manifest({name: record_of(data) for name, data in contents.items()})


def write_manifest(folder: str | Path, manifest: Manifest) -> Path:
    """Write ``folder/manifest.json`` atomically; returns its path."""
    path = Path(folder) / NAME
    atomic_write_text(path, manifest.to_text())
    return path


def parse_manifest(data: bytes, *, path: str | Path) -> Manifest:
    """The manifest held by the bytes of ``path``.

    Raises:
        CheckpointError: malformed JSON, another format, or a bad record; the message names ``path``.
    """
    obj = parse_json(data, path=path, what="manifest")
    if not isinstance(obj, dict) or obj.get("format") != FORMAT or not isinstance(obj.get("files"), dict):
        found = obj.get("format") if isinstance(obj, dict) else None
        raise CheckpointError(
            f"manifest {path} is corrupted: expected format {FORMAT} with a files object, found format {found!r}"
        )
    if obj.get("checksum") != _checksum(obj["files"]):
        raise CheckpointError(f"manifest {path} is damaged: its checksum differs from its contents")
    records: dict[str, FileRecord] = {}
    for name, record in obj["files"].items():
        try:
            if not isinstance(record, dict) or set(record) != {"size", "sha256"}:
                raise ValueError("expected exactly the keys size and sha256")
            records[name] = FileRecord(record["size"], record["sha256"])
        except ValueError as error:
            raise CheckpointError(f"manifest {path} is corrupted: entry {name!r}: {error}") from None
    return Manifest(records)


def read_manifest(folder: str | Path) -> Manifest | None:
    """The manifest of ``folder``, or None when it has none (a run written before manifests)."""
    path = Path(folder) / NAME
    if not path.exists() and not path.is_symlink():
        return None
    return parse_manifest(read_bytes(path, what="manifest"), path=path)


def check_bytes(manifest: Manifest, relative: str, data: bytes, *, path: str | Path) -> None:
    """Check the bytes read from ``path`` against the record of ``relative`` in ``manifest``.

    Raises:
        CheckpointError: ``relative`` is not in the manifest, or its size or SHA-256 differs; the
            message names ``path`` and what differs.
    """
    check_record(manifest, relative, record_of(data), path=path)


def check_record(manifest: Manifest, relative: str, actual: FileRecord, *, path: str | Path) -> None:
    """:func:`check_bytes` for a file's record (size and SHA-256) computed without holding it whole."""
    expected = manifest.files.get(relative)
    if expected is None:
        raise CheckpointError(f"{path} is damaged or foreign: it is not listed in its folder's {NAME}")
    difference = describe_record_difference(expected, actual)
    if difference:
        raise CheckpointError(f"{path} is damaged: {difference}")


def describe_record_difference(expected: FileRecord, actual: FileRecord) -> str | None:
    """What differs between the record of a file and ``expected`` (size first, then SHA-256); None when they match."""
    if actual.size != expected.size:
        return f"size {actual.size} bytes, expected {expected.size}"
    if actual.sha256 != expected.sha256:
        return "sha256 differs from the manifest"
    return None


def describe_difference(expected: FileRecord, data: bytes) -> str | None:
    """What differs between ``data`` and ``expected`` (size first, then SHA-256); None when they match."""
    return describe_record_difference(expected, record_of(data))


def _checksum(files: Mapping[str, Any]) -> str:
    canonical = json.dumps(files, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()
