"""The kernels' build cache: a name keyed by what makes a build differ, and one build at a time.

The key's inputs are monkeypatched one by one (sources, flags, capability, torch and Python
versions, compiler): each changes the name, and nothing else does. The lock is checked with a
stand-in for PyTorch's ``load`` (two threads, one builds) and with a process killed while holding
it; the slow test builds the real kernels from two processes at once into an empty extensions
directory and counts the compiler's runs.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch

from attnlab.errors import AttnlabWarning
from attnlab.kernels import native, native_build, native_spec

FLAGS = ("-O3", "-mavx2")
LDFLAGS = ("-fopenmp",)


def _key(capability: str = "AVX2", cflags: tuple[str, ...] = FLAGS, ldflags: tuple[str, ...] = LDFLAGS) -> str:
    return native_spec.build_key(capability, cflags, ldflags)


def test_the_name_is_stable_and_says_the_capability():
    spec = native_spec.build_spec("AVX512")
    assert spec == native_spec.build_spec("AVX512")
    assert re.fullmatch(r"attnlab_native_avx512_[0-9a-f]{16}", spec.name)
    assert spec.cflags == native_spec.build_flags("AVX512")[0] and "-mavx512f" in spec.cflags
    assert native_spec.build_spec("AVX2").name.startswith("attnlab_native_avx2_")
    assert native_spec.build_spec("AVX2").name != spec.name


def test_the_build_directory_is_the_name_under_torch_extensions_dir(monkeypatch, tmp_path):
    name = native_spec.build_spec("AVX2").name
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert native_spec.build_spec("AVX2").directory == tmp_path / name  # the directory is no part of the key


def _copy_sources(tmp_path: Path, folder: str) -> tuple[Path, ...]:
    (tmp_path / folder).mkdir()
    return tuple(Path(shutil.copy(source, tmp_path / folder / source.name)) for source in native_spec.SOURCES)


def test_another_checkout_of_the_same_sources_shares_the_build(monkeypatch, tmp_path):
    before = _key()
    monkeypatch.setattr(native_spec, "SOURCES", _copy_sources(tmp_path, "other_checkout"))
    assert _key() == before


@pytest.mark.parametrize("which", [0, 1])
def test_a_changed_source_byte_changes_the_name(monkeypatch, tmp_path, which):
    sources = _copy_sources(tmp_path, "edited")
    monkeypatch.setattr(native_spec, "SOURCES", sources)
    before = _key()
    data = bytearray(sources[which].read_bytes())
    data[len(data) // 2] ^= 0x01
    sources[which].write_bytes(bytes(data))
    assert _key() != before


def test_flags_change_the_name():
    before = _key()
    assert _key(cflags=FLAGS + ("-O2",)) != before
    assert _key(cflags=("-mavx2", "-O3")) != before  # order matters to a compiler
    assert _key(ldflags=()) != before
    assert _key(cflags=FLAGS + LDFLAGS, ldflags=()) != before  # a flag moved from the link to the compile
    assert _key() == before


@pytest.mark.parametrize(
    "target, attribute, value",
    [
        (torch, "__version__", "9.9.9+cpu"),
        (torch.version, "git_version", "0" * 40),
        (sys, "version", "3.99.0 (main) [GCC 99]"),
        (sys, "abiflags", "t"),
        (torch, "__file__", "/another/venv/lib/python3.11/site-packages/torch/__init__.py"),
    ],
)
def test_torch_and_python_versions_and_places_change_the_name(monkeypatch, target, attribute, value):
    before = _key()
    monkeypatch.setattr(target, attribute, value, raising=False)
    assert _key() != before


def test_the_capability_changes_the_name():
    assert _key("AVX2") != _key("AVX512") != _key("DEFAULT")


def test_the_compiler_changes_the_name(monkeypatch, tmp_path):
    before = _key()
    compiler = tmp_path / "g++"
    compiler.write_text("#!/bin/sh\nexit 0\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CXX", str(compiler))
    other = _key()
    assert other != before
    os.utime(compiler, ns=(0, 0))  # an upgraded compiler in place: another modification time
    assert _key() != other
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert _key() not in (before, other)


def _spec(tmp_path: Path, name: str = "attnlab_native_test_0") -> native_spec.BuildSpec:
    return native_spec.BuildSpec(name=name, directory=tmp_path / "ext" / name, cflags=(), ldflags=())


def _fake_build(builds: list, seconds: float = 0.0):
    """A stand-in for the compiler: records the call, takes ``seconds``, writes the library."""

    def build(spec: native_spec.BuildSpec, sources: list[str]) -> None:
        builds.append(sources)
        time.sleep(seconds)
        native_build._library(spec).write_bytes(b"built")

    return build


def _fake_load(spec: native_spec.BuildSpec) -> types.ModuleType:
    assert native_build._library(spec).read_bytes() == b"built"
    return types.ModuleType(spec.name)


def test_two_concurrent_first_uses_build_once(tmp_path):
    """Two threads ask for the same build at once; a stand-in for the build takes 0.3 s. The lock
    makes the second wait and find the build complete."""
    spec = _spec(tmp_path)
    builds, results = [], []
    start = threading.Barrier(2)

    def first_use():
        start.wait()
        results.append(native_build._load_once(spec, _fake_build(builds, 0.3), _fake_load).__name__)

    threads = [threading.Thread(target=first_use) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert results == [spec.name, spec.name]
    assert len(builds) == 1


def test_the_build_is_announced_and_a_complete_build_is_loaded_silently_without_a_build(tmp_path, capsys):
    spec = _spec(tmp_path)
    builds = []
    native_build._load_once(spec, _fake_build(builds), _fake_load)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and len(builds) == 1
    assert lines[0].startswith("attnlab: building the C++ CPU kernels, once") and native_build.TYPICAL_BUILD in lines[0]
    assert str(spec.directory) in lines[0]
    assert re.fullmatch(r"attnlab: built the C\+\+ CPU kernels in \d+\.\d s", lines[1])
    assert native_build._complete(spec)
    (spec.directory / native_build._LOCK_NAME).unlink()  # the lock is not taken for a complete build
    assert native_build._load_once(spec, _fake_build(builds), _fake_load).__name__ == spec.name
    assert len(builds) == 1 and capsys.readouterr().err == ""
    assert not (spec.directory / native_build._LOCK_NAME).exists()


@pytest.mark.parametrize("damage", ["no marker", "library rewritten", "marker of another build"])
def test_a_library_its_marker_does_not_describe_is_built_again(tmp_path, damage):
    """A library without a completion marker may be half written (a killed build): it is never
    loaded as it is, and neither is one rewritten after its marker."""
    spec = _spec(tmp_path)
    builds = []
    native_build._load_once(spec, _fake_build(builds), _fake_load)
    if damage == "no marker":
        native_build._marker(spec).unlink()
    elif damage == "library rewritten":
        native_build._library(spec).write_bytes(b"half")
    else:
        native_build._marker(spec).write_text(native_build._marker_text(spec).replace(spec.name, spec.name + "x"))
    assert not native_build._complete(spec)
    native_build._load_once(spec, _fake_build(builds), _fake_load)
    assert len(builds) == 2 and native_build._complete(spec)


def test_a_failed_build_leaves_no_marker_and_raises(tmp_path):
    spec = _spec(tmp_path)

    def failing(spec: native_spec.BuildSpec, sources: list[str]) -> None:
        native_build._library(spec).write_bytes(b"half")
        raise RuntimeError("Error building extension")

    with pytest.raises(RuntimeError, match="Error building"):
        native_build._load_once(spec, failing, _fake_load)
    assert not native_build._marker(spec).exists() and not native_build._complete(spec)


@pytest.mark.skipif(native_build.fcntl is None, reason="no fcntl on this platform")
def test_a_process_finding_the_build_lock_taken_says_so_and_gives_up_after_the_limit(tmp_path, capsys, monkeypatch):
    """Another holder of the lock (a thread here: its own open file, so its own lock) builds; the
    waiter says whom it waits for, where the lock is, and raises after ATTNLAB_BUILD_WAIT_S."""
    spec = _spec(tmp_path)
    spec.directory.mkdir(parents=True)
    lock = spec.directory / native_build._LOCK_NAME
    held, release = threading.Event(), threading.Event()

    def builder():
        with native_build._exclusive(lock):
            held.set()
            release.wait(30)

    thread = threading.Thread(target=builder)
    thread.start()
    try:
        assert held.wait(30)
        monkeypatch.setenv("ATTNLAB_BUILD_WAIT_S", "0.3")
        builds = []
        with pytest.raises(TimeoutError, match=f"pid {os.getpid()}.*0.3 s"):
            native_build._load_once(spec, _fake_build(builds), _fake_load)
        assert builds == []
        assert capsys.readouterr().err.splitlines() == [
            f"attnlab: waiting for another process's build of the C++ CPU kernels (pid {os.getpid()}, lock {lock}); "
            "giving up after 0.3 s (ATTNLAB_BUILD_WAIT_S)"
        ]
    finally:
        release.set()
        thread.join(30)


@pytest.mark.skipif(native_build.fcntl is None, reason="no fcntl on this platform")
def test_a_wait_given_up_falls_back_to_pytorch_with_one_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("ATTNLAB_BUILD_WAIT_S", "0")
    monkeypatch.delenv("ATTNLAB_NATIVE", raising=False)
    spec = native_spec.build_spec()
    spec.directory.mkdir(parents=True)
    held, release = threading.Event(), threading.Event()

    def builder():
        with native_build._exclusive(spec.directory / native_build._LOCK_NAME):
            held.set()
            release.wait(30)

    thread = threading.Thread(target=builder)
    thread.start()
    try:
        assert held.wait(30)
        expected = "CPU kernels are not available \\(another process's build \\(pid"
        with pytest.warns(AttnlabWarning, match=expected) as seen:
            module, reason = native._build.__wrapped__()
        assert module is None and reason.startswith("another process's build") and len(seen) == 1
    finally:
        release.set()
        thread.join(30)


@pytest.mark.parametrize("value", ["soon", "-1", "nan"])
def test_a_wait_limit_that_is_not_seconds_is_named(monkeypatch, value):
    monkeypatch.setenv("ATTNLAB_BUILD_WAIT_S", value)
    with pytest.raises(native_build.BuildError, match=f"ATTNLAB_BUILD_WAIT_S='{value}' is not a number of seconds"):
        native_build._wait_limit()


def test_the_wait_limit_defaults_to_ten_minutes(monkeypatch):
    monkeypatch.delenv("ATTNLAB_BUILD_WAIT_S", raising=False)
    assert native_build._wait_limit() == native_build.BUILD_WAIT_S == 600
    monkeypatch.setenv("ATTNLAB_BUILD_WAIT_S", "2.5")
    assert native_build._wait_limit() == 2.5


def test_prepare_builds_for_a_cpu_only(monkeypatch):
    calls = []
    monkeypatch.setattr(native, "kernels", lambda: calls.append(1))
    native.prepare("cuda", torch.device("cuda:1"))
    native.prepare()
    assert calls == []
    native.prepare(torch.device("cpu"))
    native.prepare("cuda", "cpu")
    assert calls == [1, 1]


def test_a_stale_torch_lock_file_is_removed_under_the_lock(tmp_path):
    """PyTorch's FileBaton (``lock``) left by a killed build would make every later build wait forever."""
    spec = _spec(tmp_path, "attnlab_native_test_1")
    spec.directory.mkdir(parents=True)
    (spec.directory / "lock").write_text("")
    seen = []

    def build(spec: native_spec.BuildSpec, sources: list[str]) -> None:
        seen.append((spec.directory / "lock").exists())
        native_build._library(spec).write_bytes(b"built")

    native_build._load_once(spec, build, _fake_load)
    assert seen == [False]


