"""The viewer's JSON API through Starlette's test client: outputs, head switching, bad requests, escaping."""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import dataclasses
import json

import numpy as np
import pytest
import torch
from starlette.testclient import TestClient

from attnlab.analysis.maps import attention_view, kind_maps
from attnlab.cli import view as view_command
from attnlab.errors import UsageError
from attnlab.generate.search import DecodeOptions, decode
from attnlab.head_ids import HeadId, mask_without, parse_head_name
from attnlab.nn import trace
from attnlab.run.loaded import open_run
from attnlab.viewer import create_app
from attnlab.viewer.overview import pool_map
from attnlab.viewer.requests import MAX_INPUT_CHARS, MAX_INPUT_TOKENS, MAX_JSON_DEPTH, MAX_OUTPUT_TOKENS
from attnlab.viewer.serve import LOOPBACK_HOSTS, allowed_hosts
from attnlab.viewer.server import MAX_BODY_BYTES, MAX_DRAIN_BYTES, MAX_RUN_BODY_BYTES, STATIC_DIR, host_name
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
    return client.post("/api/run", json={"text": text, "off": [dict(kind=k, layer=i, head=h) for k, i, h in off]})


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
    for sink in (
        ".innerHTML",
        ".outerHTML",
        ".insertAdjacentHTML",
        "document.write",
        "eval(",
        "new Function",
        "DOMParser",
    ):
        assert sink not in script
    assert "<script>" not in (STATIC_DIR / "index.html").read_text()  # no inline script: the policy forbids it


def test_model_lists_kinds_layers_heads_and_limits(clients):
    info = clients["encoder_decoder"].get("/api/model").json()
    assert info["model_kind"] == "encoder_decoder" and info["task"] == "reverse" and info["attention"] == "soft"
    assert [(k["kind"], k["layers"], k["heads"]) for k in info["heads"]] == [
        ("encoder_self", 2, 2),
        ("decoder_self", 2, 2),
        ("cross", 2, 2),
    ]
    assert info["limits"] == {
        "max_input_chars": MAX_INPUT_CHARS,
        "max_input_tokens": MAX_INPUT_TOKENS,
        "max_output_tokens": MAX_OUTPUT_TOKENS,
        "layers_per_page": 2,  # 12 heads: every layer on one page
    }
    assert set(info["example"]) <= set("abcdefghij") and info["importance"] is None


def test_encoder_decoder_answer_is_the_greedy_decoding_and_every_map(runs, clients):
    loaded = runs["encoder_decoder"]
    answer = post_run(clients["encoder_decoder"], "abcd").json()
    task = loaded.task
    hypothesis = decode(
        loaded.model,
        torch.tensor([loaded.codec.encode("abcd") + [task.eos_id]]),
        bos_id=task.bos_id,
        eos_id=task.eos_id,
        pad_id=task.pad_id,
        options=DecodeOptions(max_length=MAX_OUTPUT_TOKENS),
    )[0]
    assert answer["output"] == {"type": "sequence", "text": loaded.codec.decode(hypothesis.tokens)}
    assert answer["tokens"] == ["a", "b", "c", "d"]
    assert [(m["kind"], m["layer"]) for m in answer["attention"]] == [
        (kind, layer) for kind in ("encoder_self", "decoder_self", "cross") for layer in (0, 1)
    ]
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
    expected = attention_view(
        loaded, text, max_length=MAX_OUTPUT_TOKENS, head_mask=mask_without(loaded.model, [HeadId(*o) for o in off])
    )
    assert answer["off"] == [dict(kind=k, layer=i, head=h) for k, i, h in off]
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
        assert answer["held"] == listed and answer["off"] == [dict(kind=k, layer=i, head=h) for k, i, h in off]
        mask = mask_without(loaded.model, [*held, *(HeadId(*o) for o in off)])
        hypothesis = decode(
            loaded.model,
            src,
            bos_id=task.bos_id,
            eos_id=task.eos_id,
            pad_id=task.pad_id,
            options=DecodeOptions(max_length=MAX_OUTPUT_TOKENS),
            head_mask=mask,
        )[0]
        assert answer["output"]["text"] == loaded.codec.decode(hypothesis.tokens)
        expected = attention_view(loaded, "abcd", max_length=MAX_OUTPUT_TOKENS, head_mask=mask)
        later = next(m for m in answer["attention"] if (m["kind"], m["layer"]) == ("encoder_self", 1))
        record = next(r for r in expected.records if (r.kind, r.layer) == ("encoder_self", 1))
        np.testing.assert_allclose(later["weights"], record.weights[0].numpy(), atol=1e-4)
    with torch.no_grad(), trace(loaded.model, "encoder.1.attn.pattern") as traced:
        loaded.model.encode(src)
    unmasked = traced.cache["encoder.1.attn.pattern"][0].numpy()
    assert not np.allclose(later["weights"], unmasked, atol=1e-4)  # the held encoder head did matter


