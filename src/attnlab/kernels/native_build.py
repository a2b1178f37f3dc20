"""Building attnlab's C++ CPU kernels once per machine and install, one process at a time, and loading them.

The build (:func:`~attnlab.kernels.native_spec.build_spec` says which, and where it is cached)
says so on stderr before it starts (one line, with the time it typically takes) and when it is
done (the time it took); commands call :func:`attnlab.kernels.native.prepare` before their progress
bars, so no bar runs through it. It runs ``ninja`` in a child process of its own session (with the
interpreter's directory on the child's PATH, where the ``ninja`` package puts it; this process's
``os.environ`` is never written), stopped when the process that started it is interrupted or (on
Linux) killed, and a completion marker, written atomically after it succeeded, makes it
complete: a complete build is loaded as it is, without the lock and without ``ninja`` (whose
build commands name the interpreter's paths as reached, so one virtual environment reached
through a symlink would otherwise rebuild). Concurrent first uses build once:
the build runs under an OS file lock in its directory (released if the process dies), and a
process that finds the lock taken says whose build it waits for, waits up to
``ATTNLAB_BUILD_WAIT_S`` seconds (default 600), then loads what the first one built, or, past
the limit, takes PyTorch's paths with a warning (:func:`attnlab.kernels.native.kernels`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

from attnlab.kernels.native_spec import BuildSpec, _stage_sources

try:
    import fcntl
except ImportError:  # Windows: PyTorch's own lock file (FileBaton) alone keeps builds apart
    fcntl = None  # type: ignore[assignment]

__all__ = ["BUILD_WAIT_S", "TYPICAL_BUILD", "BuildError"]

BUILD_WAIT_S = 600.0
"""How long a process waits for another process's build of the kernels before it takes PyTorch's
paths instead (seconds; ``ATTNLAB_BUILD_WAIT_S`` in the environment sets it)."""
TYPICAL_BUILD = "about 35 s on 2 cores of a Zen 4"
"""What the one-time build typically takes, for the line that announces it (measured on 2 cores of
a Zen 4 EPYC; more cores build the six sources side by side)."""
_LOCK_NAME = "attnlab-build.lock"
_POLL_S = 0.2  # how often a waiting process tries the build lock again


def _say(line: str) -> None:
    """One line on stderr, for the one-time build and the wait for another process's build."""
    print(f"attnlab: {line}", file=sys.stderr, flush=True)


def _wait_limit() -> float:
    """``ATTNLAB_BUILD_WAIT_S`` (seconds, >= 0), or :data:`BUILD_WAIT_S` where it is not set.

    Raises:
        BuildError: the variable is set to something else (then the kernels are not built, and
            :func:`kernels` warns with this message).
    """
    text = os.environ.get("ATTNLAB_BUILD_WAIT_S", "").strip()
    if not text:
        return BUILD_WAIT_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:  # also NaN
        raise BuildError(f"ATTNLAB_BUILD_WAIT_S={text!r} is not a number of seconds >= 0")
    return seconds


@contextmanager
def _exclusive(lock_path: Path, wait_s: float = BUILD_WAIT_S) -> Iterator[None]:
    """Hold an exclusive OS lock on ``lock_path`` (``flock``: the OS releases it when the process
    dies, so a killed build never leaves a stale lock). The holder writes its pid in the file.

    A process that finds the lock taken says so (one line naming the holder's pid and the lock
    file) and tries again every 0.2 s for up to ``wait_s`` seconds.

    Raises:
        TimeoutError: the lock was still taken after ``wait_s`` seconds.
    """
    if fcntl is None:
        yield
        return
    handle = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if not _try_lock(handle):
            holder = _holder(lock_path)
            _say(
                f"waiting for another process's build of the C++ CPU kernels ({holder}, lock {lock_path}); "
                f"giving up after {wait_s:g} s (ATTNLAB_BUILD_WAIT_S)"
            )
            deadline = time.monotonic() + wait_s
            while not _try_lock(handle):
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"another process's build ({_holder(lock_path)}) still held {lock_path} after {wait_s:g} s "
                        "(ATTNLAB_BUILD_WAIT_S)"
                    )
                time.sleep(_POLL_S)
        try:
            os.ftruncate(handle, 0)
            os.pwrite(handle, str(os.getpid()).encode(), 0)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
    finally:
        os.close(handle)


