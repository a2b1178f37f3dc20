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

A folder of outputs (an analysis's CSVs and pictures, an imported run) is written the same way,
by :func:`atomic_directory`: into a hidden sibling ``.NAME.tmp-XXXXXXXX``, renamed into place only
once complete, removed on any error; nothing half-written appears under the name asked for.

Every failure of the file system while writing is one message naming the path and the errno
(:func:`write_error`): a full disk or a file-size limit (ENOSPC, EDQUOT, EFBIG) is a
:class:`~attnlab.errors.ResourceError` (exit 4), a refusal (EACCES, EPERM, EROFS) and anything else a
:class:`~attnlab.errors.UsageError` (exit 2). safetensors' own error for a failed write is read for
its errno and named the same way.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import shutil
import stat
import tempfile
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save
from safetensors.torch import save_file
from torch import Tensor

from attnlab.errors import AttnlabError, CheckpointError, ResourceError, UsageError

__all__ = [
    "ensure_folder",
    "atomic_write",
    "atomic_write_bytes",
    "atomic_write_text",
    "atomic_write_json",
    "atomic_directory",
    "write_error",
    "fsync_directory",
    "save_tensors",
    "load_tensors",
    "read_json",
    "read_bytes",
    "parse_json",
    "parse_tensors",
    "tensors_to_bytes",
]


_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
"""The errnos of a write that found no room: a full disk, a quota, a file-size limit."""

_HINTS = {
    errno.ENOSPC: "free some space there or write elsewhere",
    errno.EDQUOT: "the disk quota is spent: free some space or write elsewhere",
    errno.EFBIG: "a limit on file sizes (ulimit -f, or the file system's) stops it: write elsewhere",
}


def write_error(path: str | os.PathLike[str], error: OSError, *, action: str = "cannot write") -> AttnlabError:
    """The one error for ``error``, met while writing ``path``: ``PATH: cannot write: No space left
    on device (ENOSPC); free some space there or write elsewhere``.

    A full disk, a quota or a file-size limit (ENOSPC, EDQUOT, EFBIG) is a
    :class:`~attnlab.errors.ResourceError` (exit 4): the request is fine, the machine has no room for
    it. Anything else (EACCES, EPERM, EROFS: the system refuses the place; EIO, ...) is a
    :class:`~attnlab.errors.UsageError` (exit 2) naming the place to change.
    """
    code = error.errno
    reason = error.strerror or str(error)
    name = errno.errorcode.get(code) if isinstance(code, int) else None
    message = f"{path}: {action}: {reason}" + (f" ({name})" if name else "")
    if code in _FULL:
        return ResourceError(f"{message}; {_HINTS[code]}")
    return UsageError(message)


def _safetensors_os_error(error: Exception) -> OSError | None:
    """The OSError inside safetensors' error for a failed write (``... (os error 28)``); None when
    its message carries no errno."""
    match = re.search(r"os error (\d+)", str(error))
    if match is None:
        return None
    code = int(match.group(1))
    return OSError(code, os.strerror(code))


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
        if blocker is not None:
            raise UsageError(f"{path}: cannot create the folder: {blocker} is a file") from None
        raise write_error(path, error, action="cannot create the folder") from None
    return path


def atomic_write(path: str | os.PathLike[str], write: Callable[[Any], None], mode: str = "w") -> None:
    """Call ``write(handle)`` on a temporary file beside ``path``, then rename it over ``path``.

    Text modes write UTF-8.

    Raises:
        UsageError: ``path`` is a folder, or cannot be written (no such place, no permission); the
            message names it and the errno. The temporary file is removed.
        ResourceError: no room for it (a full disk, a quota, a file-size limit: :func:`write_error`).
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
        raise write_error(path, error) from None
    try:
        fill(tmp_name)
        with open(tmp_name, "rb") as written:
            os.fsync(written.fileno())
        os.replace(tmp_name, path)
    except OSError as error:
        Path(tmp_name).unlink(missing_ok=True)
        raise write_error(path, error) from None
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


TEMPORARY_MARK = ".tmp-"
"""What names a folder being written (:func:`atomic_directory`): ``.NAME.tmp-XXXXXXXX``."""


@contextmanager
def atomic_directory(path: str | os.PathLike[str], *, keep: Collection[str] = ()) -> Iterator[Path]:
    """Write the folder ``path`` out of sight: yield an empty folder to fill, put its contents at
    ``path`` only when the block ends without error.

    Nothing new appears before the end:

    * ``path`` does not exist: the folder yielded lies in a hidden sibling ``.NAME.tmp-XXXXXXXX``
      of the highest folder on the way to ``path`` that does not exist yet (``path`` itself when
      its parent exists), renamed to that name at the end: one atomic rename (a kill at any instant
      leaves the whole folder or none of it);
    * the folder exists already (a rerun, or a folder holding other outputs, such as
      ``RUN/analysis``): the folder yielded is a hidden ``.NAME.tmp-XXXXXXXX`` inside it, and at the
      end each file written replaces its namesake there with one rename (each file whole, old or
      new; files not written again are kept), then the temporary folder is removed.

    On any error, Ctrl-C included, the temporary folder is removed and ``path`` is as it was. A
    hidden ``.NAME.tmp-*`` left by a kill -9 is never read by any command.

    Args:
        path: the folder to write.
        keep: names of top-level entries of the temporary folder that are not moved into an
            existing folder (a run's ``.lock``: a lock file in use is never replaced).

    Raises:
        UsageError, ResourceError: the folder cannot be made or filled (:func:`write_error`); an
            error raised inside the block that names a file of the temporary folder (an
            :class:`~attnlab.errors.AttnlabError`, or an OSError, then as :func:`write_error`'s) is
            raised again naming that file at ``path``.
    """
    shown = Path(path)
    target = Path(os.path.abspath(shown))
    if os.path.lexists(target) and not target.is_dir():
        raise UsageError(f"{shown}: is a file; give a folder")
    inside = target.is_dir()
    top = target if inside else _highest_missing(target)
    ensure_folder(top.parent)
    staging = _make_staging(top if inside else top.parent, top.name, shown)
    inner = staging / target.relative_to(top) if top != target else staging
    try:
        inner.mkdir(parents=True, exist_ok=True)
        yield inner
        _publish(staging, top, keep=keep, inside=inside)
    except AttnlabError as error:
        shutil.rmtree(staging, ignore_errors=True)
        message = str(error).replace(str(inner), str(shown)).replace(str(staging), str(top))
        if message == str(error):
            raise
        raise type(error)(message) from None
    except OSError as error:
        shutil.rmtree(staging, ignore_errors=True)
        written = os.fsdecode(error.filename) if error.filename is not None else ""
        if not written.startswith(str(staging)):
            raise  # not a write of this folder's: not this function's to name
        raise write_error(written.replace(str(inner), str(shown)).replace(str(staging), str(top)), error) from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _highest_missing(target: Path) -> Path:
    """The highest folder on the way to ``target`` (absolute, missing) that does not exist."""
    top = target
    while not os.path.lexists(top.parent) and top.parent != top:
        top = top.parent
    return top


def _make_staging(place: Path, name: str, shown: Path) -> Path:
    """A new, empty hidden folder ``.NAME.tmp-XXXXXXXX`` in ``place`` (made with the permissions a
    plain mkdir gives, not mkdtemp's 0700: it becomes the folder asked for)."""
    stem = os.fsencode(name)[:200].decode("utf-8", "ignore")  # room for the mark in NAME_MAX
    for _ in range(100):
        staging = place / f".{stem}{TEMPORARY_MARK}{secrets.token_hex(4)}"
        try:
            os.mkdir(staging)
        except FileExistsError:
            continue
        except OSError as error:
            raise write_error(shown, error, action="cannot create the folder") from None
        return staging
    raise UsageError(f"{shown}: cannot create the folder: no free temporary name beside it")


def _publish(staging: Path, top: Path, *, keep: Collection[str], inside: bool) -> None:
    """Put the finished ``staging`` at ``top``: one rename when nothing stands there (or an empty
    folder), else (``inside``: it lies in ``top``, which existed) its files moved one by one over
    their namesakes."""
    if not inside:
        try:
            os.rename(staging, top)
        except OSError as error:
            if error.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not top.is_dir():
                raise write_error(top, error) from None
        else:
            fsync_directory(top.parent)
            return
    _merge(staging, top, keep=keep)
    shutil.rmtree(staging, ignore_errors=True)


def _merge(staging: Path, top: Path, *, keep: Collection[str]) -> None:
    """Move every file of ``staging`` over its namesake in the existing folder ``top`` (each with
    one rename: atomic), making the folders on the way; entries named in ``keep`` stay behind."""
    touched = {top}
    for source in sorted(staging.rglob("*")):  # a folder before what it holds
        relative = source.relative_to(staging)
        if relative.parts[0] in keep:
            continue
        destination = top / relative
        try:
            if source.is_dir() and not source.is_symlink():
                if not destination.is_dir():
                    destination.mkdir()
                continue
            os.replace(source, destination)
        except OSError as error:
            raise write_error(destination, error) from None
        touched.add(destination.parent)
    for folder in touched:
        fsync_directory(folder)


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
    """The safetensors bytes of ``tensors`` (made contiguous on the CPU) with ``metadata``, the same
    bytes for the same tensors in every process (:func:`_metadata_in_order`)."""
    prepared = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    data = safetensors_save(prepared, metadata=dict(metadata) if metadata else None)
    end = _HEADER_PREFIX + _header_length(data)
    head = data[:end]
    ordered = _metadata_in_order(head)
    return data if ordered == head else b"".join((ordered, memoryview(data)[end:]))  # one copy, where reordered


_HEADER_PREFIX = 8  # a safetensors file: the header's length (u64, little-endian), the JSON header, the data


def _header_length(head: bytes) -> int:
    return int.from_bytes(head[:_HEADER_PREFIX], "little")


def _metadata_in_order(head: bytes) -> bytes:
    """A safetensors file's length prefix and header with its ``__metadata__`` keys sorted: safetensors
    writes that map in a hash order that changes from process to process, so two runs that wrote
    equal weights wrote files whose SHA-256 differed. Same length (only the order changes); a header
    that would not fit is returned as it was."""
    length = _header_length(head)
    try:
        header = json.loads(head[_HEADER_PREFIX : _HEADER_PREFIX + length])
    except ValueError:
        return head
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__"), dict):
        return head
    if list(header["__metadata__"]) == sorted(header["__metadata__"]):
        return head  # in order already
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    if len(text) > length:
        return head
    return head[:_HEADER_PREFIX] + text + b" " * (length - len(text))


def stream_tensors(path: Path, tensors: Mapping[str, Tensor], metadata: Mapping[str, str] | None = None) -> None:
    """Write ``tensors`` as one safetensors file, atomically, tensor by tensor from memory to disk
    (safetensors' ``save_file``): no second copy of the weights in memory, as
    :func:`tensors_to_bytes` makes."""
    prepared = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}

    def fill(name: str) -> None:
        try:
            save_file(prepared, name, metadata=dict(metadata) if metadata else None)
        except SafetensorError as error:  # a failed write: its errno, named as any other write's
            os_error = _safetensors_os_error(error)
            if os_error is None:
                raise
            raise os_error from None
        with open(name, "r+b") as handle:  # the metadata's keys in one order (see _metadata_in_order)
            head = handle.read(_HEADER_PREFIX)
            head += handle.read(_header_length(head))
            ordered = _metadata_in_order(head)
            if ordered != head:
                handle.seek(0)
                handle.write(ordered)

    atomic_write_file(path, fill)


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
