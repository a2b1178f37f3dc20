"""attnlab.show / show_records: the viewer's views as one self-contained HTML fragment for Jupyter."""

from __future__ import annotations

import base64
import dataclasses
import json
import re

import numpy as np
import pytest
import torch

import attnlab
from attnlab.analysis.maps import traced_maps
from attnlab.errors import UsageError
from attnlab.head_ids import HeadId
from attnlab.run.loaded import open_run
from attnlab.viewer import notebook
from attnlab.viewer.notebook import STATIC_DIR, AttentionHTML, json_for_html, show, show_records
from attnlab.viewer.overview import pool_map
from attnlab.viewer.payload import run_payload
from attnlab.viewer.requests import RunRequest
from tests.unit.analysis.tiny_lm import tiny_lm_run
from tests.unit.analysis.tiny_runs import XSS, tiny_run

BREAKOUT = "</script><img src=x onerror=alert(1)>"
"""A token that would end the data element and run a script if it were ever written raw."""


def data_of(html: str) -> dict:
    """The JSON payload embedded in a view's HTML, parsed back as the page's script parses it."""
    found = re.findall(r'<script type="application/json" class="attnlab-nb-data">(.*?)</script>', html, re.S)
    assert len(found) == 1
    return json.loads(found[0])


def tiny_model(layers: int = 2, heads: int = 2) -> attnlab.DecoderOnly:
    config = attnlab.DecoderOnlyConfig(vocab_size=20, layers=layers, d_model=8 * heads, heads=heads, d_ff=16)
    return attnlab.DecoderOnly(config).eval()


def captured(model: attnlab.DecoderOnly, tokens: torch.Tensor, head_mask=None):  # noqa: ANN001, ANN201
    with torch.no_grad(), attnlab.trace(model, "*.pattern") as traced, attnlab.masking_heads(model, head_mask):
        model(tokens)
    return traced_maps(traced)


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):  # noqa: ANN001, ANN201
    return open_run(tiny_run(tmp_path_factory.mktemp("notebook-views"), "decoder_only"))


def test_token_text_never_leaves_the_json_unescaped():
    labels = ["a", BREAKOUT, "<!--", "&amp;", "\u2028"]
    html = show_records(captured(tiny_model(), torch.tensor([[1, 2, 3, 4, 5]])), labels)._repr_html_()
    assert BREAKOUT not in html and "<img" not in html and "<!--" not in html
    assert len(re.findall("<script", html, re.I)) == 2  # the data element and the drawing code, nothing else
    assert len(re.findall("</script", html, re.I)) == 2
    assert "\\u003c/script\\u003e\\u003cimg src=x onerror=alert(1)\\u003e" in html
    assert data_of(html)["tokens"] == labels  # and JSON reads it back unchanged


def test_json_for_html_escapes_what_html_could_read_and_round_trips():
    value = {"t": ["</script>", "<!-- -->", "a & b", "x\u2028y", '"quoted"', "é"]}
    text = json_for_html(value)
    assert not set("<>&\u2028") & set(text)
    assert json.loads(text) == value


def test_the_payload_holds_the_captured_weights_of_the_example_asked_for():
    model = tiny_model()
    tokens = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    records = captured(model, tokens)
    data = data_of(show_records(records, list("wxyz"), example=1).html())
    assert [(m["kind"], m["layer"]) for m in data["attention"]] == [("self", 0), ("self", 1)]
    for record, shown in zip(records, data["attention"], strict=True):
        assert shown["queries"] == shown["keys"] == list("wxyz")
        torch.testing.assert_close(torch.tensor(shown["weights"]), record.weights[1].float(), atol=5.1e-5, rtol=0)
        assert not torch.allclose(torch.tensor(shown["weights"]), record.weights[0].float(), atol=1e-3)
    assert data["output"] is None and data["off"] == [] and data["pages"] == [[0, 1]]


