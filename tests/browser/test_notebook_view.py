"""attnlab.show's HTML fragments in headless chromium, as Jupyter inserts them: they draw, with no server,
several in one page, and markup in token text stays text."""

from __future__ import annotations

import pytest
import torch

import attnlab
from tests.browser.conftest import screenshot

BREAKOUT = "</script><img src=x onerror=alert(1)>"


def fragments(*views: tuple[str, attnlab.viewer.notebook.AttentionHTML]) -> str:
    """A page holding the views' fragments (with these ids) one after another, as a notebook's outputs are."""
    body = "".join(f"<div class='output'>{view.html(name)}</div>" for name, view in views)
    return f'<!doctype html><html><head><meta charset="utf-8"></head><body>{body}</body></html>'


@pytest.fixture(scope="module")
def traced():  # noqa: ANN201
    torch.manual_seed(0)
    config = attnlab.DecoderOnlyConfig(vocab_size=20, layers=12, d_model=12, heads=6, d_ff=16)  # 72 heads: paged
    model = attnlab.DecoderOnly(config).eval()
    with torch.no_grad(), attnlab.trace(model, "*.pattern") as found:
        model(torch.tensor([[1, 2, 3, 4]]))
    return found


def test_views_draw_inline_without_a_server_and_token_markup_stays_text(page, traced):
    import attnlab.viewer.notebook

    tokens = ["a", BREAKOUT, '"><img src=y onerror=alert(2)>', "d"]
    model_view = attnlab.show_records(traced, tokens, off=["self:2:1"], layer=3)
    head_view = attnlab.show_records(traced, tokens, view="head", layer=11)
    requests = []
    page.on("request", lambda request: requests.append(request.url))
    page.set_content(fragments(("first", model_view), ("second", head_view), ("again", model_view)))
    first, second = page.locator("#first"), page.locator("#second")
    page.wait_for_function("() => document.querySelectorAll('.attnlab-nb[data-rendered]').length === 3")
    assert page.locator("#again .head-cell").count() == 12  # the same view shown twice: drawn twice

    # the model view: one page of 2 layers (as the viewer pages 72 heads), the page holding layer 3
    assert first.locator(".head-cell").count() == 12
    assert sorted({int(n) for n in first.locator(".head-cell").evaluate_all("cs => cs.map(c => c.dataset.layer)")}) == [
        2,
        3,
    ]
    assert first.locator(".head-cell.off").count() == 1
    assert first.locator(".head-cell.off").get_attribute("data-head") == "1"
    first.locator("button", has_text="next").click()
    assert first.get_attribute("data-page") == "2" and first.locator(".head-cell[data-layer='5']").count() == 6

    # the overview: every head of the 12 layers; a click shows its layer's page, the head highlighted
    assert first.locator(".overview-cell").count() == 72
    assert first.locator(".overview-cell.off").get_attribute("data-layer") == "2"
    first.locator(".overview-cell[data-layer='9'][data-head='4']").click()
    assert first.get_attribute("data-page") == "4"
    focused = first.locator(".head-cell.focused")
    assert (focused.get_attribute("data-layer"), focused.get_attribute("data-head")) == ("9", "4")
    assert first.locator(".attnlab-nb-fallback").count() == 0

    # the head view: layer 11's lines, the tokens as text
    assert second.locator(".head-cell").count() == 0
    assert second.locator("select").nth(1).input_value() == "11"
    assert second.locator("text[data-side='query']").all_text_contents() == tokens
    assert second.locator("text[data-side='key']").all_text_contents() == tokens
    assert second.locator("line").count() > 0
    assert first.locator(".token-chip").all_text_contents() == tokens

    assert page.evaluate("document.querySelectorAll('img').length") == 0
    assert page.errors == []  # no alert, no script error
    assert [url for url in requests if not url.startswith(("about:", "data:"))] == []  # nothing fetched
    screenshot(page, "notebook-views")
