"""Which build of attnlab's C++ CPU kernels this machine and install need, and where it is cached.

The kernels (:mod:`attnlab.kernels.native`) are built with ``torch.utils.cpp_extension`` for the
vector instructions PyTorch's own kernels use on this CPU (AVX-512, AVX2, or the compiler's
default). The build is cached in PyTorch's extension directory (``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``) under a name keyed by everything that makes one build differ from
another (:func:`build_spec`): the sources' bytes, the compiler flags, the compiler, the CPU
capability, the torch and Python versions, and where torch and Python's headers are installed.
Installs of attnlab that would build the same kernels (two checkouts in one environment: the
sources are built from copies in the build directory, :func:`_stage_sources`) share one build; any
that would build other kernels (another virtual environment) get their own, and never rebuild each
other's. Building it once and loading it is :mod:`attnlab.kernels.native_build`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["SOURCES", "HEADERS", "BuildSpec", "build_spec", "build_flags", "build_key"]

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