def thumbnails(entry: dict) -> np.ndarray:
    """An overview entry's heads decoded: (heads, rows, columns) weights in [0, 1]."""
    data = [np.frombuffer(base64.b64decode(head), dtype=np.uint8) for head in entry["heads"]]
    return np.stack(data).reshape(len(data), entry["rows"], entry["columns"]) / 255


def test_the_overview_pools_every_map_of_every_kind_and_marks_the_heads_off(tmp_path_factory):
    """Every kind and layer, whatever page `layers` asks for; held heads and those switched off marked."""
    loaded = open_run(tiny_run(tmp_path_factory.mktemp("viewer-held"), "held"))
    client = TestClient(create_app(loaded))
    answer = post_run(client, "abcd", [("decoder_self", 1, 0)]).json()
    overview = answer["overview"]
    assert overview["size"] == 16
    assert [(m["kind"], m["layer"]) for m in overview["maps"]] == [
        (kind, layer) for kind in ("encoder_self", "decoder_self", "cross") for layer in (0, 1)
    ]
    off = {("cross", 0): [0], ("encoder_self", 0): [1], ("decoder_self", 1): [0]}  # HELD and the one switched off
    assert {(m["kind"], m["layer"]): m["off"] for m in overview["maps"] if m["off"]} == off
    mask = mask_without(loaded.model, [HeadId("decoder_self", 1, 0), *map(parse_head_name, HELD)])
    view = attention_view(loaded, "abcd", max_length=MAX_OUTPUT_TOKENS, head_mask=mask)
    for entry in overview["maps"]:
        queries, keys = view.axes[entry["kind"]]
        assert (entry["rows"], entry["columns"]) == (len(queries), len(keys))  # under 16 a side: the map itself
        expected = pool_map(kind_maps(view, entry["kind"])[entry["layer"]])
        np.testing.assert_allclose(thumbnails(entry), expected, atol=0.5 / 255 + 1e-6)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"text": 3}, '"text" must be a string'),
        ({"off": []}, '"text" must be a string'),
        ({"text": "ab", "heads": []}, "unknown field 'heads'"),
        ({"text": "ab", "off": "cross:0:0"}, '"off" must be a list'),
        ({"text": "ab", "off": [{"kind": "cross", "layer": 0}]}, "off[0] must be an object with exactly"),
        ({"text": "ab", "off": [{"kind": "self", "layer": 0, "head": 0}]}, "off[0].kind: this model has no 'self'"),
        ({"text": "ab", "off": [{"kind": "cross", "layer": 2, "head": 0}]}, "off[0].layer: cross has layers 0 to 1"),
        (
            {"text": "ab", "off": [{"kind": "cross", "layer": 0, "head": -1}]},
            "off[0].head: cross layer 0 has heads 0 to 1",
        ),
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


def asgi_post(  # noqa: ANN001
    app, path: str, headers: dict[str, str], body: bytes | list[bytes], *, disconnect: bool = False
) -> tuple[int | None, dict | None, int]:
    """POST straight through ASGI (headers exactly as given, no client adding any); ``body`` as one
    message or a list of messages, then the client's disconnect where ``disconnect``. Returns the
    status and the JSON answer (None where nothing was sent) and how many times the app asked for
    the body."""
    chunks = [body] if isinstance(body, bytes) else list(body)
    messages, asked = [], []

    async def receive() -> dict:
        asked.append(1)
        if len(asked) <= len(chunks):
            return {
                "type": "http.request",
                "body": chunks[len(asked) - 1],
                "more_body": len(asked) < len(chunks) or disconnect,
            }
        if disconnect:
            return {"type": "http.disconnect"}
        raise AssertionError("the app asked for more body after the last message")

    async def send(message: dict) -> None:
        messages.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8765),
    }
    # A thread of its own: Playwright's sync API (the browser tests) leaves an event loop running
    # in this worker's main thread, where asyncio.run refuses to start another.
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        pool.submit(asyncio.run, app(scope, receive, send)).result()
    status = next((m["status"] for m in messages if m["type"] == "http.response.start"), None)
    answer = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body")
    return status, json.loads(answer) if answer else None, len(asked)


