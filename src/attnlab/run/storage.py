"""Atomic file writes and safetensors I/O with errors a person can read.

Every write goes to a temporary file in the same directory, is flushed and fsync'ed, replaces the
target with ``os.replace`` (atomic on POSIX), and then the directory itself is fsync'ed so the
rename survives a power cut. A kill -9 at any instant leaves either the old file or the new one.

Weights and optimizer tensors are stored with ``safetensors``: a JSON header plus raw bytes, so
loading never executes code (unlike pickle). Reading is split in two so that the bytes checked are
the bytes used: :func:`read_bytes` reads a file once, the caller checks them (a run's files against
its manifest, :mod:`attnlab.run.manifest`), and :func:`parse_json` / :func:`parse_tensors` parse those
bytes. A malformed file (truncated, a damaged header, a pickle in disguise, JSON nested too deeply,
a folder where a file belongs) raises :class:`attnlab.errors.CheckpointError` naming the file. A flip
in the tensor data leaves a well-formed file: only the manifest's SHA-256 catches it.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save
from safetensors.torch import save_file
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
    "read_bytes",
    "parse_json",
    "parse_tensors",
    "tensors_to_bytes",
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

    def fill(name: str) -> None:
        with open(name, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as handle:
            write(handle)

    atomic_write_file(path, fill)


def atomic_write_file(path: str | os.PathLike[str], fill: Callable[[str], None]) -> None:
    """Call ``fill(name)`` to write the temporary file ``name`` beside ``path`` (by name, for a
    library such as safetensors' streaming ``save_file``), sync it, then rename it over ``path``.
    Errors as for :func:`atomic_write`."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{path}: is a folder; give the name of a file to write")
    ensure_folder(path.parent)
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
    except OSError as error:
        raise UsageError(f"{path}: cannot write: {error.strerror}") from None
    try:
        fill(tmp_name)
        with open(tmp_name, "rb") as written:
            os.fsync(written.fileno())
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


def read_bytes(path: str | os.PathLike[str], *, what: str = "file") -> bytes:
    """All the bytes of the regular file ``path``, read once.

    Raises:
        CheckpointError: ``path`` is missing, a folder or anything but a regular file, or cannot be
            read (permissions, I/O error); the message names it and says which.
    """
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO must not block the open
        with os.fdopen(fd, "rb") as handle:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                kind = "a folder" if stat.S_ISDIR(mode) else "a special file"
                raise CheckpointError(f"{what} {path} is not a regular file ({kind} stands in its place)")
            return handle.read()
    except FileNotFoundError:
        raise CheckpointError(f"{what} not found: {path}") from None
    except IsADirectoryError:
        raise CheckpointError(f"{what} {path} is not a regular file (a folder stands in its place)") from None
    except OSError as error:
        raise CheckpointError(f"{what} {path}: cannot read: {error.strerror or error}") from None


def parse_json(data: bytes, *, path: str | os.PathLike[str], what: str = "file") -> Any:
    """Parse the bytes of a JSON file; anything malformed is a CheckpointError naming ``path``.

    Malformed includes bytes that are not UTF-8 and nesting too deep for Python's parser (a file of
    100,000 ``[``), which would otherwise surface as ``RecursionError``.
    """
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise CheckpointError(f"{what} {path} is corrupted: bytes that are not UTF-8 (offset {error.start})") from None
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{what} {path} is corrupted: line {error.lineno}: {error.msg}") from None
    except RecursionError:
        raise CheckpointError(f"{what} {path} is corrupted: JSON nested too deeply") from None


def read_json(path: Path, *, what: str = "file") -> Any:
    """Parse a JSON file; a missing, unreadable or malformed file is a CheckpointError naming it."""
    return parse_json(read_bytes(path, what=what), path=path, what=what)


def tensors_to_bytes(tensors: Mapping[str, Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """The safetensors bytes of ``tensors`` (made contiguous on the CPU) with ``metadata``."""
    prepared = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    return safetensors_save(prepared, metadata=dict(metadata) if metadata else None)


def stream_tensors(path: Path, tensors: Mapping[str, Tensor], metadata: Mapping[str, str] | None = None) -> None:
    """Write ``tensors`` as one safetensors file, atomically, tensor by tensor from memory to disk
    (safetensors' ``save_file``): no second copy of the weights in memory, as
    :func:`tensors_to_bytes` makes."""
    prepared = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    atomic_write_file(path, lambda name: save_file(prepared, name, metadata=dict(metadata) if metadata else None))


def save_tensors(path: Path, tensors: Mapping[str, Tensor], metadata: Mapping[str, str] | None = None) -> None:
    """Write ``tensors`` as one safetensors file, atomically. Tensors are made contiguous on the CPU."""
    atomic_write_bytes(path, tensors_to_bytes(tensors, metadata))


def parse_tensors(
    data: bytes, *, path: str | os.PathLike[str], what: str = "checkpoint"
) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The tensors and metadata held by the bytes of a safetensors file. Never unpickles anything.

    Raises:
        CheckpointError: the bytes are not a well-formed safetensors file; the message names ``path``.
    """
    try:
        tensors = safetensors_load(data)
        metadata = _safetensors_metadata(data)
    except (SafetensorError, ValueError, RuntimeError, OverflowError, RecursionError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{what} {path} is corrupted or not a safetensors file ({error})") from None
    return tensors, metadata


def file_identity(path: str | os.PathLike[str], *, what: str = "file") -> tuple[int, ...]:
    """(device, inode, size, mtime in ns) of the regular file ``path``: equal before and after a read
    when nothing replaced or rewrote the file in between.

    Raises:
        CheckpointError: ``path`` is missing or not a regular file; the message names it.
    """
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise CheckpointError(f"{what} not found: {path}") from None
    except OSError as error:
        raise CheckpointError(f"{what} {path}: cannot read: {error.strerror or error}") from None
    if not stat.S_ISREG(info.st_mode):
        kind = "a folder" if stat.S_ISDIR(info.st_mode) else "a special file"
        raise CheckpointError(f"{what} {path} is not a regular file ({kind} stands in its place)")
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)


def map_tensors(path: str | os.PathLike[str], *, what: str = "checkpoint") -> tuple[dict[str, Tensor], dict[str, str]]:
    """The tensors and metadata of a safetensors file, memory-mapped (safetensors' ``safe_open``):
    no copy of the file is read into memory; its pages are read when a tensor is first used, and
    a tensor written to gets its own copy of the pages written (the file never changes).

    Raises:
        CheckpointError: the file is not a well-formed safetensors file; the message names ``path``.
    """
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 (not a dict)
    except (SafetensorError, ValueError, RuntimeError, OverflowError, OSError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{what} {path} is corrupted or not a safetensors file ({error})") from None
    return tensors, dict(metadata)


def load_tensors(path: Path, *, what: str = "checkpoint") -> tuple[dict[str, Tensor], dict[str, str]]:
    """Read a safetensors file; returns (tensors, metadata). Never unpickles anything."""
    return parse_tensors(read_bytes(path, what=what), path=path, what=what)


def _safetensors_metadata(data: bytes) -> dict[str, str]:
    header_size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_size].decode("utf-8"))
    metadata = header.get("__metadata__", {}) if isinstance(header, dict) else None
    if not isinstance(metadata, dict):
        raise ValueError("the header's __metadata__ is not an object")
    return dict(metadata)


def tensor_nbytes(tensors: Mapping[str, Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())
