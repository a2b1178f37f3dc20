"""show_patterns and the ``heads=`` choice of the notebook views: the data embedded is the model's cached
pattern (``lm.trace``'s ``decoder.L.attn.pattern``) to 4 decimals, of the layer and heads asked for."""

from __future__ import annotations

import json
import re

import pytest
import torch

import attnlab
from attnlab.errors import UsageError
from attnlab.viewer import notebook
from attnlab.viewer.notebook import show, show_patterns, show_records
from tests.unit.analysis.tiny_lm import tiny_lm_run

TEXT = "the cat sat"
ROUNDING = 0.5e-4 + 1e-6
"""The embedded weights are rounded to 4 decimals."""


def data_of(html: str) -> dict:
    """The JSON payload embedded in a view's HTML, parsed back as the page's script parses it."""
    found = re.findall(r'<script type="application/json" class="attnlab-nb-data">(.*?)</script>', html, re.S)
    assert len(found) == 1
    return json.loads(found[0])


@pytest.fixture(scope="module")
def lm(tmp_path_factory):  # noqa: ANN001, ANN201
    run, _ = tiny_lm_run(tmp_path_factory.mktemp("notebook-patterns"))  # 2 layers of 6 heads
    return attnlab.load(run)


@pytest.fixture(scope="module")
def cached(lm):  # noqa: ANN001, ANN201
    with lm.trace("decoder.*.attn.pattern") as traced:
        lm(TEXT)
    return traced.cache


def test_the_data_embedded_is_the_traced_pattern_of_the_layer(lm, cached):
    html = show_patterns(lm.loaded, TEXT, layer=1)._repr_html_()
    data = data_of(html)
    assert data["view"] == "patterns" and data["layer"] == 1 and data["overview"] is None
    assert 'data-view="patterns"' in html
    (shown,) = data["attention"]
    assert (shown["kind"], shown["layer"], "heads" in shown) == ("self", 1, False)
    assert shown["queries"] == shown["keys"] == lm.to_str_tokens(TEXT)
    weights = torch.tensor(shown["weights"])
    expected = cached["decoder.1.attn.pattern"][0]
    assert weights.shape == expected.shape == (6, len(shown["queries"]), len(shown["keys"]))
    assert float((weights - expected).abs().max()) <= ROUNDING


def test_heads_embed_those_heads_only_and_no_layer_embeds_every_layer(lm, cached):
    data = data_of(show_patterns(lm.loaded, TEXT, heads=[4, 1, 4]).html())
    assert [(m["layer"], m["heads"]) for m in data["attention"]] == [(0, [1, 4]), (1, [1, 4])]
    assert data["layer"] == 0
    for shown in data["attention"]:
        expected = cached[f"decoder.{shown['layer']}.attn.pattern"][0, [1, 4]]
        assert float((torch.tensor(shown["weights"]) - expected).abs().max()) <= ROUNDING


def test_the_other_views_draw_a_choice_of_heads_too():
    config = attnlab.DecoderOnlyConfig(vocab_size=20, layers=2, d_model=12, heads=3, d_ff=16)
    model = attnlab.DecoderOnly(config).eval()
    with torch.no_grad(), attnlab.trace(model, "*.pattern") as traced:
        model(torch.tensor([[1, 2, 3]]))
    for view in notebook.VIEWS:
        data = data_of(show_records(traced, list("abc"), view=view, heads=[2]).html())
        assert [m["heads"] for m in data["attention"]] == [[2], [2]]
        expected = traced.cache["decoder.1.attn.pattern"][0, [2]].double()
        assert float((torch.tensor(data["attention"][1]["weights"]) - expected).abs().max()) <= ROUNDING
        assert (data["overview"] is None) == (view == "patterns")  # the model view's overview: every head


def test_the_size_cap_counts_the_heads_drawn(monkeypatch, lm):
    monkeypatch.setattr(notebook, "MAX_EMBEDDED_WEIGHTS", 2 * 11 * 11)  # two heads of one layer, 11 tokens
    with pytest.raises(UsageError, match=r"^layers: the view would embed 363 attention weights \(at most 242\)"):
        show_patterns(lm.loaded, TEXT, layer=0, heads=[0, 1, 2])
    assert len(data_of(show_patterns(lm.loaded, TEXT, layer=0, heads=[0, 1]).html())["attention"]) == 1


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"layer": 2}, "layer: 2 is not a layer of this model (0..1)"),
        ({"layer": True}, "layer: True is not a layer of this model (0..1)"),
        ({"text": "  "}, "text: empty input"),
        ({"heads": [6]}, "heads: 6 is not a head of the layers shown (0..5)"),
        ({"heads": []}, "heads: empty; name at least one head"),
        ({"heads": 3}, "heads: a list of head numbers, such as [3], not one number"),
        ({"off": ["self:0:9"]}, "off: head 'self:0:9': head 9 is out of range"),
    ],
)
def test_bad_arguments_are_one_usage_error_naming_the_argument(lm, arguments, message):
    arguments = {"text": TEXT, **arguments}
    with pytest.raises(UsageError, match="^" + re.escape(message)):
        show_patterns(lm.loaded, **arguments)


def test_show_takes_the_patterns_view_and_a_run_directory(lm):
    data = data_of(show(lm.loaded.run.path, TEXT, view="patterns", layers=[1], heads=[0]).html())
    assert data["view"] == "patterns" and [(m["layer"], m["heads"]) for m in data["attention"]] == [(1, [0])]