JSON = {"content-type": "application/json"}
OVER = str(MAX_RUN_BODY_BYTES + 1)
THREE_CHUNKS = [b'{"text": ', b'"ab"', b"}"]


@pytest.mark.parametrize(
    ("headers", "status", "field", "message", "asked"),
    [
        # over the cap: read to the end and thrown away, then 413 (a client still sending reads it)
        ({**JSON, "content-length": OVER}, 413, "body", f"takes at most {MAX_RUN_BODY_BYTES}", 3),
        # over the cap, but the client waits for 100 Continue: answered unread
        ({**JSON, "content-length": OVER, "expect": "100-continue"}, 413, "body", "takes at most", 0),
        # announced larger than the viewer ever reads: answered unread
        ({**JSON, "content-length": str(MAX_DRAIN_BYTES + 1)}, 413, "body", "takes at most", 0),
        ({**JSON, "content-length": "99999999999999999999"}, 413, "body", f"takes at most {MAX_RUN_BODY_BYTES}", 0),
        ({**JSON, "content-length": "12abc"}, 400, "Content-Length", "is not a number of bytes", 0),
        ({**JSON, "content-length": "-1"}, 400, "Content-Length", "is not a number of bytes", 0),
        ({**JSON, "content-length": "9" * 100}, 400, "Content-Length", "is not a number of bytes", 0),
        ({**JSON, "transfer-encoding": "chunked"}, 400, "Content-Length", "with a Content-Length header", 3),
    ],
)
def test_a_body_without_an_acceptable_content_length_is_refused_and_thrown_away(
    runs, headers, status, field, message, asked
):
    answered, answer, reads = asgi_post(create_app(runs["encoder_decoder"]), "/api/run", headers, THREE_CHUNKS)
    assert (answered, answer["field"], reads) == (status, field, asked)
    assert message in answer["error"]


def test_a_body_longer_than_its_content_length_says_is_refused_at_the_cap(runs):
    status, answer, _ = asgi_post(
        create_app(runs["encoder_decoder"]),
        "/api/run",
        {**JSON, "content-length": "10"},
        b"[" * (MAX_RUN_BODY_BYTES + 1),
    )
    assert status == 413 and answer["field"] == "body" and f"larger than {MAX_RUN_BODY_BYTES}" in answer["error"]


def test_a_ten_megabyte_body_gets_413_and_a_json_error_on_both_routes(clients):
    client = clients["encoder_decoder"]
    body = b"x" * 10_000_000
    run = client.post("/api/run", content=body, headers=JSON)
    csv = client.post("/api/importance", content=body)
    assert [run.status_code, csv.status_code] == [413, 413]
    assert run.json() == {
        "error": f"the request body is 10000000 bytes; the viewer takes at most {MAX_RUN_BODY_BYTES}",
        "field": "body",
    }
    assert csv.json() == {
        "error": f"the request body is 10000000 bytes; the viewer takes at most {MAX_BODY_BYTES}",
        "field": "body",
    }


@pytest.mark.parametrize(("path", "length"), [("/api/run", "100"), ("/api/importance", "100"), ("/api/run", OVER)])
def test_a_client_that_disconnects_mid_body_gets_no_answer_and_raises_nothing(runs, path, length):
    """A POST announcing more bytes than it sends before it disconnects: the app returns normally
    (an exception would reach the server, which prints its traceback); what it sends is dropped."""
    status, _, asked = asgi_post(
        create_app(runs["encoder_decoder"]), path, {**JSON, "content-length": length}, [b"{}"], disconnect=True
    )
    assert asked == 2 and status in (None, 400)


