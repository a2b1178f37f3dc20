"""Manifests: records of size and SHA-256, written atomically, checked against bytes read once."""

from __future__ import annotations

import hashlib
import json

import pytest

from attnlab.errors import CheckpointError
from attnlab.run.manifest import (
    FileRecord,
    Manifest,
    build_manifest,
    check_bytes,
    parse_manifest,
    read_manifest,
    record_of,
    write_manifest,
)
from attnlab.run.storage import parse_json, read_bytes


def test_record_is_size_and_sha256_of_the_bytes():
    data = b"attention is all you need"
    assert record_of(data) == FileRecord(len(data), hashlib.sha256(data).hexdigest())


def test_round_trip_through_the_file(tmp_path):
    manifest = build_manifest({"config.json": b"{}", "model.safetensors": b"\x00" * 100})
    path = write_manifest(tmp_path, manifest)
    on_disk = json.loads(path.read_text())
    assert on_disk["format"] == 1 and set(on_disk["files"]) == {"config.json", "model.safetensors"}
    assert on_disk["files"]["config.json"] == {"size": 2, "sha256": hashlib.sha256(b"{}").hexdigest()}
    assert read_manifest(tmp_path) == manifest
    assert not list(tmp_path.glob(".*.tmp"))  # written through a temporary file, renamed into place


def test_no_manifest_is_none(tmp_path):
    assert read_manifest(tmp_path) is None


def test_check_bytes_names_the_file_and_what_differs(tmp_path):
    manifest = build_manifest({"a.bin": b"abcd"})
    check_bytes(manifest, "a.bin", b"abcd", path=tmp_path / "a.bin")
    with pytest.raises(CheckpointError, match=r"a\.bin is damaged: size 3 bytes, expected 4"):
        check_bytes(manifest, "a.bin", b"abc", path=tmp_path / "a.bin")
    with pytest.raises(CheckpointError, match=r"a\.bin is damaged: sha256 differs"):
        check_bytes(manifest, "a.bin", b"abce", path=tmp_path / "a.bin")
    with pytest.raises(CheckpointError, match=r"b\.bin .*not listed"):
        check_bytes(manifest, "b.bin", b"abcd", path=tmp_path / "b.bin")


def test_every_single_byte_flip_of_a_manifest_is_an_error_naming_it(tmp_path):
    text = Manifest({"config.json": record_of(b"{}")}).to_text().encode()
    for offset in range(len(text)):
        damaged = bytearray(text)
        damaged[offset] ^= 0x01
        with pytest.raises(CheckpointError, match="manifest"):
            parse_manifest(bytes(damaged), path=tmp_path / "manifest.json")


@pytest.mark.parametrize(
    "obj",
    [
        [],
        {"format": 2, "files": {}},
        {"format": 1, "files": []},
        {"format": 1, "files": {"a": {"size": -1, "sha256": "0" * 64}}},
        {"format": 1, "files": {"a": {"size": 1, "sha256": "X" * 64}}},
        {"format": 1, "files": {"a": {"size": 1}}},
    ],
)
def test_malformed_manifests_are_errors(tmp_path, obj):
    if isinstance(obj, dict) and isinstance(obj.get("files"), dict):  # a correct checksum: the records are at fault
        obj["checksum"] = _checksum(obj["files"])
    with pytest.raises(CheckpointError, match="manifest"):
        parse_manifest(json.dumps(obj).encode(), path=tmp_path / "manifest.json")


def _checksum(files) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def test_read_bytes_names_a_folder_a_missing_file(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(CheckpointError, match=r"d is not a regular file \(a folder"):
        read_bytes(tmp_path / "d", what="weights")
    with pytest.raises(CheckpointError, match="weights not found"):
        read_bytes(tmp_path / "missing", what="weights")


@pytest.mark.parametrize(
    "data, reason",
    [
        (b"[" * 100_000, "nested too deeply"),
        (b"\xff{}", "not UTF-8"),
        (b'{"a": ', "line 1"),
    ],
)
def test_parse_json_errors_name_the_file(tmp_path, data, reason):
    with pytest.raises(CheckpointError, match=reason) as caught:
        parse_json(data, path=tmp_path / "config.json", what="run config")
    assert str(tmp_path / "config.json") in str(caught.value)
