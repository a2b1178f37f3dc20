"""Atomic file writes and safetensors I/O with errors a person can read.

Every write goes to a temporary file in the same directory, is flushed and fsync'ed, replaces the
target with ``os.replace`` (atomic on POSIX), and then the directory itself is fsync'ed so the
rename survives a power cut. A kill -9 at any instant leaves either the old file or the new one.

Weights and optimizer tensors are stored with ``safetensors``: a JSON header plus raw bytes, so
loading never executes code (unlike pickle). Any malformed file, truncated, bit-flipped or a pickle
in disguise, raises :class:`attnlab.errors.CheckpointError` naming the file.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from safetensors import SafetensorError
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save
from torch import Tensor

from attnlab.errors import CheckpointError, UsageError

__all__ = [
    "ensure_folder",
    "atomic_write",
    "atomic_write_bytes",
    "atomic_write_text",
    "atomic_write_json",
    "fsync_directory",
    "save_tensors",
    "load_tensors",
    "read_json",
]


def fsync_directory(path: Path) -> None:
    """Make a rename inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def ensure_folder(path: str | os.PathLike[str]) -> Path:
    """Create folder ``path`` and the folders above it if missing.

    Raises:
        UsageError: a file stands where a folder must be, or the folder cannot be created; the
            message names the path.
    """
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
        reason = f"{blocker} is a file" if blocker is not None else error.strerror
        raise UsageError(f"{path}: cannot create the folder: {reason}") from None
    return path


def atomic_write(path: str | os.PathLike[str], write: Callable[[Any], None], mode: str = "w") -> None:
    """Call ``write(handle)`` on a temporary file beside ``path``, then rename it over ``path``.

    Text modes write UTF-8.

    Raises:
        UsageError: ``path`` is a folder, or cannot be written (no such place, no permission, a
            full disk); the message names it. The temporary file is removed.
    """
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{path}: is a folder; give the name of a file to write")
    ensure_folder(path.parent)
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as error:
        raise UsageError(f"{path}: cannot write: {error.strerror}") from None
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, path)
    except OSError as error:
        Path(tmp_name).unlink(missing_ok=True)
        raise UsageError(f"{path}: cannot write: {error.strerror}") from None
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    atomic_write(path, lambda handle: handle.write(data), "wb")


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda handle: handle.write(text))


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def read_json(path: Path, *, what: str = "file") -> Any:
    """Parse a JSON file; a missing or malformed file is a CheckpointError naming it."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{what} not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{what} {path} is corrupted: {error}") from None


def save_tensors(path: Path, tensors: Mapping[str, Tensor], metadata: Mapping[str, str] | None = None) -> None:
    """Write ``tensors`` as one safetensors file, atomically. Tensors are made contiguous on the CPU."""
    prepared = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    atomic_write_bytes(path, safetensors_save(prepared, metadata=dict(metadata) if metadata else None))


def load_tensors(path: Path, *, what: str = "checkpoint") -> tuple[dict[str, Tensor], dict[str, str]]:
    """Read a safetensors file; returns (tensors, metadata). Never unpickles anything."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{what} not found: {path}") from None
    try:
        tensors = safetensors_load(data)
        metadata = _safetensors_metadata(data)
    except (SafetensorError, ValueError, RuntimeError, OverflowError, json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{what} {path} is corrupted or not a safetensors file ({error})") from None
    return tensors, metadata


def _safetensors_metadata(data: bytes) -> dict[str, str]:
    header_size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_size].decode("utf-8"))
    return dict(header.get("__metadata__", {}))


def tensor_nbytes(tensors: Mapping[str, Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())

