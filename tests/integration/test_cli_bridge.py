"""The command line on a bridged model: a folder whose ``model_type`` attnlab has no family for
(OLMo, a tiny random one) runs every command that takes a model, as a native folder does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli import attnlab
from tests.unit.pretrained.tiny_any import build_any

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("olmo")
    build_any("olmo", folder)
    (folder.parent / "texts.txt").write_text("hello world, the quick brown fox\ndef f(x): return x + 1\n12 34\n")
    return folder


def _ok(*args: str) -> str:
    done = attnlab(*args, timeout=300, one_thread=True)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    return done.stdout


def test_sites_lists_the_bridged_sites(folder: Path) -> None:
    names = {row["name"] for row in json.loads(_ok("sites", str(folder), "--json"))["sites"]}
    for name in (
        "decoder.embed",
        "decoder.0.resid_pre",
        "decoder.0.attn.pattern",
        "decoder.1.attn.result",
        "decoder.1.resid_mid",
        "decoder.1.ffn.out",
        "decoder.1.resid_post",
        "decoder.final_norm",
        "logits",
    ):
        assert name in names, name
    assert not any(name.endswith("q_pre") for name in names)


def test_generate_and_importance_run(folder: Path) -> None:
    assert _ok("generate", str(folder), "hello world", "--max-new-tokens", "4").strip()
    out = folder.parent / "importance.csv"
    _ok("heads", "importance", str(folder), "--texts", str(folder.parent / "texts.txt"), "--out", str(out))
    rows = out.read_text(encoding="utf-8").splitlines()
    assert len(rows) == 1 + 2 * 4  # a header, every head of 2 layers x 4


def test_patch_attribute_and_attention_run(folder: Path, tmp_path: Path) -> None:
    patched = json.loads(
        _ok(
            "patch",
            str(folder),
            "--clean",
            "hello world, the quick",
            "--corrupt",
            "hello world, the brown",
            "--metric",
            "loss",
            "--out",
            str(tmp_path / "patching"),
            "--json",
        )
    )
    assert patched
    _ok("attention", str(folder), "hello world", "--out", str(tmp_path / "maps"))
    assert list((tmp_path / "maps").glob("*.png"))


def test_the_viewer_answers_on_a_bridged_model(folder: Path) -> None:
    from starlette.testclient import TestClient

    import attnlab
    from attnlab.viewer import create_app

    client = TestClient(create_app(attnlab.load(folder).loaded))
    info = client.get("/api/model").json()
    assert [(k["kind"], k["layers"], k["heads"]) for k in info["heads"]] == [("self", 2, 4)]
    answer = client.post("/api/run", json={"text": "hello world"})
    assert answer.status_code == 200, answer.text
    maps = answer.json()["attention"]
    assert [(m["kind"], m["layer"]) for m in maps] == [("self", 0), ("self", 1)]
