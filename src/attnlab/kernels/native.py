"""attnlab's own CPU kernels (``native.cpp``, ``native_attention.cpp``), compiled with the machine's
C++ compiler on first use.

PyTorch runs two memory-bound steps of a training step on one core of a multi-core CPU:

* the transposed copy oneDNN needs for each weight gradient G^T X (:mod:`attnlab.kernels.linear`): aten's
  2-D transpose is a serial blocked loop, where :func:`transpose` copies on all cores;
* dropout's mask (:mod:`attnlab.kernels.dropout_masks`): NumPy's PCG64 draws its words serially, and three
  more passes compare, convert and scale them. :func:`scaled_keep_mask` draws the same PCG64 words
  on all cores (each thread jumps ahead to its share of the stream) and writes the scaled mask in
  one pass: the same masks, bit for bit, as the NumPy path, in less time.

Together they take two serial passes off one core in every training step (measured in
benchmarks/README.md).

:func:`short_attention` is soft attention for short heads (Vaswani Eq. 1, forward and backward).
PyTorch's CPU flash kernel cuts heads of d_k = 32 over 64 keys into GEMM calls too small to run
near the FMA units' rate; this kernel keeps one (batch, head) in L1 at a time, with register-tiled
products, and keeps the probabilities for the backward rather than recomputing them, so the
``train`` model's attention and step take less time than with PyTorch's kernel
(benchmarks/README.md).
Its two operators are registered with PyTorch (``torch.ops.attnlab.short_attention`` and
``short_attention_backward``), so dispatch modes such as ``torch.utils.flop_counter`` see them.

:func:`decode_attention` is soft attention for a decoding step: a few queries per (batch, head)
against a KV cache, scores, softmax and weighted sum of one (batch, head) at a time, where PyTorch
runs two batched GEMMs of one row per entry and a softmax between them (``native_decode_attention.cpp``).

:func:`rotary` rotates queries or keys by their positions (RoPE) in one pass, where PyTorch's ops
take five and three temporaries (``native_rotary.cpp``), for inference: ``torch.ops.attnlab.rotary``.

:func:`swiglu` is SwiGLU's SiLU(gate) * up in one pass over the activations (PyTorch makes two
and a tensor between them; ``native_swiglu.cpp``), for inference: an operator,
``torch.ops.attnlab.swiglu``.

:func:`few_rows_linear` is y = x W^T + b for an input of one to three rows (a decoding step at small
batch), on all cores: PyTorch's matrix-vector products read W on one core, at a fraction of the
rate the memory delivers to two, and a batch-1 decoding step of a language model is mostly that
read (``native_linear.cpp``; benchmarks/README.md). It is an operator too
(``torch.ops.attnlab.few_rows_linear``).

The kernels are built with ``torch.utils.cpp_extension`` (once) the first time a training step
needs them, for the vector instructions PyTorch's own kernels use on this CPU (AVX-512, AVX2, or the
compiler's default). The build is cached in PyTorch's extension directory (``TORCH_EXTENSIONS_DIR``,
by default ``~/.cache/torch_extensions``) under a name keyed by everything that makes one build
differ from another (:func:`build_spec`): the sources' bytes, the compiler flags, the compiler, the
CPU capability, the torch and Python versions, and where torch and Python's headers are installed.
Installs of attnlab that would build the same kernels (two checkouts in one environment: the
sources are built from copies in the build directory) share one build; any that would build other
kernels (another virtual environment) get their own, and never rebuild each other's.

The build says so on stderr before it starts (one line, with the time it typically takes) and
when it is done (the time it took); commands call :func:`prepare` before their progress bars, so
no bar runs through it. It runs ``ninja`` in a child process of its own session (with the
interpreter's directory on the child's PATH, where the ``ninja`` package puts it; this process's
``os.environ`` is never written), stopped when the process that started it is interrupted or (on
Linux) killed, and a completion marker, written atomically after it succeeded, makes it
complete: a complete build is loaded as it is, without the lock and without ``ninja`` (whose
build commands name the interpreter's paths as reached, so one virtual environment reached
through a symlink would otherwise rebuild). Concurrent first uses build once:
the build runs under an OS file lock in its directory (released if the process dies), and a
process that finds the lock taken says whose build it waits for, waits up to
``ATTNLAB_BUILD_WAIT_S`` seconds (default 600), then loads what the first one built, or, past
the limit, takes PyTorch's paths with a warning.

Where the build cannot run (no C++ compiler, no ``ninja``, a compiler without 128-bit integers)
:func:`kernels` returns None, the callers take PyTorch's and NumPy's paths (PyTorch's fused
attention, serial transposes, NumPy's words), and a warning says why, once. ``ATTNLAB_NATIVE=0``
in the environment skips the build.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType

import numpy as np
import torch
from torch import Tensor

from attnlab.errors import AttnlabWarning

try:
    import fcntl
except ImportError:  # Windows: PyTorch's own lock file (FileBaton) alone keeps builds apart
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "kernels",
    "available",
    "prepare",
    "unavailable_reason",
    "transpose",
    "scaled_keep_mask",
    "short_attention",
    "gradient_wanted",
    "few_rows_linear",
    "swiglu",
    "rotary",
    "decode_attention",
    "DECODE_ATTENTION_MAX_QUERIES",
    "SOURCES",
    "HEADERS",
    "BuildSpec",
    "build_spec",
    "build_flags",
    "build_key",
]

SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in (
        "native.cpp",
        "native_attention.cpp",
        "native_decode_attention.cpp",
        "native_linear.cpp",
        "native_rotary.cpp",
        "native_swiglu.cpp",
    )
)
"""The kernels' C++ sources, shipped with the package."""
HEADERS = (Path(__file__).with_name("native_vectors.h"),)
"""The header the sources share (staged beside them, and part of the build's key, not compiled alone)."""