@pytest.mark.skipif(native_build.fcntl is None or not hasattr(os, "fork"), reason="no fcntl or fork on this platform")
def test_a_killed_builder_releases_the_lock(tmp_path):
    """A process killed (SIGKILL) while it holds the build lock leaves none behind: a waiter gets it."""
    lock = tmp_path / "attnlab-build.lock"
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # the "builder": takes the lock, says so, and waits to be killed
        try:
            with native_build._exclusive(lock):
                os.write(write_end, b"locked")
                time.sleep(120)
        finally:
            os._exit(0)
    try:
        os.close(write_end)
        assert os.read(read_end, 6) == b"locked"
        acquired = threading.Event()

        def take():
            with native_build._exclusive(lock):
                acquired.set()

        threading.Thread(target=take, daemon=True).start()
        assert not acquired.wait(0.5)  # held by the builder
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        child = 0
        assert acquired.wait(30)
    finally:
        os.close(read_end)
        if child:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)


def test_sources_are_built_from_copies_in_the_build_directory(monkeypatch, tmp_path):
    """Two checkouts of the same sources hand PyTorch the same paths (its build commands name them,
    and ninja rebuilds when a command changes); a copy is rewritten only when it differs."""
    spec = _spec(tmp_path, "attnlab_native_test_2")
    builds = []
    native_build._load_once(spec, _fake_build(builds), _fake_load)
    staged = [Path(path) for path in builds[0]]
    assert [path.parent for path in staged] == [spec.directory / "sources"] * len(native_spec.SOURCES)
    assert [path.read_bytes() for path in staged] == [source.read_bytes() for source in native_spec.SOURCES]
    for path in staged:
        os.utime(path, ns=(1, 1))
    monkeypatch.setattr(native_spec, "SOURCES", _copy_sources(tmp_path, "other_checkout"))
    assert native_spec._stage_sources(spec.directory) == builds[0]
    assert [path.stat().st_mtime_ns for path in staged] == [1] * len(staged)  # not rewritten
    edited = native_spec.SOURCES[0]
    edited.write_bytes(edited.read_bytes() + b"\n// edited\n")
    native_spec._stage_sources(spec.directory)
    assert staged[0].read_bytes() == edited.read_bytes()


