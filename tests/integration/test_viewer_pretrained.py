"""The viewer's API on a pretrained language model (``pretrained_lm``): a tiny random Llama-style run
of 12 layers x 6 query heads (72 heads, so shown in pages of layers, as SmolLM2's 270 are), its
context of 512 tokens, no BOS, and a pad id that is a frequent real token."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch
from starlette.testclient import TestClient

from attnlab.analysis.maps import attention_view, kind_maps
from attnlab.analysis.pruning import prune_model, write_pruned_run
from attnlab.head_ids import HeadId, mask_without
from attnlab.run.loaded import open_run
from attnlab.viewer import create_app
from attnlab.viewer.overview import THUMBNAIL, pool_map
from attnlab.viewer.requests import HEADS_PER_PAGE, MAX_OUTPUT_TOKENS, MAX_PRETRAINED_INPUT_CHARS
from tests.unit.analysis.tiny_lm import tiny_lm_run

LAYERS, HEADS, CONTEXT = 12, 6, 512
TEXT = "the cat sat on the mat"
LONG = ("colourless green ideas sleep furiously. " * 8)[:300]  # 300 bytes: 300 tokens


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    run, _ = tiny_lm_run(tmp_path_factory.mktemp("viewer-lm"), layers=LAYERS, context=CONTEXT)
    return open_run(run)


@pytest.fixture(scope="module")
def client(loaded):
    return TestClient(create_app(loaded))


def post(client: TestClient, text: str, **fields):  # noqa: ANN003, ANN201
    return client.post("/api/run", json={"text": text, **fields})


def test_model_info_has_every_layer_and_pages_of_layers(client):
    info = client.get("/api/model").json()
    assert info["model_kind"] == "decoder_only" and info["task"] == "pretrained_lm"
    assert [(k["kind"], k["layers"], k["heads"]) for k in info["heads"]] == [("self", LAYERS, HEADS)]
    assert info["limits"] == {
        "max_input_chars": MAX_PRETRAINED_INPUT_CHARS,
        "max_input_tokens": CONTEXT,
        "max_output_tokens": MAX_OUTPUT_TOKENS,
        "layers_per_page": HEADS_PER_PAGE // HEADS,
    }


def test_an_answer_holds_one_page_of_layers_and_the_layers_asked_for(loaded, client):
    first = post(client, TEXT).json()
    assert [(m["kind"], m["layer"]) for m in first["attention"]] == [("self", 0), ("self", 1)]
    asked = post(client, TEXT, layers=[9, 4]).json()
    assert [m["layer"] for m in asked["attention"]] == [4, 9]
    maps = kind_maps(attention_view(loaded, TEXT, max_length=MAX_OUTPUT_TOKENS), "self")
    for entry in asked["attention"]:
        assert np.asarray(entry["weights"]).shape == (HEADS, len(entry["queries"]), len(entry["keys"]))
        np.testing.assert_allclose(entry["weights"], maps[entry["layer"]], atol=1e-4)


def test_the_tokens_are_the_texts_own_and_the_next_token_is_the_models(loaded, client):
    answer = post(client, TEXT).json()
    ids = loaded.task.tokenizer.encode(TEXT)
    assert answer["tokens"] == loaded.codec.tokens(ids)  # no BOS: the model has none
    assert answer["attention"][0]["queries"][: len(ids)] == answer["tokens"]
    with torch.no_grad():
        full = torch.tensor([ids])
        expected = torch.softmax(loaded.model(full, is_token=torch.ones_like(full, dtype=torch.bool))[0, -1], -1)
    values, indices = expected.topk(5)
    got = answer["output"]["next_tokens"]
    assert [item["token"] for item in got] == loaded.codec.tokens(indices.tolist())
    assert [item["probability"] for item in got] == pytest.approx(values.tolist(), abs=1e-6)


def test_an_input_of_300_tokens_is_accepted(client):
    answer = post(client, LONG, layers=[LAYERS - 1])
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert len(body["tokens"]) == 300
    assert len(body["attention"][0]["keys"]) <= 300 + MAX_OUTPUT_TOKENS


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a" * (CONTEXT + 1), f"the viewer shows at most {CONTEXT}"),
        ("a" * (MAX_PRETRAINED_INPUT_CHARS + 1), f"the viewer takes at most {MAX_PRETRAINED_INPUT_CHARS}"),
    ],
)
def test_longer_inputs_are_refused(client, text, message):
    answer = post(client, text)
    assert answer.status_code == 400 and answer.json()["field"] == "text"
    assert message in answer.json()["error"]


@pytest.mark.parametrize(
    ("layers", "message"),
    [
        ([0, 1, 2], "ask for at most 2 layers"),
        ([LAYERS], f"the model has layers 0 to {LAYERS - 1}"),
        ([-1], "the model has layers"),
        (["0"], "the model has layers"),
        ([True], "the model has layers"),
        ([], "non-empty list"),
        (3, "non-empty list"),
        ([2, 2], "names a layer twice"),
    ],
)
def test_bad_layers_get_400_naming_the_field(client, layers, message):
    answer = post(client, TEXT, layers=layers)
    assert answer.status_code == 400 and answer.json()["field"] == "layers"
    assert message in answer.json()["error"]


def test_switching_a_head_off_changes_later_layers_and_the_output_as_the_head_mask_does(loaded, client):
    plain = post(client, TEXT, layers=[0, 1]).json()
    off = post(client, TEXT, layers=[0, 1], off=[{"kind": "self", "layer": 0, "head": 3}]).json()
    assert off["off"] == [{"kind": "self", "layer": 0, "head": 3}]
    assert plain["output"]["next_tokens"] != off["output"]["next_tokens"]
    mask = mask_without(loaded.model, [HeadId("self", 0, 3)])
    masked = attention_view(loaded, TEXT, head_mask=mask, max_length=MAX_OUTPUT_TOKENS)
    probabilities = [p for _, p in masked.distribution]
    assert [item["probability"] for item in off["output"]["next_tokens"]] == pytest.approx(probabilities, abs=1e-6)
    np.testing.assert_allclose(off["attention"][1]["weights"], kind_maps(masked, "self")[1], atol=1e-4)


def thumbnails(entry: dict) -> np.ndarray:
    """An overview entry's heads decoded: (heads, rows, columns) weights in [0, 1]."""
    data = [np.frombuffer(base64.b64decode(head), dtype=np.uint8) for head in entry["heads"]]
    return np.stack(data).reshape(len(data), entry["rows"], entry["columns"]) / 255


