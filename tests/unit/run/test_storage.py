"""Output paths: a folder where a file belongs, a file where a folder belongs, or a failed write
is a UsageError naming the path; the old file stays and no temporary file is left behind."""

from __future__ import annotations

import errno

import pytest
import torch

from attnlab.embeddings import WordVectors, save_vectors, train_word2vec
from attnlab.errors import DataError, ResourceError, UsageError
from attnlab.figures import plt, save_figure
from attnlab.run.storage import atomic_write, atomic_write_text, ensure_folder


def test_ensure_folder_creates_nested_folders_and_keeps_existing_ones(tmp_path):
    folder = ensure_folder(tmp_path / "a" / "b")
    assert folder.is_dir()
    assert ensure_folder(folder) == folder  # already there: fine


@pytest.mark.parametrize("inside", [(), ("sub",), ("sub", "deeper")])
def test_ensure_folder_names_the_file_in_the_way(tmp_path, inside):
    blocker = tmp_path / "plain"
    blocker.write_text("x")
    target = blocker.joinpath(*inside)
    with pytest.raises(UsageError, match=f"{target}: cannot create the folder: {blocker} is a file"):
        ensure_folder(target)


def test_atomic_write_into_a_folder_is_refused(tmp_path):
    with pytest.raises(UsageError, match=f"{tmp_path}: is a folder; give the name of a file"):
        atomic_write_text(tmp_path, "text")
    assert list(tmp_path.iterdir()) == []


def test_atomic_write_below_a_file_names_the_file(tmp_path):
    (tmp_path / "plain").write_text("x")
    with pytest.raises(UsageError, match="plain is a file"):
        atomic_write_text(tmp_path / "plain" / "out.csv", "text")


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "f.txt"
    atomic_write_text(path, "old")

    def disk_full(handle):
        handle.write("partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(ResourceError, match=f"{path}: cannot write: No space left on device \\(ENOSPC\\)"):
        atomic_write(path, disk_full)
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]


def test_text_is_written_as_utf8_whatever_the_locale(tmp_path, monkeypatch):
    monkeypatch.setenv("LC_ALL", "C")
    monkeypatch.setenv("PYTHONIOENCODING", "ascii")
    atomic_write_text(tmp_path / "t.txt", "ξ_h attends to é")
    assert (tmp_path / "t.txt").read_bytes() == "ξ_h attends to é".encode()


def _save_vectors(path):
    save_vectors(WordVectors({"a": 0}, torch.zeros(1, 2)), path)


def _save_figure(path):
    save_figure(plt.figure(), path)


@pytest.mark.parametrize("save", [_save_vectors, _save_figure])
def test_every_writer_names_a_bad_output_path(tmp_path, save):
    (tmp_path / "plain").write_text("x")
    with pytest.raises(UsageError, match="plain is a file"):
        save(tmp_path / "plain" / "out")
    with pytest.raises(UsageError, match="is a folder"):
        save(tmp_path)
    save(tmp_path / "new" / "out")
    assert (tmp_path / "new" / "out").is_file()
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == ["out"]  # no temporary left


def test_word2vec_says_how_often_the_most_frequent_word_occurs():
    with pytest.raises(DataError, match="no word occurs at least min_count=5 times \\(the most frequent occurs 2\\)"):
        train_word2vec([["a", "b"], ["a", "c"]], 4, min_count=5)


def test_safetensors_files_are_the_same_bytes_whatever_order_the_metadata_was_written_in(tmp_path):
    """safetensors writes its metadata map in a hash order that changes between processes; attnlab
    sorts it, so equal weights give equal files (and SHA-256), in memory and streamed to disk."""
    from attnlab.run.storage import load_tensors, stream_tensors, tensors_to_bytes

    tensors = {"b": torch.arange(6.0).reshape(2, 3), "a": torch.ones(4, dtype=torch.float64)}
    forward = {"format": "pt", "attnlab.aliases": "{}", "z": "1"}
    backward = dict(reversed(list(forward.items())))
    assert tensors_to_bytes(tensors, forward) == tensors_to_bytes(tensors, backward)
    stream_tensors(tmp_path / "one.safetensors", tensors, forward)
    stream_tensors(tmp_path / "two.safetensors", tensors, backward)
    written = (tmp_path / "one.safetensors").read_bytes()
    assert written == (tmp_path / "two.safetensors").read_bytes() == tensors_to_bytes(tensors, forward)
    loaded, metadata = load_tensors(tmp_path / "one.safetensors")
    assert metadata == forward and all(torch.equal(loaded[k], tensors[k]) for k in tensors)
