"""The viewer's JSON API through Starlette's test client: outputs, head switching, bad requests, escaping."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from starlette.testclient import TestClient

from attnlab.analysis.maps import attention_view
from attnlab.decoding import DecodeOptions, decode
from attnlab.experiment import open_run
from attnlab.head_ids import HeadId, mask_without
from attnlab.nn import capture
from attnlab.viewer import create_app
from attnlab.viewer.requests import MAX_INPUT_CHARS, MAX_INPUT_TOKENS, MAX_OUTPUT_TOKENS
from attnlab.viewer.serve import LOOPBACK_HOSTS
from attnlab.viewer.server import MAX_BODY_BYTES, STATIC_DIR
from tests.unit.analysis.tiny_runs import HELD, XSS, tiny_run

KINDS = ("encoder_decoder", "encoder_classifier", "decoder_only")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("viewer-api")
    return {kind: open_run(tiny_run(folder, kind)) for kind in KINDS}


@pytest.fixture(scope="module")
def clients(runs):
    return {kind: TestClient(create_app(loaded)) for kind, loaded in runs.items()}


def post_run(client: TestClient, text: str, off=()):  # noqa: ANN001, ANN201
    return client.post("/api/run", json={"text": text, "off": [dict(kind=k, layer=l, head=h) for k, l, h in off]})


def test_the_page_and_its_files_are_served_with_a_strict_policy(clients):
    client = clients["encoder_decoder"]
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert page.headers["x-content-type-options"] == "nosniff"
    for name in ("viewer.js", "viewer.css"):
        assert client.get(f"/static/{name}").status_code == 200
    assert client.get("/api/nothing").status_code == 404


def test_the_page_never_writes_text_as_html():
    script = (STATIC_DIR / "viewer.js").read_text()
    for sink in (".innerHTML", ".outerHTML", ".insertAdjacentHTML", "document.write", "eval(", "new Function", "DOMParser"):
        assert sink not in script
    assert "<script>" not in (STATIC_DIR / "index.html").read_text()  # no inline script: the policy forbids it


def test_model_lists_kinds_layers_heads_and_limits(clients):
    info = clients["encoder_decoder"].get("/api/model").json()
    assert info["model_kind"] == "encoder_decoder" and info["task"] == "reverse" and info["attention"] == "soft"
    assert [(k["kind"], k["layers"], k["heads"]) for k in info["heads"]] == [
        ("encoder_self", 2, 2), ("decoder_self", 2, 2), ("cross", 2, 2)]
    assert info["limits"] == {"max_input_chars": MAX_INPUT_CHARS, "max_input_tokens": MAX_INPUT_TOKENS,
                              "max_output_tokens": MAX_OUTPUT_TOKENS}
    assert set(info["example"]) <= set("abcdefghij") and info["importance"] is None


def test_encoder_decoder_answer_is_the_greedy_decoding_and_every_map(runs, clients):
    loaded = runs["encoder_decoder"]
    answer = post_run(clients["encoder_decoder"], "abcd").json()
    task = loaded.task
    hypothesis = decode(loaded.model, torch.tensor([loaded.codec.encode("abcd") + [task.eos_id]]), bos_id=task.bos_id,
                        eos_id=task.eos_id, pad_id=task.pad_id, options=DecodeOptions(max_length=MAX_OUTPUT_TOKENS))[0]
    assert answer["output"] == {"type": "sequence", "text": loaded.codec.decode(hypothesis.tokens)}
    assert answer["tokens"] == ["a", "b", "c", "d"]
    assert [(m["kind"], m["layer"]) for m in answer["attention"]] == [
        (kind, layer) for kind in ("encoder_self", "decoder_self", "cross") for layer in (0, 1)]
    cross = answer["attention"][-1]
    assert cross["keys"] == ["a", "b", "c", "d", "</s>"] and cross["queries"][0] == "<s>"
    weights = np.array(cross["weights"])
    assert weights.shape == (2, len(cross["queries"]), 5)
    np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-3)


def test_classifier_answer_is_the_class_with_its_probability(runs, clients):
    loaded = runs["encoder_classifier"]
    output = post_run(clients["encoder_classifier"], "(())").json()["output"]
    with torch.no_grad():
        probs = torch.softmax(loaded.model(torch.tensor([loaded.codec.encode("(())") + [loaded.task.eos_id]])), -1)[0]
    assert output["type"] == "class" and output["label"] == str(int(probs.argmax()))
    assert output["probability"] == pytest.approx(float(probs.max()), abs=1e-6)
    assert [c["probability"] for c in output["classes"]] == pytest.approx(probs.tolist(), abs=1e-6)


def test_decoder_only_answer_has_a_continuation_and_the_next_token_distribution(clients):
    output = post_run(clients["decoder_only"], "the c").json()["output"]
    assert output["type"] == "continuation" and isinstance(output["text"], str)
    probabilities = [t["probability"] for t in output["next_tokens"]]
    assert len(probabilities) == 5 and probabilities == sorted(probabilities, reverse=True) and sum(probabilities) <= 1


@pytest.mark.parametrize("kind", KINDS)
def test_switching_heads_off_gives_what_the_head_mask_gives(runs, clients, kind):
    loaded = runs[kind]
    text = {"encoder_decoder": "abcd", "encoder_classifier": "(()", "decoder_only": "the c"}[kind]
    first = loaded.model.attention_sites()[0].kind
    off = [(first, 0, 1), (first, 1, 0)]
    answer = post_run(clients[kind], text, off).json()
    expected = attention_view(loaded, text, max_length=MAX_OUTPUT_TOKENS,
                              head_mask=mask_without(loaded.model, [HeadId(*o) for o in off]))
    assert answer["off"] == [dict(kind=k, layer=l, head=h) for k, l, h in off]
    if kind == "encoder_classifier":
        assert answer["output"]["probability"] == pytest.approx(expected.probability, abs=1e-6)
    else:
        assert answer["output"]["text"] == expected.output
    later = next(m for m in answer["attention"] if m["kind"] == first and m["layer"] == 1)
    np.testing.assert_allclose(later["weights"], expected.records[1].weights[0].numpy(), atol=1e-4)
    plain = next(m for m in post_run(clients[kind], text).json()["attention"] if m["kind"] == first and m["layer"] == 1)
    assert not np.allclose(plain["weights"], later["weights"], atol=1e-4)  # layer 1 reads layer 0's masked heads


def test_heads_held_in_training_are_always_off_and_listed(tmp_path_factory):
    """train.mask_heads are off in every run (as in `attnlab eval`); `off` switches more heads off."""
    loaded = open_run(tiny_run(tmp_path_factory.mktemp("viewer-held"), "held"))
    client = TestClient(create_app(loaded))
    held = [HeadId(kind, int(layer), int(head)) for kind, layer, head in (spec.split(":") for spec in HELD)]
    listed = [dict(kind=h.kind, layer=h.layer, head=h.head) for h in held]
    assert client.get("/api/model").json()["held"] == listed
    task = loaded.task
    src = torch.tensor([loaded.codec.encode("abcd") + [task.eos_id]])
    for off in ([], [("decoder_self", 1, 0)], [("cross", 0, 0)]):  # the last one is held already
        answer = post_run(client, "abcd", off).json()
        assert answer["held"] == listed and answer["off"] == [dict(kind=k, layer=l, head=h) for k, l, h in off]
        mask = mask_without(loaded.model, [*held, *(HeadId(*o) for o in off)])
        hypothesis = decode(loaded.model, src, bos_id=task.bos_id, eos_id=task.eos_id, pad_id=task.pad_id,
                            options=DecodeOptions(max_length=MAX_OUTPUT_TOKENS), head_mask=mask)[0]
        assert answer["output"]["text"] == loaded.codec.decode(hypothesis.tokens)
        expected = attention_view(loaded, "abcd", max_length=MAX_OUTPUT_TOKENS, head_mask=mask)
        later = next(m for m in answer["attention"] if (m["kind"], m["layer"]) == ("encoder_self", 1))
        record = next(r for r in expected.records if (r.kind, r.layer) == ("encoder_self", 1))
        np.testing.assert_allclose(later["weights"], record.weights[0].numpy(), atol=1e-4)
    with torch.no_grad(), capture(loaded.model) as records:
        loaded.model.encode(src)
    unmasked = next(r for r in records if (r.kind, r.layer) == ("encoder_self", 1)).weights[0].numpy()
    assert not np.allclose(later["weights"], unmasked, atol=1e-4)  # the held encoder head did matter


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"text": 3}, '"text" must be a string'),
        ({"off": []}, '"text" must be a string'),
        ({"text": "ab", "heads": []}, "unknown field 'heads'"),
        ({"text": "ab", "off": "cross:0:0"}, '"off" must be a list'),
        ({"text": "ab", "off": [{"kind": "cross", "layer": 0}]}, 'off[0] must be an object with exactly'),
        ({"text": "ab", "off": [{"kind": "self", "layer": 0, "head": 0}]}, "off[0].kind: this model has no 'self'"),
        ({"text": "ab", "off": [{"kind": "cross", "layer": 2, "head": 0}]}, "off[0].layer: cross has layers 0 to 1"),
        ({"text": "ab", "off": [{"kind": "cross", "layer": 0, "head": -1}]}, "off[0].head: cross layer 0 has heads 0 to 1"),
        ({"text": "ab", "off": [{"kind": "cross", "layer": 0, "head": True}]}, "off[0].head"),
        ({"text": "ab", "off": [{"kind": "cross", "layer": "0", "head": 0}]}, "off[0].layer"),
        ({"text": "abz"}, "symbol 'z' is not in the task's alphabet"),
        ({"text": "a" * (MAX_INPUT_CHARS + 1)}, f"the viewer takes at most {MAX_INPUT_CHARS}"),
        ({"text": "ab" * MAX_INPUT_TOKENS}, f"the viewer shows at most {MAX_INPUT_TOKENS}"),
        (["abc"], "must be a JSON object"),
    ],
)
def test_bad_run_requests_get_400_and_a_message(clients, body, message):
    response = clients["encoder_decoder"].post("/api/run", json=body)
    assert response.status_code == 400
    assert response.headers["content-type"] == "application/json"
    assert message in response.json()["error"]


def test_a_body_that_is_not_json_or_not_sent_as_json_gets_400(clients):
    client = clients["encoder_decoder"]
    broken = client.post("/api/run", content=b'{"text": "ab"', headers={"content-type": "application/json"})
    assert broken.status_code == 400 and "not valid JSON" in broken.json()["error"]
    form = client.post("/api/run", content=b'{"text": "ab"}', headers={"content-type": "text/plain"})
    assert form.status_code == 400 and "Content-Type: application/json" in form.json()["error"]
    assert client.get("/api/run").status_code == 405


def test_a_huge_body_is_refused_before_it_is_read(clients):
    response = clients["encoder_decoder"].post("/api/run", content=b"x" * (MAX_BODY_BYTES + 1),
                                               headers={"content-type": "application/json"})
    assert response.status_code == 413


def test_markup_in_the_input_comes_back_as_plain_json_strings(clients):
    answer = post_run(clients["decoder_only"], XSS)
    assert answer.status_code == 200 and answer.headers["content-type"] == "application/json"
    assert "".join(answer.json()["tokens"]) == XSS
    assert answer.json()["attention"][0]["queries"][1:len(XSS) + 1] == list(XSS)
    refused = post_run(clients["encoder_decoder"], XSS)
    assert refused.status_code == 400 and refused.headers["content-type"] == "application/json"
    assert XSS in refused.json()["error"]  # the page shows this message as text


IMPORTANCE = "kind,layer,head,importance\nself,0,0,0.5\nself,0,1,0.25\nself,1,1,1e-3\n"


def test_importance_csv_becomes_a_kind_layer_head_table(clients):
    response = clients["encoder_classifier"].post("/api/importance", content=IMPORTANCE.encode(),
                                                  headers={"content-type": "text/csv"})
    assert response.status_code == 200
    assert response.json() == {"importance": {"self": [[0.5, 0.25], [None, 0.001]]}}


@pytest.mark.parametrize(
    ("csv", "message"),
    [
        ("kind,layer,importance\nself,0,0.5\n", "missing head"),
        ("kind,layer,head,importance\n", "no rows after the header"),
        ("kind,layer,head,importance\ncross,0,0,0.5\n", "line 2: this model has no 'cross' attention"),
        ("kind,layer,head,importance\nself,0,0,1\nself,2,0,0.5\n", "line 3: this model has no head 0 in self layer 2"),
        ("kind,layer,head,importance\nself,0,x,0.5\n", "line 2: head 'x' is not an integer"),
        ("kind,layer,head,importance\nself,0,0,big\n", "line 2: importance 'big' is not a number"),
        ("kind,layer,head,importance\nself,0,0,nan\n", "line 2: importance must be finite"),
        ("kind,layer,head,importance\nself,0,0,1\nself,0,0,2\n", "line 3: self layer 0 head 0 is listed twice"),
        ("kind,layer,head,importance\nself,0\n", "line 2: expected the 4 fields"),
    ],
)
def test_bad_importance_csv_gets_400_naming_the_line(clients, csv, message):
    response = clients["encoder_classifier"].post("/api/importance", content=csv.encode())
    assert response.status_code == 400
    assert message in response.json()["error"]


def test_importance_given_at_start_is_in_the_model_description(runs):
    table = {"self": [[0.5, 0.25], [0.125, 1.0]]}
    client = TestClient(create_app(runs["encoder_classifier"], importance=table))
    assert client.get("/api/model").json()["importance"] == table


def test_a_loopback_viewer_answers_only_loopback_host_names(runs):
    app = create_app(runs["encoder_classifier"], allowed_hosts=LOOPBACK_HOSTS)
    assert TestClient(app, base_url="http://127.0.0.1:8765").get("/api/model").status_code == 200
    assert TestClient(app, base_url="http://localhost:8765").get("/api/model").status_code == 200
    assert TestClient(app, base_url="http://[::1]:8765").get("/api/model").status_code == 200
    assert TestClient(app, base_url="http://attacker.example").get("/api/model").status_code == 400