def _try_lock(handle: int) -> bool:
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _holder(lock_path: Path) -> str:
    """``pid N``, the process that wrote its pid in the lock file, or ``pid unknown``."""
    try:
        text = lock_path.read_text().strip()
    except OSError:
        text = ""
    return f"pid {text}" if text.isdigit() else "pid unknown"


def _library(spec: BuildSpec) -> Path:
    """The built extension: ``name.so`` (``.pyd`` on Windows) in the build directory."""
    return spec.directory / f"{spec.name}{'.pyd' if sys.platform == 'win32' else '.so'}"


def _marker(spec: BuildSpec) -> Path:
    return spec.directory / "attnlab-build.complete"


def _marker_text(spec: BuildSpec) -> str | None:
    """What the completion marker says of the library as it is now: its name, size and modification
    time (None where there is no library). A library rewritten after the marker (by anything)
    no longer matches it."""
    try:
        stat = _library(spec).stat()
    except OSError:
        return None
    return f"{spec.name} {stat.st_size} {stat.st_mtime_ns}\n"


def _complete(spec: BuildSpec) -> bool:
    """Whether the build directory holds a complete build: a library its completion marker describes."""
    expected = _marker_text(spec)
    try:
        return expected is not None and _marker(spec).read_text() == expected
    except OSError:
        return False


def _mark_complete(spec: BuildSpec) -> None:
    """Write the completion marker through a temporary file, so it is whole or absent."""
    text = _marker_text(spec)
    if text is None:
        raise FileNotFoundError(f"the build wrote no {_library(spec)}")
    partial = _marker(spec).with_name(_marker(spec).name + ".partial")
    partial.write_text(text)
    os.replace(partial, _marker(spec))


def _import_built(spec: BuildSpec) -> ModuleType:
    """Load the built library as a Python module (what ``torch.utils.cpp_extension.load`` does once
    ``ninja`` is done), without running ``ninja``: its build commands name the interpreter's paths
    as reached (a virtual environment through a symlink), and a command it has not seen makes it
    rebuild."""
    found = importlib.util.spec_from_file_location(spec.name, _library(spec))
    if found is None or found.loader is None:
        raise ImportError(f"{_library(spec)} cannot be loaded as a Python extension")
    module = importlib.util.module_from_spec(found)
    found.loader.exec_module(module)
    return module


def _load_once(
    spec: BuildSpec,
    build: Callable[[BuildSpec, list[str]], None] | None = None,
    load: Callable[[BuildSpec], ModuleType] = _import_built,
) -> ModuleType:
    """Build the kernels of ``spec`` where no complete build exists, one process at a time, and load them.

    A complete build (a completion marker describing the library, written after the build
    succeeded) is loaded as it is, without the lock and without ``ninja``. Otherwise, under the
    build lock: PyTorch's own lock file (``lock``, a FileBaton that a killed build leaves behind,
    after which every later build would wait forever) can only be a dead process's, and is removed;
    a process that waited for another's build finds it complete and loads it; else the build runs
    (``build``, default :func:`_build_in_child`), announced on stderr with the time it typically
    takes and followed by the time it took, and the marker is written.
    """
    build = _build_in_child if build is None else build
    wait_s = _wait_limit()
    spec.directory.mkdir(parents=True, exist_ok=True)
    if not _complete(spec):
        with _exclusive(spec.directory / _LOCK_NAME, wait_s):
            if not _complete(spec):
                (spec.directory / "lock").unlink(missing_ok=True)
                _marker(spec).unlink(missing_ok=True)
                sources = _stage_sources(spec.directory)
                _say(
                    f"building the C++ CPU kernels, once for this machine and environment ({TYPICAL_BUILD}; "
                    f"cached in {spec.directory}; ATTNLAB_NATIVE=0 skips them)"
                )
                started = time.monotonic()
                build(spec, sources)
                _mark_complete(spec)
                _say(f"built the C++ CPU kernels in {time.monotonic() - started:.1f} s")
    return load(spec)