def test_the_overview_pools_every_query_heads_map_in_a_size_that_does_not_grow_with_the_input(loaded, client):
    """Grouped-query attention (6 query heads on 2 key/value heads): a thumbnail per query head, of
    every layer, whatever page the answer holds; 300 tokens cost no more than 22."""
    long = post(client, LONG, layers=[LAYERS - 1]).json()
    maps = kind_maps(attention_view(loaded, LONG, max_length=MAX_OUTPUT_TOKENS), "self")
    assert [(m["layer"], len(m["heads"]), m["rows"], m["columns"]) for m in long["overview"]["maps"]] == [
        (layer, HEADS, THUMBNAIL, THUMBNAIL) for layer in range(LAYERS)
    ]
    for entry in long["overview"]["maps"]:
        assert entry["off"] == []
        np.testing.assert_allclose(thumbnails(entry), pool_map(maps[entry["layer"]]), atol=0.5 / 255 + 1e-6)
    short = post(client, TEXT).json()
    assert len(json.dumps(short["overview"])) == len(json.dumps(long["overview"])) < LAYERS * HEADS * 400


def test_a_pruned_model_has_an_overview_row_of_each_layers_own_heads(loaded, tmp_path):
    pruned = [HeadId("self", 0, head) for head in (0, 1, 2, 4)] + [HeadId("self", 3, 5)]
    write_pruned_run(loaded, prune_model(loaded.model, pruned), tmp_path / "pruned", pruned=pruned)
    small = open_run(tmp_path / "pruned")
    client = TestClient(create_app(small))
    per_layer = client.get("/api/model").json()["heads"][0]["heads_per_layer"]
    assert per_layer == [2, 6, 6, 5] + [6] * (LAYERS - 4)
    answer = post(client, TEXT, off=[{"kind": "self", "layer": 3, "head": 4}]).json()
    assert [len(m["heads"]) for m in answer["overview"]["maps"]] == per_layer
    assert [(m["layer"], m["off"]) for m in answer["overview"]["maps"] if m["off"]] == [(3, [4])]
    view = attention_view(
        small, TEXT, head_mask=mask_without(small.model, [HeadId("self", 3, 4)]), max_length=MAX_OUTPUT_TOKENS
    )
    for entry, weights in zip(answer["overview"]["maps"], kind_maps(view, "self"), strict=True):
        np.testing.assert_allclose(thumbnails(entry), pool_map(weights), atol=0.5 / 255 + 1e-6)