_FIRST_USE = """
from attnlab.kernels import native
module = native.kernels()
assert module is not None, native.unavailable_reason()
print(native.__file__, module.__name__)
"""


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
def test_two_processes_building_at_once_build_once(tmp_path):
    """Two processes' first uses of the kernels, at once, into an empty TORCH_EXTENSIONS_DIR: the
    compiler (a wrapper that logs each run) compiles each source once, and both load the build."""
    log = tmp_path / "compiler.log"
    wrapper = tmp_path / "bin" / "g++"  # a name PyTorch's compiler check accepts
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> {log}\nexec {os.path.realpath(shutil.which("c++"))} "$@"\n')
    wrapper.chmod(0o755)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions"), "CXX": str(wrapper)}
    env.pop("ATTNLAB_NATIVE", None)
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", _FIRST_USE], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outputs = [process.communicate(timeout=900) for process in processes]
    for process, (_out, err) in zip(processes, outputs):
        assert process.returncode == 0, err[-2000:]
    names = {out.split()[-1] for out, _err in outputs}
    assert len(names) == 1 and names.pop().startswith("attnlab_native_")
    compiles = [line for line in log.read_text().splitlines() if " -c " in f" {line} "]
    for source in native_spec.SOURCES:
        assert sum(source.name in line for line in compiles) == 1, compiles
    # A first use from another checkout of the same sources, later, builds nothing.
    checkout = tmp_path / "checkout"
    shutil.copytree(
        Path(native.__file__).parents[1], checkout / "attnlab", ignore=shutil.ignore_patterns("__pycache__")
    )
    env["PYTHONPATH"] = str(checkout)
    again = subprocess.run([sys.executable, "-c", _FIRST_USE], env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stdout.split()[-2].startswith(str(checkout))  # this checkout's attnlab
    assert again.stdout.split()[-1] == outputs[0][0].split()[-1]
    assert [line for line in log.read_text().splitlines() if " -c " in f" {line} "] == compiles


_LOAD_THROUGH_THE_LINK = """
import torch
from attnlab.kernels import native
module = native.kernels()
assert module is not None, native.unavailable_reason()
print(torch.__file__)
print(module.__file__)
"""


def test_an_environment_reached_through_a_symlink_loads_the_existing_build(tmp_path):
    """The same virtual environment reached through a symlink (PyTorch's build commands then name
    other include paths, and ninja would rebuild) loads the complete build as it is: the library
    is not rewritten and nothing says it is building."""
    if not native.available():
        pytest.skip(f"no C++ kernels: {native.unavailable_reason()}")
    library = native_build._library(native_spec.build_spec())
    before = library.stat()
    link = tmp_path / "venvlink"
    link.symlink_to(sys.prefix, target_is_directory=True)
    python = link / "bin" / Path(sys.executable).name
    if not python.exists():
        pytest.skip(f"no {Path(sys.executable).name} in {sys.prefix}/bin")
    env = {**os.environ, "PYTHONPATH": str(Path(native.__file__).parents[2])}  # this attnlab; torch via the link
    env.pop("ATTNLAB_NATIVE", None)
    done = subprocess.run(
        [str(python), "-c", _LOAD_THROUGH_THE_LINK], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    torch_file, module_file = done.stdout.split()
    assert torch_file.startswith(str(link))  # the child's torch is reached through the link
    assert Path(module_file) == library
    assert "building" not in done.stderr
    after = library.stat()
    assert (after.st_ino, after.st_mtime_ns, after.st_size) == (before.st_ino, before.st_mtime_ns, before.st_size)


# A compiler that never finishes: ``-c`` (a compile) starts a child that sleeps (as g++ starts
# cc1plus) and waits for it, recording both pids; anything else (PyTorch's version checks) runs
# the real compiler.
_SLOW_COMPILER = """#!/bin/sh
case " $* " in
  *" -c "*) echo $$ >> {log}; sleep 300 & echo $! >> {log}; wait; exit 1 ;;
esac
exec {real} "$@"
"""

_FIRST_USE_OF_THE_KERNELS = "from attnlab.kernels import native; native.kernels()"


def _marked_processes(marker: str) -> list[int]:
    """Live processes (zombies aside) whose environment holds ``marker``: a process started with it
    and every descendant (the build process, ninja, the compilers) inherit it."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            environment = (entry / "environ").read_bytes()
        except OSError:  # gone, or not ours
            continue
        if state != "Z" and marker.encode() in environment.split(b"\0"):
            found.append(int(entry.name))
    return found


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or shutil.which("c++") is None, reason="Linux /proc and a C++ compiler"
)
@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
def test_killing_attnlab_during_a_build_stops_the_build_and_its_compilers(tmp_path, how):
    """A first use of the kernels builds them with a compiler that never finishes; killing that
    process (SIGTERM as ``timeout`` sends it, Ctrl-C's SIGINT, SIGKILL) leaves no process of the
    build running: not the build process, not ninja, not the compiler nor its child."""
    log = tmp_path / "compiles.log"
    compiler = tmp_path / "bin" / "g++"  # a name PyTorch's compiler check accepts
    compiler.parent.mkdir()
    compiler.write_text(_SLOW_COMPILER.format(log=log, real=os.path.realpath(shutil.which("c++"))))
    compiler.chmod(0o755)
    marker = f"ATTNLAB_TEST_BUILD={tmp_path.name}-{how.name}"
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions"), "CXX": str(compiler)}
    env["ATTNLAB_TEST_BUILD"] = marker.split("=", 1)[1]
    env.pop("ATTNLAB_NATIVE", None)
    process = subprocess.Popen(
        [sys.executable, "-c", _FIRST_USE_OF_THE_KERNELS], env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 120  # a guard against a hang, not a timing check
        while not (log.exists() and len(log.read_text().split()) >= 2):
            assert process.poll() is None, process.stderr.read()
            assert time.monotonic() < deadline, "the compiler never started"
            time.sleep(0.1)
        assert len(_marked_processes(marker)) >= 4  # attnlab, the build process, ninja, a compiler and its child
        process.send_signal(how)
        process.wait(timeout=60)
        deadline = time.monotonic() + 30
        while _marked_processes(marker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _marked_processes(marker) == []
        assert "Traceback" not in process.stderr.read() or how == signal.SIGINT  # Python's own on Ctrl-C
    finally:
        for pid in [process.pid, *_marked_processes(marker)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        process.wait()
        process.stderr.close()


def test_the_build_finds_ninja_through_its_childs_environment_not_this_process(monkeypatch, tmp_path):
    """Where ``ninja`` is not on PATH (a virtual environment not activated), the build's child gets
    the interpreter's directory first on its PATH; this process's ``os.environ`` is left as it was."""
    monkeypatch.setenv("PATH", str(tmp_path))  # no ninja there
    before = dict(os.environ)
    environment = native_build._build_environment()
    assert environment["PATH"].split(os.pathsep) == [str(Path(sys.executable).parent), str(tmp_path)]
    assert dict(os.environ) == before
    (tmp_path / "ninja").write_text("#!/bin/sh\n")
    (tmp_path / "ninja").chmod(0o755)
    assert native_build._build_environment()["PATH"] == str(tmp_path)  # found: PATH as it is