# Run by _build_in_child with this interpreter: PyTorch's build (``ninja`` and the compiler) of the
# kernels, in a process group of its own that dies with the process that started it.
_BUILD_SCRIPT = """
import json, os, signal, sys

def stop(*_):  # the parent died or was interrupted: stop ninja, which interrupts its compilers
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.killpg(0, signal.SIGTERM)
    os._exit(1)

signal.signal(signal.SIGTERM, stop)
parent = int(sys.argv[2])
try:  # Linux: SIGTERM when the parent dies (PR_SET_PDEATHSIG)
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)
except (OSError, AttributeError):
    pass
if os.getppid() != parent:  # the parent died before prctl
    stop()
from torch.utils.cpp_extension import load
try:
    load(**json.loads(sys.argv[1]), verbose=False)
except Exception as error:  # one line: the compiler's or shell's complaint where there is one
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [""]
    telling = [line for line in lines[1:] if "error" in line.lower() or "not found" in line.lower()]
    reason = (telling or lines)[0]
    print(f"{type(error).__name__}: {reason[:300] + ' ...' if len(reason) > 300 else reason}", file=sys.stderr)
    sys.exit(1)
"""


class BuildError(RuntimeError):
    """The kernels cannot be built: the build failed (the message is the build process's reason,
    one line), or ``ATTNLAB_BUILD_WAIT_S`` is not a number of seconds."""


def _build_in_child(spec: BuildSpec, sources: list[str]) -> None:
    """Build ``spec`` from ``sources`` with ``torch.utils.cpp_extension.load`` in a child process
    of this interpreter, in a session of its own: when this process is interrupted the child is
    stopped, and when it is killed the child is told (Linux) and stops ``ninja``, which stops the
    compilers, so no build is left running.

    Raises:
        BuildError: the build failed (the child's reason, one line: its exception's type and the
            compiler's complaint, or its message's first line).
    """
    arguments = {
        "name": spec.name,
        "sources": sources,
        "extra_cflags": list(spec.cflags),
        "extra_ldflags": list(spec.ldflags),
        "build_directory": str(spec.directory),
    }
    child = subprocess.Popen(
        [sys.executable, "-c", _BUILD_SCRIPT, json.dumps(arguments), str(os.getpid())],
        env=_build_environment(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, errors = child.communicate()
    finally:
        if child.poll() is None:  # interrupted (Ctrl-C reaches this process, not the child's session)
            child.terminate()
            child.wait()
    if child.returncode != 0:
        lines = [line for line in errors.splitlines() if line.strip()]
        raise BuildError(lines[-1] if lines else f"the build process exited with status {child.returncode}")


def _build_environment() -> dict[str, str]:
    """The environment of the build's child process: this process's, with the interpreter's
    directory first on PATH where ``ninja`` is not on it. PyTorch's build runs ``ninja`` from PATH;
    the ``ninja`` package (a dependency) installs it beside the interpreter, which is not on PATH
    when a virtual environment is not activated. A copy: this process's ``os.environ`` is never
    written (it is the user's)."""
    environment = dict(os.environ)
    if shutil.which("ninja", path=environment.get("PATH")) is None:
        scripts = str(Path(sys.executable).parent)
        environment["PATH"] = os.pathsep.join([scripts, environment.get("PATH", "")])
    return environment