# The vector instructions the kernels are compiled for, from the capability PyTorch's own kernels
# run with on this CPU (``torch.backends.cpu.get_cpu_capability``). The build's name carries it (and
# its key the flags), so a cache shared by machines of different CPUs (a home directory on a
# cluster) holds one build each.
_ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq", "-mavx2", "-mfma"],
    "AVX2": ["-mavx2", "-mfma"],
}

_UINT64_MASK = (1 << 64) - 1
_LANES = 16  # kLanes in native_attention.cpp: the kept probabilities' rows are padded to a multiple


@dataclass(frozen=True)
class BuildSpec:
    """What one build of the kernels is made from, and where it is cached.

    Attributes:
        name: the extension's name, ``attnlab_native_{capability}_{key}``, where ``key`` is 16 hex
            digits of a SHA-256 over everything that makes one build differ from another.
        directory: its build directory, ``TORCH_EXTENSIONS_DIR`` (or PyTorch's default root) / name.
        cflags: the extra compiler flags.
        ldflags: the extra linker flags.
    """

    name: str
    directory: Path
    cflags: tuple[str, ...]
    ldflags: tuple[str, ...]


def build_flags(capability: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The extra compiler and linker flags for a CPU of ``capability`` (``AVX512``, ``AVX2``, ...)."""
    openmp = ("-fopenmp",) if torch.backends.openmp.is_available() else ()
    # fp-contract: a * b + c as one FMA (ISO C++ mode would keep them apart).
    return ("-O3", "-ffp-contract=fast", *_ISA_FLAGS.get(capability, []), *openmp), openmp


def build_key(capability: str, cflags: tuple[str, ...], ldflags: tuple[str, ...]) -> str:
    """16 hex digits of a SHA-256 over what makes a build differ: the sources' names and bytes, the
    flags, the CPU capability, the torch version (and commit), the Python version and ABI, the
    compiler (its resolved path, size and modification time: an upgrade changes them), and where
    torch and Python's headers are installed.

    The last two are in PyTorch's build commands (``-isystem``, ``-L``), and ``ninja`` rebuilds when
    a command changes: two virtual environments get a build each rather than rebuilding one in
    turn. The sources' own location is not in the key: they are built from copies in the build
    directory (:func:`_stage_sources`), so two checkouts in one environment share a build."""
    digest = hashlib.sha256(b"attnlab-native-build-1")
    parts = [
        *(part for source in (*SOURCES, *HEADERS) for part in (source.name.encode(), source.read_bytes())),
        *(flag.encode() for flag in cflags),
        b"--ldflags--",
        *(flag.encode() for flag in ldflags),
        capability.encode(),
        str(torch.__version__).encode(),
        str(getattr(torch.version, "git_version", "")).encode(),
        sys.version.encode(),
        getattr(sys, "abiflags", "").encode(),
        _compiler_identity().encode(),
        os.path.dirname(os.path.realpath(torch.__file__)).encode(),
        str(sysconfig.get_path("include")).encode(),
    ]
    for part in parts:  # length-prefixed, so no two different lists of parts hash alike
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.hexdigest()[:16]


def _compiler_identity() -> str:
    """The C++ compiler PyTorch's build runs (``$CXX``, else ``c++``): its resolved path, size and
    modification time, or ``missing``. A ``stat``, not a ``--version`` run, which would start a
    process."""
    found = shutil.which(os.environ.get("CXX", "c++"))
    if found is None:
        return "missing"
    path = os.path.realpath(found)
    try:
        stat = os.stat(path)
    except OSError:
        return f"{path}:unreadable"
    return f"{path}:{stat.st_size}:{stat.st_mtime_ns}"


def build_spec(capability: str | None = None) -> BuildSpec:
    """The build of the kernels for this machine and install (``capability``: default this CPU's,
    ``torch.backends.cpu.get_cpu_capability()``)."""
    from torch.utils.cpp_extension import get_default_build_root

    capability = torch.backends.cpu.get_cpu_capability() if capability is None else capability
    cflags, ldflags = build_flags(capability)
    name = f"attnlab_native_{capability.lower()}_{build_key(capability, cflags, ldflags)}"
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return BuildSpec(name=name, directory=Path(root) / name, cflags=cflags, ldflags=ldflags)


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


def _stage_sources(directory: Path) -> list[str]:
    """Copies of :data:`SOURCES` (and :data:`HEADERS`) in ``directory/sources``, the files PyTorch builds: its build
    commands then name the same paths from every checkout of the same sources, and ``ninja`` has
    nothing to rebuild. A copy is written only where it is missing or differs (its modification
    time is what ``ninja`` compares), through a temporary file, so a killed write leaves none half
    written. Called under the build lock."""
    staged = directory / "sources"
    staged.mkdir(exist_ok=True)
    paths = []
    for source in (*HEADERS, *SOURCES):
        data, target = source.read_bytes(), staged / source.name
        if not target.is_file() or target.read_bytes() != data:
            partial = target.with_name(target.name + ".partial")
            partial.write_bytes(data)
            os.replace(partial, target)
        paths.append(str(target))
    return paths[len(HEADERS) :]  # the sources to compile; the headers sit beside them


@cache
def _build() -> tuple[ModuleType | None, str | None]:
    if os.environ.get("ATTNLAB_NATIVE", "1") == "0":
        return None, "ATTNLAB_NATIVE=0 in the environment"
    try:
        module = _load_once(build_spec())
    except Exception as error:  # a missing compiler or ninja surfaces as several exception types
        text = str(error).strip()
        first = text.splitlines()[0] if text else ""
        ours = isinstance(error, (BuildError, TimeoutError))  # in our words: the build's reason, the wait given up
        reason = text if ours else f"{type(error).__name__}: {first}"
        warnings.warn(
            f"attnlab's CPU kernels are not available ({reason}); attnlab uses PyTorch's serial "
            "transposes, NumPy's dropout words and PyTorch's fused attention instead (slower, same results)",
            AttnlabWarning,
            stacklevel=3,
        )
        return None, reason
    _register_fake_kernels()
    return module, None


def _register_fake_kernels() -> None:
    """Shapes and layouts of the attention operators' outputs without running them, for tracing
    (``torch.compile``, FakeTensor)."""

    def heads(like: Tensor, b: int, h: int, t: int, d: int) -> Tensor:  # (B, H, T, d) laid out (B, T, H, d)
        return like.new_empty(b, t, h, d).permute(0, 2, 1, 3)

    @torch.library.register_fake("attnlab::short_attention")
    def _forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        b, h, t_q, _ = q.shape
        t_k = k.shape[2]
        return heads(q, b, h, t_q, v.shape[3]), q.new_empty(b, h, t_k, -(-t_q // _LANES) * _LANES)

    @torch.library.register_fake("attnlab::few_rows_linear")
    def _few_rows_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return x.new_empty(x.shape[0], weight.shape[0])

    @torch.library.register_fake("attnlab::decode_attention")
    def _decode_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float) -> Tensor:
        b, h, t_q, _ = q.shape
        return heads(q, b, h, t_q, v.shape[3])

    @torch.library.register_fake("attnlab::rotary")
    def _rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return x.new_empty(x.shape)

    @torch.library.register_fake("attnlab::swiglu")
    def _swiglu(hidden: Tensor) -> Tensor:
        return hidden.new_empty(hidden.shape[0], hidden.shape[1] // 2)

    @torch.library.register_fake("attnlab::short_attention_backward")
    def _backward(
        grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, probs: Tensor, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        b, h, t_q, d_k = q.shape
        t_k = k.shape[2]
        return heads(q, b, h, t_q, d_k), heads(q, b, h, t_k, d_k), heads(q, b, h, t_k, v.shape[3])


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


def kernels() -> ModuleType | None:
    """The compiled kernels, building them on the first call; None where they cannot be built."""
    return _build()[0]


def available() -> bool:
    """Whether the kernels are built (building them on the first call)."""
    return kernels() is not None


def prepare(*devices: torch.device | str) -> None:
    """Build (or load) the kernels now where a model on one of ``devices`` may call them (a CPU).

    A command calls this once before its progress bar starts, so that the one-time build, or the
    wait for another process's, is announced and done before the bar, not inside its first step.
    Where the kernels cannot be built, the warning that says why comes here too."""
    if any(torch.device(device).type == "cpu" for device in devices):
        kernels()


def gradient_wanted(*tensors: Tensor | None) -> bool:
    """Whether autograd records this call: grad mode on and one of ``tensors`` (None skipped)
    requires a gradient. The kernels without a backward (all but :func:`short_attention`) take
    only calls where it does not."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# Traced code (torch.compile) takes available()'s answer as given, not the build. This is what
# torch.compiler.assume_constant_result does, without the import of torch._dynamo it makes (over
# a second and 75 MB at every command's start); tests/unit/kernels/test_native.py checks the two agree.
available._dynamo_marked_constant = True  # type: ignore[attr-defined]


def unavailable_reason() -> str | None:
    """Why :func:`kernels` is None (after it was called), or None where the kernels are built."""
    return _build()[1]


def _loaded() -> ModuleType:
    module = kernels()
    if module is None:
        raise RuntimeError(f"attnlab's CPU kernels are not available: {unavailable_reason()}")
    return module


def transpose(x: Tensor) -> Tensor:
    """A contiguous copy of x^T, on all cores. ``x``: a contiguous (R, C) float32 CPU tensor -> (C, R)."""
    return _loaded().transpose(x)


def scaled_keep_mask(
    shape: torch.Size | tuple[int, ...], *, seed: int, bits: int, threshold: int, scale: float
) -> Tensor:
    """float32 mask of ``shape``: ``scale`` where word i is >= ``threshold``, else 0.

    Word i is the i-th signed ``bits``-bit piece (low bits first) of the 64-bit draws of
    ``numpy.random.PCG64(seed).random_raw``: the words :func:`attnlab.kernels.dropout_masks.keep_mask` compares.
    """
    state = np.random.PCG64(seed).state["state"]  # the 128-bit LCG state and increment after seeding
    lcg, inc = state["state"], state["inc"]
    mask = _loaded().scaled_keep_mask(
        math.prod(shape), bits, lcg >> 64, lcg & _UINT64_MASK, inc >> 64, inc & _UINT64_MASK, threshold, scale
    )
    return mask.view(shape)


SHORT_ATTENTION_MAX_KEYS = 256
"""The most keys :func:`short_attention` takes (kMaxKeys in native_attention.cpp)."""
SHORT_ATTENTION_MAX_HEAD_DIM = 256
"""The widest head (d_k, d_v) :func:`short_attention` takes (kMaxHeadDim in native_attention.cpp)."""
SHORT_ATTENTION_MAX_QUERIES = 256
"""The most queries :func:`attnlab.kernels.short_attention_applies` hands the kernel. It takes more, but a
head's kept probabilities then outgrow L2 and PyTorch's fused kernel is faster
(benchmarks/README.md)."""


def short_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float) -> Tensor:
    """softmax(scale Q K^T) V, one (batch, head) in L1 at a time, with its backward (``native_attention.cpp``).

        Attention(Q, K, V) = softmax(scale Q K^T) V                       (Vaswani et al. §3.2.1, Eq. 1)

    ``causal`` gives 0 weight to keys after each query's position, bottom-right aligned when
    T_k > T_q (query i sees keys j <= i + T_k - T_q), as :func:`attnlab.nn.attention.attention` does.
    The backward uses the probabilities the forward keeps, (B, H, T_k, T_q rounded up to 16) floats.

    Args:
        q: queries.
        k: keys.
        v: values.
        causal: mask keys after each query's position.
        scale: multiplies Q K^T (1/sqrt(d_k) in Eq. 1).

    Shape:
        q: (B, H, T_q, d_k);  k: (B, H, T_k, d_k);  v: (B, H, T_k, d_v), float32 on the CPU, unit
        stride in d, T_k <= :data:`SHORT_ATTENTION_MAX_KEYS`; returns (B, H, T_q, d_v), laid out
        as (B, T_q, H, d_v), so the heads' concatenation is a view.

    Returns:
        The attention output, differentiable with respect to q, k and v.
    """
    if not available():
        _loaded()  # raises, naming the reason
    return _ShortAttention.apply(q, k, v, causal, scale)


