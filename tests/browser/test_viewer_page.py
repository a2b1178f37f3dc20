"""The viewer page in headless chromium: type, switch heads off, load importance, stay safe and quick."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import pytest

from attnlab.analysis.pruning import prune_model, write_pruned_run
from attnlab.head_ids import HeadId
from attnlab.run.loaded import open_run
from attnlab.viewer import create_app
from attnlab.viewer.requests import MAX_INPUT_CHARS, MAX_INPUT_TOKENS
from tests.browser.conftest import screenshot, serving
from tests.unit.analysis.tiny_lm import tiny_lm_run
from tests.unit.analysis.tiny_runs import XSS, tiny_run


@pytest.fixture(scope="module")
def runs(browser, tmp_path_factory):  # noqa: ANN001 -- needs the browser first, so a skip costs no training
    folder = tmp_path_factory.mktemp("viewer-browser")
    return {
        kind: open_run(tiny_run(folder, kind)) for kind in ("encoder_decoder", "encoder_classifier", "decoder_only")
    }


def api_run(url: str, text: str, off: list[dict[str, Any]]) -> dict[str, Any]:
    request = urllib.request.Request(
        url + "api/run",
        data=json.dumps({"text": text, "off": off}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)


def shown(output: dict[str, Any]) -> str:
    """What the page shows as the main output (see drawOutput in viewer.js)."""
    if output["type"] == "class":
        return f"{output['label']} (p = {output['probability']:.4f})"
    return output["text"]


def runs_done(page) -> int:  # noqa: ANN001
    return int(page.evaluate("document.body.dataset.runs"))


def wait_for_run(page, after: int) -> None:  # noqa: ANN001
    page.wait_for_function(
        "n => Number(document.body.dataset.runs) > n && document.body.dataset.state !== 'busy'", arg=after
    )


def open_viewer(page, url: str) -> None:  # noqa: ANN001
    page.goto(url)
    wait_for_run(page, 0)


def type_input(page, text: str) -> None:  # noqa: ANN001
    before = runs_done(page)
    page.fill("#input", text)
    wait_for_run(page, before)


def cell(page, kind: str, layer: int, head: int):  # noqa: ANN001, ANN201
    return page.locator(f".head-cell[data-kind='{kind}'][data-layer='{layer}'][data-head='{head}']")


def test_switching_a_head_off_changes_the_output_as_the_api_says(page, runs):
    loaded = runs["encoder_classifier"]
    text = "(()("
    with serving(create_app(loaded)) as url:
        open_viewer(page, url)
        type_input(page, text)
        plain = api_run(url, text, [])
        assert page.text_content("#output-main") == shown(plain["output"])
        heads = [{"kind": "self", "layer": layer, "head": head} for layer in (0, 1) for head in (0, 1)]
        masked = {json.dumps(h): api_run(url, text, [h]) for h in heads}
        head = next(h for h in heads if shown(masked[json.dumps(h)]["output"]) != shown(plain["output"]))
        expected = masked[json.dumps(head)]
        later_before = cell(page, "self", 1, 0).locator("canvas").evaluate("c => c.toDataURL()")

        before = runs_done(page)
        cell(page, head["kind"], head["layer"], head["head"]).click()
        wait_for_run(page, before)

        assert page.text_content("#output-main") == shown(expected["output"]) != shown(plain["output"])
        assert page.text_content("#off-count") == "1"
        switched = cell(page, head["kind"], head["layer"], head["head"])
        assert switched.get_attribute("aria-pressed") == "true" and "off" in switched.get_attribute("class")
        if head["layer"] == 0:  # layer 1 reads layer 0's heads: its maps change too
            assert cell(page, "self", 1, 0).locator("canvas").evaluate("c => c.toDataURL()") != later_before
        screenshot(page, "head-switched-off")

        before = runs_done(page)
        cell(page, head["kind"], head["layer"], head["head"]).click()
        wait_for_run(page, before)
        assert page.text_content("#output-main") == shown(plain["output"])
        assert page.errors == []


def test_markup_typed_as_input_shows_as_text(page, runs):
    with serving(create_app(runs["decoder_only"])) as url:
        open_viewer(page, url)
        type_input(page, XSS)
        assert page.locator("#error").is_hidden()
        assert page.locator("#input-tokens .token-chip").all_text_contents() == list(XSS)
        queries = page.locator("#head-view text[data-side='query']").all_text_contents()
        assert queries[1 : len(XSS) + 1] == list(XSS)
        assert page.locator("#output-table tbody tr").count() == 5  # the next-token distribution
        assert page.evaluate("document.querySelectorAll('img, script:not([src])').length") == 0
        screenshot(page, "xss-as-tokens")
    with serving(create_app(runs["encoder_decoder"])) as url:
        open_viewer(page, url)
        type_input(page, XSS)
        assert page.locator("#error").is_visible()
        assert XSS in page.text_content("#error")  # the task's alphabet refuses it; the message quotes it
        assert "stale" in page.get_attribute("body", "class")  # the maps shown are of the last input that ran
        assert page.evaluate("document.querySelectorAll('img').length") == 0
        screenshot(page, "xss-in-error")
    assert page.errors == []  # no alert, no script error


def test_an_input_over_the_caps_gets_a_visible_message(page, runs):
    with serving(create_app(runs["encoder_classifier"])) as url:
        open_viewer(page, url)
        type_input(page, "()" * MAX_INPUT_TOKENS)
        assert f"the viewer shows at most {MAX_INPUT_TOKENS}" in page.text_content("#error")
        assert page.text_content("#output-main") == ""
        type_input(page, "(" * (MAX_INPUT_CHARS + 50))  # checked in the page, before any request
        assert page.text_content("#error") == (
            f"The input is {MAX_INPUT_CHARS + 50} characters long; the viewer takes at most {MAX_INPUT_CHARS}."
        )
        assert "stale" in page.get_attribute("body", "class")
        screenshot(page, "input-too-long")
        type_input(page, "(())")
        assert page.locator("#error").is_hidden() and page.text_content("#output-main") != ""


def test_an_importance_csv_colours_heads_and_a_bad_one_is_explained(page, runs):
    csv = "kind,layer,head,importance\nself,0,0,0.9\nself,0,1,0.1\nself,1,0,0.5\nself,1,1,0.3\n"
    with serving(create_app(runs["encoder_classifier"])) as url:
        open_viewer(page, url)
        page.set_input_files(
            "#importance-file", files=[{"name": "importance.csv", "mimeType": "text/csv", "buffer": csv.encode()}]
        )
        page.wait_for_function("() => document.querySelectorAll('.head-cell[data-importance]').length === 4")
        assert cell(page, "self", 0, 0).get_attribute("data-importance") == "0.9"
        assert page.locator(".overview-cell[data-importance]").count() == 4  # the overview is coloured too
        assert overview_cell(page, "self", 0, 0).get_attribute("data-importance") == "0.9"
        assert "importance.csv" in page.text_content("#importance-status")
        screenshot(page, "importance")
        page.set_input_files(
            "#importance-file",
            files=[{"name": "bad.csv", "mimeType": "text/csv", "buffer": b"kind,layer,head,importance\ncross,0,0,1\n"}],
        )
        page.wait_for_function("() => !document.getElementById('error').hidden")
        assert "bad.csv: importance CSV: line 2: this model has no 'cross' attention" in page.text_content("#error")


def test_the_encoder_decoder_page_shows_all_three_kinds(page, runs):
    with serving(create_app(runs["encoder_decoder"])) as url:
        open_viewer(page, url)
        type_input(page, "abcd")
        assert page.locator(".kind-block h3").all_text_contents() == [
            "encoder self-attention (encoder_self)",
            "decoder masked self-attention (decoder_self)",
            "encoder-decoder attention (cross)",
        ]
        assert page.locator(".head-cell").count() == 12
        assert page.text_content("#output-label") == "decoded sequence"
        assert page.text_content("#output-main") == api_run(url, "abcd", [])["output"]["text"]
        page.select_option("#head-view-kind", "cross")
        page.select_option("#head-view-layer", "1")
        assert page.locator("#head-view text[data-side='key']").all_text_contents() == ["a", "b", "c", "d", "</s>"]
        screenshot(page, "encoder-decoder")


def test_heads_held_in_training_show_as_held_and_stay_off(page, tmp_path_factory):
    """train.mask_heads: drawn off, marked held, not switchable, and kept off by "Switch all back on"."""
    loaded = open_run(tiny_run(tmp_path_factory.mktemp("viewer-browser-held"), "held"))
    with serving(create_app(loaded)) as url:
        open_viewer(page, url)
        type_input(page, "abcd")
        assert page.text_content("#output-main") == api_run(url, "abcd", [])["output"]["text"]
        assert "cross:0:0, encoder_self:0:1" in page.text_content("#held-note")
        held = cell(page, "cross", 0, 0)
        assert "held" in held.get_attribute("class") and held.get_attribute("aria-pressed") == "true"
        assert "train.mask_heads" in held.get_attribute("title")
        assert page.locator(".head-cell.held").count() == 2
        runs_before = runs_done(page)
        held.click(force=True)  # aria-disabled: a real user click still reaches it
        page.wait_for_timeout(300)
        assert runs_done(page) == runs_before and page.text_content("#off-count") == "0"  # nothing to switch
        before = runs_done(page)
        cell(page, "decoder_self", 1, 0).click()
        wait_for_run(page, before)
        off = [{"kind": "decoder_self", "layer": 1, "head": 0}]
        assert page.text_content("#output-main") == api_run(url, "abcd", off)["output"]["text"]
        before = runs_done(page)
        page.click("#reset-heads")
        wait_for_run(page, before)
        assert page.locator(".head-cell.off").count() == 2 and page.locator(".head-cell.held").count() == 2
        page.select_option("#head-view-kind", "cross")
        page.select_option("#head-view-layer", "0")
        assert "head 0 (held)" in page.text_content("#head-view-legend")
        screenshot(page, "held-heads")
    assert page.errors == []


def layers_shown(page) -> list[int]:  # noqa: ANN001
    """The layers whose heads the model view shows."""
    return sorted({int(n) for n in page.locator(".head-cell").evaluate_all("cs => cs.map(c => c.dataset.layer)")})


def test_a_model_of_many_heads_is_shown_one_page_of_layers_at_a_time(page, tmp_path_factory):
    """A pretrained LM of 12 layers x 6 heads (72 heads, as SmolLM2's 270): pages of 2 layers, the
    head view follows the page, and a head switched off on one page stays off on the others."""
    run, _ = tiny_lm_run(tmp_path_factory.mktemp("viewer-browser-lm"), layers=12, context=512)
    with serving(create_app(open_run(run))) as url:
        open_viewer(page, url)
        assert layers_shown(page) == [0, 1] and page.locator(".head-cell").count() == 12
        assert page.locator("#page-select option").all_text_contents()[:2] == ["layers 0–1", "layers 2–3"]
        assert page.locator("#page-select option").count() == 6 and page.is_disabled("#page-prev")
        type_input(page, "the cat sat on the mat")
        plain = api_run(url, "the cat sat on the mat", [])

        before = runs_done(page)
        page.click("#page-next")
        wait_for_run(page, before)
        assert layers_shown(page) == [2, 3]
        assert page.locator("#head-view-layer option").all_text_contents() == ["2", "3"]
        before = runs_done(page)
        cell(page, "self", 2, 1).click()
        wait_for_run(page, before)
        off = api_run(url, "the cat sat on the mat", [{"kind": "self", "layer": 2, "head": 1}])
        assert page.text_content("#output-main") == shown(off["output"])

        before = runs_done(page)
        page.select_option("#page-select", "0")
        wait_for_run(page, before)
        assert layers_shown(page) == [0, 1] and page.text_content("#off-count") == "1"
        assert page.text_content("#output-main") == shown(off["output"])
        assert [row["probability"] for row in off["output"]["next_tokens"]] != [
            row["probability"] for row in plain["output"]["next_tokens"]
        ]
        screenshot(page, "pretrained-lm-pages")
        assert page.errors == []


def overview_cell(page, kind: str, layer: int, head: int):  # noqa: ANN001, ANN201
    return page.locator(f".overview-cell[data-kind='{kind}'][data-layer='{layer}'][data-head='{head}']")


def test_the_overview_shows_every_head_and_a_click_opens_its_layer(page, tmp_path_factory):
    """12 layers x 6 heads of a paged model: one thumbnail per head above the pages; a click shows the
    head's page with the head highlighted; a head switched off is marked in the overview too."""
    run, _ = tiny_lm_run(tmp_path_factory.mktemp("viewer-browser-overview"), layers=12, context=512)
    with serving(create_app(open_run(run))) as url:
        open_viewer(page, url)
        assert page.locator(".overview-cell").count() == 72 and page.locator(".overview-layer").count() == 12
        painted = overview_cell(page, "self", 11, 5).locator("canvas")
        assert painted.evaluate("c => [c.width, c.height]") == [16, 16]  # the example input is over 16 tokens
        assert layers_shown(page) == [0, 1]

        before = runs_done(page)
        overview_cell(page, "self", 7, 3).click()
        wait_for_run(page, before)
        assert layers_shown(page) == [6, 7] and page.input_value("#page-select") == "3"
        assert page.input_value("#head-view-layer") == "7"
        focused = page.locator("#model-view .head-cell.focused")
        assert focused.count() == 1 and focused.get_attribute("data-layer") == "7"
        assert focused.get_attribute("data-head") == "3" and focused.is_visible()
        assert "focused" in overview_cell(page, "self", 7, 3).get_attribute("class")

        before = runs_done(page)
        cell(page, "self", 7, 3).click()  # switched off in the model view: marked in the overview
        wait_for_run(page, before)
        assert "off" in overview_cell(page, "self", 7, 3).get_attribute("class")
        assert page.locator(".overview-cell.off").count() == 1

        overview_cell(page, "self", 6, 0).click()  # a head of the page shown: no new run, just the focus
        assert page.locator("#model-view .head-cell.focused").get_attribute("data-layer") == "6"
        assert layers_shown(page) == [6, 7]
        screenshot(page, "overview")
        assert page.errors == []


def test_a_pruned_models_overview_and_model_view_keep_each_head_in_its_column(page, tmp_path_factory):
    """Layers of different head counts (heads_per_layer [2, 5]): short rows end early, never wrap."""
    folder = tmp_path_factory.mktemp("viewer-browser-pruned")
    loaded = open_run(tiny_lm_run(folder, layers=2)[0])
    pruned = [HeadId("self", 0, head) for head in (0, 1, 2, 4)] + [HeadId("self", 1, 5)]
    write_pruned_run(loaded, prune_model(loaded.model, pruned), folder / "pruned", pruned=pruned)
    with serving(create_app(open_run(folder / "pruned"))) as url:
        open_viewer(page, url)
        for selector in (".overview-cell", ".head-cell"):
            assert page.locator(selector).count() == 7
            boxes = page.locator(selector).evaluate_all(
                "cs => cs.map(c => [+c.dataset.layer, +c.dataset.head, c.getBoundingClientRect().x, "
                "c.getBoundingClientRect().y])"
            )
            rows = {layer: {y for lay, _, _, y in boxes if lay == layer} for layer in (0, 1)}
            assert all(len(ys) == 1 for ys in rows.values()) and rows[0] != rows[1]  # one row a layer
            columns = {head: {x for _, h, x, _ in boxes if h == head} for head in range(5)}
            assert all(len(xs) == 1 for xs in columns.values())  # head h in the same column in every layer
        screenshot(page, "overview-pruned")
        assert page.errors == []