def _deep(depth: int) -> bytes:
    return b'{"text": "ab", "off": ' + b"[" * depth + b"]" * depth + b"}"


MALFORMED = [  # (body, field, part of the message)
    (b'{"text": "ab"', "body", "not valid JSON"),
    (b"", "body", "not valid JSON"),
    (b"\xef\xbb\xbf{}", "body", "not valid JSON"),  # a UTF-8 byte order mark
    (b'{"text": "ab", "off": [01]}', "body", "not valid JSON"),
    (b'{"text": "ab", "off": [{"kind": "cross", "layer": ' + b"9" * 5000 + b', "head": 0}]}', "body", "not valid JSON"),
    (b'{"text": "\xff\xfe"}', "body", "not UTF-8 text (byte 10)"),
    (b"\xff" * 64, "body", "not UTF-8 text"),
    (b"[" * 100_000, "body", f"more than {MAX_JSON_DEPTH} levels deep"),  # issue 23: it was a 500
    (b"[" * 200_000, "body", f"the viewer takes at most {MAX_RUN_BODY_BYTES}"),
    (b"[" * 60_000, "body", f"more than {MAX_JSON_DEPTH} levels deep"),
    (b"[" * 30_000 + b"]" * 30_000, "body", f"more than {MAX_JSON_DEPTH} levels deep"),
    (b"{" * 60_000, "body", f"more than {MAX_JSON_DEPTH} levels deep"),
    (b'{"a": ' * 5_000 + b"1" + b"}" * 5_000, "body", f"more than {MAX_JSON_DEPTH} levels deep"),
    (_deep(MAX_JSON_DEPTH), "body", f"more than {MAX_JSON_DEPTH} levels deep"),
    (_deep(MAX_JSON_DEPTH - 1), "off[0]", "must be an object with exactly"),
    (b'{"text": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["}', "text", "symbol '[' is not in the task's alphabet"),
    (b"null", "body", "must be a JSON object"),
    (b"3", "body", "must be a JSON object"),
    (b'"abcd"', "body", "must be a JSON object"),
    (b'{"text": NaN}', "text", '"text" must be a string'),
    (b'{"text": null}', "text", '"text" must be a string'),
    (b'{"text": ["a", "b"]}', "text", '"text" must be a string'),
    (b'{"text": {"a": 1}}', "text", '"text" must be a string'),
    (b'{"text": ""}', "text", '"text" is empty'),
    (b'{"text": "   "}', "text", '"text" has no tokens'),
    (b'{"text": "ab\\ud800"}', "text", "character 2 is a lone surrogate"),
    (b'{"text": "ab", "extra": 1}', "extra", "unknown field 'extra'; allowed: text, off"),
    (b'{"text": "ab", "\\ud800": 1}', "\ud800", "unknown field '\\ud800'"),
    (b'{"text": "ab", "off": null}', "off", '"off" must be a list'),
    (b'{"text": "ab", "off": {"kind": "cross"}}', "off", '"off" must be a list'),
    (b'{"text": "ab", "off": [1]}', "off[0]", "off[0] must be an object with exactly"),
    (b'{"text": "ab", "off": [null]}', "off[0]", "off[0] must be an object with exactly"),
    (b'{"text": "ab", "off": [{"kind": "cross", "layer": 0, "head": 0, "x": 1}]}', "off[0]", "with exactly"),
    (b'{"text": "ab", "off": [{"kind": 1, "layer": 0, "head": 0}]}', "off[0].kind", "this model has no 1 attention"),
    (b'{"text": "ab", "off": [{"kind": ["cross"], "layer": 0, "head": 0}]}', "off[0].kind", "no ['cross'] attention"),
    (b'{"text": "ab", "off": [{"kind": "cross", "layer": 0.0, "head": 0}]}', "off[0].layer", "got 0.0"),
    (b'{"text": "ab", "off": [{"kind": "cross", "layer": null, "head": 0}]}', "off[0].layer", "got None"),
    (b'{"text": "ab", "off": [{"kind": "cross", "layer": 0, "head": 1e999}]}', "off[0].head", "got inf"),
    (b'{"text": "ab", "off": [{"kind": "cross", "layer": 0, "head": false}]}', "off[0].head", "got False"),
    (b'{"text": "ab", "off": [{"kind": "cross", "layer": 0, "head": "' + b"9" * 200 + b'"}]}', "off[0].head", "..."),
]