def few_rows_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """y = x W^T + b with W's rows split over all cores, for inputs of a few rows (``native_linear.cpp``).

    Each output is summed in float32 in an order that depends on d_in alone; bfloat16 inputs are
    widened exactly as they are read and the output rounded to bfloat16 once. No gradient: callers
    take ``F.linear`` where one is needed.

    Args:
        x: the inputs.
        weight: W, contiguous.
        bias: b, contiguous, or None.

    Shape:
        x: (..., d_in) float32 or bfloat16 on the CPU, of W's dtype, few rows (the kernel reads W
        once per 4 rows of x);
        weight: (d_out, d_in); bias: (d_out,); returns (..., d_out).
    """
    _loaded()
    return torch.ops.attnlab.few_rows_linear(_rows(x), weight, bias).view(*x.shape[:-1], weight.shape[0])


DECODE_ATTENTION_MAX_QUERIES = 4
"""The most queries per (batch, head) :func:`attnlab.kernels.decode_attention_applies` hands
:func:`decode_attention` (a decoding step has one, or a group's under grouped-query attention). It
takes more, but from about 8 queries over up to 256 keys :func:`short_attention` is faster
(benchmarks/README.md)."""


def decode_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, causal: bool, scale: float) -> Tensor:
    """softmax(mask(scale Q K^T)) V, one (batch, head) at a time (``native_decode_attention.cpp``).

        Attention(Q, K, V) = softmax(scale Q K^T) V                       (Vaswani et al. §3.2.1, Eq. 1)

    Keys the mask forbids (False) and, with ``causal``, keys after a query's position
    (bottom-right aligned) get weight 0; a query that may see no key gets zeros. No gradient.

    Args:
        q: queries.
        k: keys (a KV cache's view is fine: any strides with unit stride in d).
        v: values.
        mask: True where a query may attend; broadcastable to (B, H, T_q, T_k); or None.
        causal: mask keys after each query's position.
        scale: multiplies Q K^T.

    Shape:
        q: (B, H, T_q, d_k); k: (B, H, T_k, d_k); v: (B, H, T_k, d_v), float32 on the CPU; returns
        (B, H, T_q, d_v), laid out as (B, T_q, H, d_v), so the heads' concatenation is a view.
    """
    _loaded()  # the operator is registered when the kernels load (raises, naming why, if they cannot)
    if mask is not None:
        mask = mask.expand(*q.shape[:-1], k.shape[-2])  # (B, H, T_q, T_k), a view
    return torch.ops.attnlab.decode_attention(q, k, v, mask, causal, scale)


def rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x cos(m theta) + rotate_half(x) sin(m theta) in one pass (``native_rotary.cpp``).

        RoPE(x, m) = x cos(m theta) + rotate_half(x) sin(m theta)       (Su et al. 2021, Eq. 34)

    No gradient: callers take PyTorch's ops where one is needed.

    Shape:
        x: (B, H, T, d) float32 on the CPU, unit stride in d; cos, sin: (B or 1, 1, T, d);
        returns (B, H, T, d), contiguous.
    """
    _loaded()
    return torch.ops.attnlab.rotary(x, cos.squeeze(1).contiguous(), sin.squeeze(1).contiguous())


def swiglu(hidden: Tensor) -> Tensor:
    """SiLU(gate) * up in one pass over [gate, up] side by side (``native_swiglu.cpp``).

        h = SiLU(g) * u = g sigmoid(g) u                        (Shazeer 2020, Eq. 6)

    No gradient: callers take PyTorch's ops where one is needed.

    Shape:
        hidden: (..., 2 d_ff) float32 on the CPU, unit stride in the last dim -> (..., d_ff).
    """
    _loaded()
    return torch.ops.attnlab.swiglu(_rows(hidden)).view(*hidden.shape[:-1], hidden.shape[-1] // 2)


def _rows(x: Tensor) -> Tensor:
    """``x`` as (R, d), R = all its leading dims (a view where it can be), with unit stride in d."""
    rows = x.reshape(-1, x.shape[-1])  # (R, d)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


class _ShortAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tensor:  # noqa: ANN001
        output, probs = torch.ops.attnlab.short_attention(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, probs)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx, grad_output: Tensor) -> tuple[Tensor, Tensor, Tensor, None, None]:  # noqa: ANN001
        q, k, v, probs = ctx.saved_tensors
        if grad_output.stride(-1) != 1:
            grad_output = grad_output.contiguous()
        grads = torch.ops.attnlab.short_attention_backward(grad_output, q, k, v, probs, ctx.scale)
        if torch.is_grad_enabled():  # create_graph=True: differentiating these gradients must fail loudly
            grads = _NoSecondDerivative.apply(*grads, q, k, v)
        return (*grads, None, None)


class _NoSecondDerivative(torch.autograd.Function):
    """Passes the gradients through; a derivative of them raises (as for PyTorch's fused kernels)."""

    @staticmethod
    def forward(  # noqa: ANN001
        ctx, grad_q: Tensor, grad_k: Tensor, grad_v: Tensor, *inputs: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        del ctx, inputs  # the inputs only tie these gradients to the graph
        return grad_q.clone(), grad_k.clone(), grad_v.clone()

    @staticmethod
    def backward(ctx, *grads: Tensor) -> None:  # noqa: ANN001
        raise RuntimeError(
            "attnlab's short attention kernel has no second derivative (nor has PyTorch's fused "
            "attention); ask attention() for the weights (need_weights / return_weights) to take the "
            "explicit path, which has one"
        )
