"""show_patterns' HTML in headless chromium, as a notebook holds its outputs: several in one page, each
drawn from its own data (no shared state), its numbers the model's cached patterns, no script error."""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab.viewer.notebook import show_patterns
from tests.browser.conftest import screenshot
from tests.unit.analysis.tiny_lm import tiny_lm_run

TEXT = "the cat sat"
MARKUP = "a <b>&"
SHOWN = 3
"""Decimals of the weights written under the tokens."""
TOLERANCE = 0.5 * 10**-SHOWN + 0.5e-4 + 1e-6
"""The written weight against the model's: its rounding, the embedded data's (4 decimals), float."""


@pytest.fixture(scope="module")
def lm(tmp_path_factory):  # noqa: ANN001, ANN201
    run, _ = tiny_lm_run(tmp_path_factory.mktemp("patterns-browser"))
    return attnlab.load(run)


def patterns(lm, text: str) -> torch.Tensor:  # noqa: ANN001
    """(layers, heads, T, T): the patterns ``lm.trace`` caches for one forward pass over ``text``."""
    with lm.trace("decoder.*.attn.pattern") as traced:
        lm(text)
    return torch.stack([traced.cache[f"decoder.{layer}.attn.pattern"][0] for layer in range(2)])


def written(view) -> list[float]:  # noqa: ANN001
    """The weights written under the tokens of ``view`` (a locator of one output)."""
    return [float(text) for text in view.locator(".attnlab-nb-weight").all_text_contents()]


def assert_shows(view, expected: torch.Tensor) -> None:  # noqa: ANN001
    values = written(view)
    assert len(values) == len(expected)
    assert max(abs(a - b) for a, b in zip(values, expected.tolist(), strict=True)) <= TOLERANCE


def test_two_outputs_in_one_page_draw_the_models_patterns_and_answer_the_pointer_apart(page, lm):
    cached, marked = patterns(lm, TEXT), patterns(lm, MARKUP)
    one_layer = show_patterns(lm.loaded, TEXT, layer=1)
    some_heads = show_patterns(lm.loaded, MARKUP, layer=0, heads=[5, 2])
    every_layer = show_patterns(lm.loaded, TEXT)
    outputs = [one_layer, some_heads, every_layer, one_layer]  # the same output twice, as a rerun cell shows
    body = "".join(f"<div class='output'>{view._repr_html_()}</div>" for view in outputs)
    console, requests = [], []
    page.on("console", lambda message: console.append(message) if message.type in ("error", "warning") else None)
    page.on("request", lambda request: requests.append(request.url))
    page.set_content(f'<!doctype html><html><head><meta charset="utf-8"></head><body>{body}</body></html>')
    page.wait_for_function("() => document.querySelectorAll('.attnlab-nb[data-rendered]').length === 4")
    first, second, third, again = (page.locator(".attnlab-nb").nth(index) for index in range(4))
    tokens = one_layer.payload["attention"][0]["queries"]
    last = len(tokens) - 1

    # the first output: layer 1's six heads; at first the last token's attention by head 0
    assert first.locator(".attnlab-nb-token-text").all_text_contents() == tokens
    assert first.locator(".head-cell").count() == 6 and first.locator("select").nth(1).input_value() == "1"
    assert (first.get_attribute("data-head"), first.get_attribute("data-query")) == ("0", str(last))
    assert_shows(first, cached[1, 0, last])

    # pointing at a token shows what it attends to; leaving it shows the kept one again
    first.locator(".attnlab-nb-token[data-index='4']").hover()
    assert first.get_attribute("data-query") == "4"
    assert_shows(first, cached[1, 0, 4])
    assert written(first)[5:] == [0.0] * (len(tokens) - 5)  # causal: no attention to later tokens
    first.locator(".attnlab-nb-title").hover()
    assert first.get_attribute("data-query") == str(last)

    # a click on a head shows its map, a click on a token keeps it, a point on the map's row shows that row
    first.locator(".head-cell[data-head='3']").click()
    first.locator(".attnlab-nb-token[data-index='2']").click()
    first.locator(".attnlab-nb-title").hover()
    assert (first.get_attribute("data-head"), first.get_attribute("data-query")) == ("3", "2")
    assert_shows(first, cached[1, 3, 2])
    assert first.locator(".head-cell.selected").get_attribute("data-head") == "3"
    box = first.locator("canvas.attnlab-nb-pattern-map").bounding_box()
    page.mouse.move(box["x"] + 2, box["y"] + box["height"] * 6.5 / len(tokens))
    assert first.get_attribute("data-query") == "6"
    assert_shows(first, cached[1, 3, 6])

    # the second output: two heads of layer 0 on text whose markup stays text
    marked_tokens = some_heads.payload["attention"][0]["queries"]
    assert second.locator(".attnlab-nb-token-text").all_text_contents() == marked_tokens
    assert [cell.get_attribute("data-head") for cell in second.locator(".head-cell").all()] == ["2", "5"]
    assert second.get_attribute("data-head") == "2"
    assert_shows(second, marked[0, 2, len(marked_tokens) - 1])
    second.locator(".head-cell[data-head='5']").click()
    second.locator(".attnlab-nb-token[data-index='1']").hover()
    assert_shows(second, marked[0, 5, 1])

    # the third: every layer, layer 0 first, the layer list switches
    assert third.locator("select").nth(1).input_value() == "0"
    assert_shows(third, cached[0, 0, last])
    third.locator("select").nth(1).select_option("1")
    assert third.get_attribute("data-layer") == "1"
    assert_shows(third, cached[1, 0, last])

    # the same output again is drawn on its own: nothing the first's clicks changed
    assert (again.get_attribute("data-head"), again.get_attribute("data-query")) == ("0", str(last))
    assert_shows(again, cached[1, 0, last])

    assert page.evaluate("document.querySelectorAll('img, b').length") == 0
    assert page.errors == [] and [message.text for message in console] == []
    assert [url for url in requests if not url.startswith(("about:", "data:"))] == []  # nothing fetched
    screenshot(page, "notebook-patterns")