def test_captured_records_get_the_viewers_overview_of_every_layer_whatever_is_embedded():
    model = tiny_model(layers=3)
    tokens = (torch.arange(20) % 19 + 1).reshape(1, 20)  # 20 positions: pooled to 16 x 16
    records = captured(model, tokens)
    data = data_of(show_records(records, [str(t) for t in range(20)], layers=[1], off=["self:2:0"]).html())
    overview = data["overview"]["maps"]
    assert [(m["layer"], m["rows"], m["columns"], len(m["heads"]), m["off"]) for m in overview] == [
        (0, 16, 16, 2, []),
        (1, 16, 16, 2, []),
        (2, 16, 16, 2, [0]),
    ]
    for record, entry in zip(records, overview, strict=True):
        shown = np.stack([np.frombuffer(base64.b64decode(head), dtype=np.uint8) for head in entry["heads"]])
        expected = pool_map(record.weights[0].double().numpy())
        np.testing.assert_allclose(shown.reshape(expected.shape) / 255, expected, atol=0.5 / 255 + 1e-6)


def container_id(html: str) -> str:
    found = re.match(r'<div id="([^"]+)" class="attnlab-nb" data-view="(model|head|patterns)">', html)
    assert found, html[:100]
    assert f'attnlabNotebook.render(document.getElementById("{found[1]}"));</script></div>' in html
    assert html.count(found[1]) == 2  # the container and the call that draws into it
    return found[1]


def test_every_view_shown_has_its_own_container():
    records = captured(tiny_model(), torch.tensor([[1, 2, 3]]))
    first, second = show_records(records, list("abc")), show_records(records, list("abc"), view="head")
    ids = [container_id(first._repr_html_()), container_id(second._repr_html_()), container_id(first._repr_html_())]
    assert len(set(ids)) == 3  # the same view shown twice in one notebook gets two containers too
    assert container_id(first.html("my-view")) == "my-view"
    with pytest.raises(UsageError, match="^element_id: 'a\"b' is not a plain HTML id"):
        first.html('a"b')


def test_show_gives_the_viewer_payload_of_a_run(lm_run):
    text = "the <b> cat"
    view = show(lm_run, text, view="head", layer=1, off=["self:0:1"])
    data = data_of(view.html())
    expected = run_payload(lm_run, RunRequest(text=text, off=(HeadId("self", 0, 1),), layers=(0, 1)))
    for key in ("input", "tokens", "off", "held", "output", "attention", "overview"):
        assert data[key] == expected[key]
    assert data["view"] == "head" and data["layer"] == 1 and data["kind"] == "self"
    assert data["off"] == [{"kind": "self", "layer": 0, "head": 1}]
    plain = data_of(show(lm_run.run.path, text).html())  # a run directory works too
    n = len(data["tokens"]) + 1  # BOS and the prompt: the continuations may differ, the prompt's maps are causal
    assert plain["attention"][0]["queries"][:n] == data["attention"][0]["queries"][:n]

    def prompt_block(payload: dict, layer: int) -> torch.Tensor:
        return torch.tensor(payload["attention"][layer]["weights"])[:, :n, :n]

    assert torch.equal(prompt_block(plain, 0), prompt_block(data, 0))  # layer 0 reads no head's output
    assert not torch.equal(prompt_block(plain, 1), prompt_block(data, 1))  # layer 1 reads head 0:1's


def test_markup_typed_into_a_run_stays_escaped(lm_run):
    html = show(lm_run, XSS).html()
    assert XSS not in html and "<img" not in html and len(re.findall("<script", html, re.I)) == 2
    assert data_of(html)["input"] == XSS


def test_a_model_of_many_heads_is_paged_as_the_viewer_pages_it(tmp_path):
    run, _ = tiny_lm_run(tmp_path, layers=12)  # 72 heads: pages of 2 layers, as in the viewer
    data = data_of(show(run, "the cat", layer=5).html())
    assert data["pages"] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]] and data["layer"] == 5
    assert len(data["attention"]) == 12
    few = data_of(show(run, "the cat", layers=[7, 3]).html())
    assert [m["layer"] for m in few["attention"]] == [3, 7] and few["pages"] == [[3, 7]] and few["layer"] == 3