@pytest.mark.parametrize(("body", "field", "message"), MALFORMED, ids=[f"malformed-{i}" for i in range(len(MALFORMED))])
def test_every_malformed_run_body_gets_400_naming_the_field_and_the_viewer_goes_on(clients, body, field, message):
    """400, or 413 for the body over the cap."""
    client = clients["encoder_decoder"]
    response = client.post("/api/run", content=body, headers=JSON)
    assert response.status_code == (413 if len(body) > MAX_RUN_BODY_BYTES else 400), response.text
    assert response.headers["content-type"] == "application/json"
    assert response.json()["field"] == field
    assert message in response.json()["error"] and len(response.json()["error"]) < 400
    assert post_run(client, "abcd").status_code == 200


def test_the_model_context_bounds_the_input_and_the_output(runs, monkeypatch):
    """A model of 8 positions: BOS, the prompt and the continuation must fit (decoder-only)."""
    loaded = runs["decoder_only"]
    monkeypatch.setattr(loaded.model, "config", dataclasses.replace(loaded.model.config, max_len=8))
    client = TestClient(create_app(loaded))
    answer = post_run(client, "the c")
    assert answer.status_code == 200
    assert len(answer.json()["attention"][0]["queries"]) <= 8  # <s>, 5 input tokens, at most 2 generated
    refused = post_run(client, "the cat")
    assert refused.status_code == 400 and refused.json()["field"] == "text"
    assert refused.json()["error"] == (
        "the input is 7 tokens long; this model reads at most 8 positions, so it takes at most 6 input tokens"
    )


def test_markup_in_the_input_comes_back_as_plain_json_strings(clients):
    answer = post_run(clients["decoder_only"], XSS)
    assert answer.status_code == 200 and answer.headers["content-type"] == "application/json"
    assert "".join(answer.json()["tokens"]) == XSS
    assert answer.json()["attention"][0]["queries"][1 : len(XSS) + 1] == list(XSS)
    refused = post_run(clients["encoder_decoder"], XSS)
    assert refused.status_code == 400 and refused.headers["content-type"] == "application/json"
    assert XSS in refused.json()["error"]  # the page shows this message as text


IMPORTANCE = "kind,layer,head,importance\nself,0,0,0.5\nself,0,1,0.25\nself,1,1,1e-3\n"


def test_importance_csv_becomes_a_kind_layer_head_table(clients):
    response = clients["encoder_classifier"].post(
        "/api/importance", content=IMPORTANCE.encode(), headers={"content-type": "text/csv"}
    )
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
        ("kind,layer,head,importance\n" + "a" * 200_000, "line 2: not CSV: field larger than field limit"),
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
    app = create_app(runs["encoder_classifier"], allowed_hosts=allowed_hosts("127.0.0.1", []))
    assert TestClient(app, base_url="http://127.0.0.1:8765").get("/api/model").status_code == 200
    assert TestClient(app, base_url="http://localhost:8765").get("/api/model").status_code == 200
    assert TestClient(app, base_url="http://[::1]:8765").get("/api/model").status_code == 200
    refused = TestClient(app, base_url="http://attacker.example").get("/api/model")
    assert refused.status_code == 400 and refused.json()["field"] == "Host"


def test_a_viewer_on_all_interfaces_answers_only_the_names_allowed_and_loopback(runs):
    app = create_app(
        runs["encoder_classifier"], allowed_hosts=allowed_hosts("0.0.0.0", ["Viewer.Example", "[fe80::1]"])
    )
    for base in (
        "http://viewer.example:8765",
        "http://VIEWER.example",
        "http://[fe80::1]:8765",
        "http://localhost:8765",
        "http://127.0.0.1",
        "http://[::1]:8765",
    ):
        assert TestClient(app, base_url=base).get("/api/model").status_code == 200, base
    for base in ("http://attacker.example:8765", "http://viewer.example.attacker.example", "http://10.0.0.1:8765"):
        assert TestClient(app, base_url=base).get("/api/model").status_code == 400, base
        assert TestClient(app, base_url=base).post("/api/run", json={"text": "(())"}).status_code == 400, base
    assert TestClient(app, base_url="http://viewer.example").post("/api/run", json={"text": "(())"}).status_code == 200
    for host in ("evil@viewer.example", "viewer.example:80x", "[::1", "", "viewer.example, attacker.example"):
        status, answer, asked = asgi_post(app, "/api/run", {**JSON, "host": host, "content-length": "2"}, b"{}")
        assert (status, answer["field"], asked) == (400, "Host", 0), host


