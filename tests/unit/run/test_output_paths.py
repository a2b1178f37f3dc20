"""check_output_path: every output refused before work starts, and nothing written by the check."""

from __future__ import annotations

import os

import pytest

from attnlab.errors import UsageError
from attnlab.run.output_paths import _shown, check_output_path, name_max


@pytest.fixture
def place(tmp_path):
    (tmp_path / "plain").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "config.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    return tmp_path


def _listing(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.parametrize(
    "name,kind",
    [
        ("new.csv", "file"),
        ("plain", "file"),
        ("a/b/c.csv", "file"),
        ("empty", "folder"),
        ("full", "folder"),
        ("new", "folder"),
        ("a/b", "folder"),
        ("empty", "run"),
        ("new", "run"),
        ("a/b/run", "run"),
    ],
)
def test_usable_outputs_pass_and_nothing_is_created(place, name, kind):
    before = _listing(place)
    assert check_output_path(place / name, kind=kind) == place / name
    assert _listing(place) == before


@pytest.mark.parametrize(
    "name,kind,message",
    [
        ("plain", "folder", "plain is a file; give a folder"),
        ("plain", "run", "plain is a file; give a folder for the run"),
        ("full", "file", "full is a folder; give a file name"),
        ("full", "run", "full: run directory already exists and is not empty; choose another --out"),
        ("plain/x.csv", "file", "plain is a file, not a folder"),
        ("plain/deeper/run", "run", "plain is a file, not a folder"),
    ],
)
def test_clashes_are_refused_with_the_flag_and_path(place, name, kind, message):
    with pytest.raises(UsageError, match=message) as caught:
        check_output_path(place / name, kind=kind)
    assert str(caught.value).startswith(f"--out {_shown(place / name)}")  # long paths are shortened


def test_overwrite_allows_a_full_run_directory(place):
    check_output_path(place / "full", kind="run", overwrite=True)


def test_the_flag_is_named(place):
    with pytest.raises(UsageError, match="^--save .*plain is a file"):
        check_output_path(place / "plain", kind="folder", flag="--save")


@pytest.mark.parametrize("kind", ["file", "folder", "run"])
def test_a_name_longer_than_the_file_system_allows_is_an_error(place, kind):
    longest = name_max(place)
    check_output_path(place / ("x" * longest), kind=kind)
    with pytest.raises(UsageError, match=f"is 300 bytes long, more than the file system allows \\({longest}\\)"):
        check_output_path(place / ("x" * 300), kind=kind)
    with pytest.raises(UsageError, match="more than the file system allows"):
        check_output_path(place / ("x" * 300) / "inner" / "out.csv", kind=kind)


def test_a_long_path_is_an_error(place):
    deep = place.joinpath(*["d" * 200] * 30)  # 6,000 bytes, each name allowed
    with pytest.raises(UsageError, match="the path is .* bytes long"):
        check_output_path(deep, kind="folder")


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root may write anywhere")
def test_a_folder_without_write_permission_is_refused(place):
    locked = place / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(UsageError, match="permission denied"):
            check_output_path(locked / "out.csv", kind="file")
        with pytest.raises(UsageError, match="permission denied"):
            check_output_path(locked / "new" / "run", kind="run")
        with pytest.raises(UsageError, match="permission denied"):
            check_output_path(locked, kind="folder")
    finally:
        locked.chmod(0o700)


def test_an_empty_file_name_is_refused():
    with pytest.raises(UsageError, match="--out: give a file name"):
        check_output_path("", kind="file")


def test_an_unknown_kind_is_a_programming_error(place):
    with pytest.raises(ValueError, match="kind: unknown 'disk'"):
        check_output_path(place / "x", kind="disk")  # type: ignore[arg-type]