def test_too_many_weights_ask_for_fewer_layers(monkeypatch, lm_run):
    records = captured(tiny_model(), torch.tensor([[1, 2, 3, 4]]))
    monkeypatch.setattr(notebook, "MAX_EMBEDDED_WEIGHTS", 40)  # 2 layers x 2 heads x 4 x 4 = 64 weights
    with pytest.raises(UsageError, match=r"^layers: the view would embed 64 attention weights \(at most 40\)"):
        show_records(records, list("abcd"))
    assert len(data_of(show_records(records, list("abcd"), layers=[1]).html())["attention"]) == 1
    with pytest.raises(UsageError, match="^layers: the view would embed"):
        show(lm_run, "the cat")  # checked after the run, before the maps become JSON


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"view": "heads"}, "view: unknown 'heads'; allowed: model, head, patterns"),
        ({"layers": [2]}, "layers: 2 is not a layer of this model (0..1)"),
        ({"layers": []}, "layers: empty; name at least one layer"),
        ({"layers": [1], "layer": 0}, "layer: 0 is not one of the layers shown (1)"),
        ({"tokens": list("ab")}, "tokens: self layer 0 attends from 3 to 3 positions, but 2 query and 2 key labels"),
        ({"tokens": "abc"}, "tokens: a list of token labels, not one string"),
        ({"tokens": {"cross": ("a", "b")}}, "tokens: no labels for self"),
        ({"example": 1}, "example: 1 is not a row of the batch (0..0)"),
        ({"off": ["self:2:0"]}, "off: self:2:0 is not a head of these records"),
        ({"off": ["self-0-0"]}, "off: head 'self-0-0': expected kind:layer:head"),
    ],
)
def test_bad_arguments_are_one_usage_error_naming_the_argument(arguments, message):
    records = captured(tiny_model(), torch.tensor([[1, 2, 3]]))
    arguments = {"tokens": list("abc"), **arguments}
    with pytest.raises(UsageError, match="^" + re.escape(message)):
        show_records(records, **arguments)


def test_records_kept_for_gradients_show_and_nan_weights_are_refused():
    model = tiny_model()
    with attnlab.trace(model, "*.pattern", detach=False) as traced:
        model(torch.tensor([[1, 2, 3]]))
    records = traced_maps(traced)
    assert records[0].weights.requires_grad
    assert data_of(show_records(traced, list("abc")).html())["attention"][0]["queries"] == list("abc")
    broken = [dataclasses.replace(records[0], weights=torch.full_like(records[0].weights, float("nan"))), records[1]]
    with pytest.raises(UsageError, match="^self layer 0: the attention weights hold NaN or infinity"):
        show_records(broken, list("abc"))


def test_a_trace_shows_its_latest_pass_and_maps_given_twice_or_none_are_refused():
    model = tiny_model()
    with torch.no_grad(), attnlab.trace(model, "*.pattern") as traced:
        model(torch.tensor([[1, 2, 3]]))
        model(torch.tensor([[1, 2]]))
    assert data_of(show_records(traced, list("ab")).html())["attention"][0]["queries"] == list("ab")
    records = traced_maps(traced)
    with pytest.raises(UsageError, match="^records: self layer 0 is given twice"):
        show_records([*records, records[0]], list("ab"))
    with pytest.raises(UsageError, match="^records: nothing was traced"):
        show_records([], list("ab"))


def test_a_run_checks_heads_by_name(lm_run):
    with pytest.raises(UsageError, match="layer 5 is out of range"):
        show(lm_run, "the cat", off=["self:5:0"])


def test_the_inlined_files_write_no_html_and_cannot_end_their_element():
    for name in ("draw.js", "notebook.js", "notebook.css"):
        text = (STATIC_DIR / name).read_text()
        assert "</" not in text and "<!--" not in text
        for sink in (".innerHTML", ".outerHTML", ".insertAdjacentHTML", "document.write", "eval(", "new Function"):
            assert sink not in text


def test_a_view_saves_as_a_standalone_page(tmp_path):
    records = captured(tiny_model(), torch.tensor([[1, 2, 3]]))
    view = show_records(records, list("abc"), title="<b>mine</b>")
    page = view.save(tmp_path / "view.html").read_text()
    assert page.startswith("<!doctype html>") and "<title>&lt;b&gt;mine&lt;/b&gt;</title>" in page
    assert isinstance(view, AttentionHTML) and data_of(page) == view.payload
    assert container_id(page.split("<body>")[1])


def test_the_views_are_attnlab_names():
    assert attnlab.show is show and attnlab.show_records is show_records