def test_host_names_are_parsed_strictly():
    assert [host_name(h) for h in ("localhost", "LOCALHOST:80", "[::1]:8765", "127.0.0.1:", "my-host.local:8765")] == [
        "localhost",
        "localhost",
        "::1",
        "127.0.0.1",
        "my-host.local",
    ]
    assert [host_name(h) for h in ("evil@localhost", "[::1", "a:b:c", "", "[::1]x", "localhost:8x", "a/b")] == [
        None
    ] * 7


def test_allowed_hosts_need_names_for_a_non_loopback_address_and_check_them():
    assert (
        allowed_hosts("127.0.0.1", []) == allowed_hosts("::1", []) == allowed_hosts("localhost", []) == LOOPBACK_HOSTS
    )
    assert allowed_hosts("0.0.0.0", ["Box.LAN", "[FE80::0:1]", "192.168.1.20"]) == (
        *LOOPBACK_HOSTS,
        "box.lan",
        "fe80::1",
        "192.168.1.20",
    )
    for host in ("0.0.0.0", "::", "192.168.1.20"):
        with pytest.raises(UsageError, match=f"host {host} is not a loopback address: .* allowed host NAME"):
            allowed_hosts(host, [])
    for name in ("*", "box.lan:8765", "http://box.lan", "", "box lan", "*.lan", "box..lan", "-box"):
        with pytest.raises(UsageError, match="not a host name or IP address"):
            allowed_hosts("0.0.0.0", [name])


def test_an_unexpected_exception_is_a_500_with_one_line_not_a_traceback(runs, monkeypatch, capsys):
    """A bug (here: the model run raising) is answered 500 with a JSON error and one ``error:`` line
    on stderr, with the internal_error ``attnlab view`` gives (the CLI's last resort); with
    ATTNLAB_TRACEBACK=1, or without internal_error, the exception reaches the server."""

    def broken(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError("a bug\nin two lines")

    monkeypatch.setattr("attnlab.viewer.server.run_payload", broken)
    monkeypatch.delenv("ATTNLAB_TRACEBACK", raising=False)
    app = create_app(runs["encoder_decoder"], internal_error=view_command._internal_error)
    answer = TestClient(app).post("/api/run", json={"text": "ab"})
    message = "internal error: RuntimeError: a bug in two lines (set ATTNLAB_TRACEBACK=1 to see the traceback)"
    assert (answer.status_code, answer.json()) == (500, {"error": message})
    assert answer.headers["x-frame-options"] == "DENY"
    assert capsys.readouterr().err == f"error: POST /api/run: {message}\n"
    assert TestClient(app).get("/api/model").status_code == 200  # and it goes on serving
    with pytest.raises(RuntimeError, match="a bug"):
        TestClient(create_app(runs["encoder_decoder"])).post("/api/run", json={"text": "ab"})
    monkeypatch.setenv("ATTNLAB_TRACEBACK", "1")
    with pytest.raises(RuntimeError, match="a bug"):
        TestClient(app).post("/api/run", json={"text": "ab"})


def test_a_model_whose_maps_are_not_finite_gets_400_naming_the_layer(tmp_path_factory):
    """NaN attention weights (a model that overflowed) are refused with the kind and layer, not
    sent as JSON the page cannot read, nor drawn as zeros."""
    loaded = open_run(tiny_run(tmp_path_factory.mktemp("viewer-nan"), "encoder_classifier"))
    embedding = next(p for name, p in loaded.model.named_parameters() if "emb" in name)
    with torch.no_grad():
        embedding.fill_(float("nan"))
    answer = post_run(TestClient(create_app(loaded)), "(()")
    assert answer.status_code == 400
    assert answer.json()["error"] == "self layer 0: the attention weights hold NaN or infinity"
