"""Attention pictures: the argmax pattern, every figure of a view, and the PNG files."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from attnlab.analysis.maps import AttentionMap, AttentionView
from attnlab.analysis.plots import (
    argmax_pattern,
    attention_figures,
    heads_heatmap,
    save_attention_pictures,
    select_layers,
)
from attnlab.errors import UsageError
from attnlab.figures import head_heatmap, kind_grid, layer_grid, plt

PNG = b"\x89PNG\r\n\x1a\n"


def _view(layers: int = 2, heads: int = 3) -> AttentionView:
    tokens = ["a", "<b>", "</s>"]
    target = ["<s>", "x"]
    records = []
    for layer in range(layers):
        for kind, (q, k) in (("encoder_self", (3, 3)), ("cross", (2, 3))):
            weights = torch.softmax(torch.randn(1, heads, q, k), -1)
            records.append(AttentionMap(kind, layer, weights))
    return AttentionView(records, {"encoder_self": (tokens, tokens), "cross": (target, tokens)}, "x")


def test_argmax_pattern_is_one_hot_with_ties_to_the_first_key():
    weights = np.array([[[0.2, 0.5, 0.3], [0.4, 0.2, 0.4]]])
    np.testing.assert_array_equal(argmax_pattern(weights), [[[0, 1, 0], [1, 0, 0]]])


def test_attention_figures_draw_each_head_and_a_grid_per_layer_and_kind():
    stems = [stem for stem, figure in attention_figures(_view()) if plt.close(figure) is None]
    expected = [
        f"{kind}_layer{layer}_{name}"
        for kind in ("encoder_self", "cross")
        for layer in (0, 1)
        for name in ("head0", "head1", "head2", "heads")
    ]
    assert stems == expected


def test_argmax_adds_one_pattern_per_layer_and_outlines_the_chosen_keys():
    figures = dict(attention_figures(_view(layers=1, heads=2), argmax=True))
    assert {"encoder_self_layer0_argmax", "cross_layer0_argmax"} <= set(figures)
    outlined = [p for p in figures["cross_layer0_head1"].axes[0].patches if isinstance(p, plt.Rectangle)]
    assert len(outlined) == 2  # one per query row
    pattern = figures["cross_layer0_argmax"].axes[0].images[0].get_array()
    np.testing.assert_array_equal(np.asarray(pattern).sum(-1), [1, 1])
    for figure in figures.values():
        plt.close(figure)


def test_save_attention_pictures_writes_pngs_named_by_kind_layer_and_head(tmp_path):
    paths = save_attention_pictures(_view(layers=1, heads=1), tmp_path / "pictures")
    assert sorted(p.name for p in paths) == sorted(
        [
            "encoder_self_layer0_head0.png",
            "encoder_self_layer0_heads.png",
            "cross_layer0_head0.png",
            "cross_layer0_heads.png",
        ]
    )
    assert all(p.read_bytes()[:8] == PNG for p in paths)
    assert not list((tmp_path / "pictures").glob(".*"))  # no temporary file left


def test_tokens_label_both_axes_as_plain_text():
    figure = head_heatmap(np.full((2, 3), 1 / 3), ["<s>", "x"], ["a", "<b>", "</s>"])
    ax = figure.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["a", "<b>", "</s>"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["<s>", "x"]
    plt.close(figure)


@pytest.mark.parametrize("heads", [1, 5])
def test_layer_grid_hides_unused_cells(heads):
    figure = layer_grid(np.full((heads, 2, 2), 0.5), ["a", "b"], ["a", "b"])
    visible = [ax for ax in figure.axes if ax.axison]
    assert len(visible) == heads
    plt.close(figure)


def test_kind_grid_has_a_row_per_layer_a_column_per_head_and_blanks_for_pruned_heads():
    rng = np.random.default_rng(0)
    maps = [rng.dirichlet(np.ones(3), size=(3, 2)), rng.dirichlet(np.ones(3), size=(1, 2))]  # 3 heads, then 1
    figure = kind_grid(maps, ["<s>", "x"], ["a", "b", "</s>"], title="cross")
    cells = np.array(figure.axes).reshape(2, 3)
    assert [ax.axison for ax in cells.flat] == [True, True, True, True, False, False]
    for layer, heads in enumerate(maps):
        for head, weights in enumerate(heads):
            ax = cells[layer, head]
            assert ax.get_title() == f"layer {layer}, head {head}"
            np.testing.assert_array_equal(ax.images[0].get_array(), weights)
    # the queries label the left column, the keys each head's lowest cell (layer 0 for pruned heads 1, 2)
    keys = {
        (layer, head): [t.get_text() for t in cells[layer, head].get_xticklabels()]
        for layer, head in [(0, 0), (0, 1), (0, 2), (1, 0)]
    }
    assert keys == {(0, 0): [], (0, 1): ["a", "b", "</s>"], (0, 2): ["a", "b", "</s>"], (1, 0): ["a", "b", "</s>"]}
    queries = [[t.get_text() for t in ax.get_yticklabels()] for ax in (cells[0, 0], cells[1, 0], cells[0, 1])]
    assert queries == [["<s>", "x"], ["<s>", "x"], []]
    plt.close(figure)
    names = [f"t{i}" for i in range(20)]
    many = kind_grid([np.full((5, 20, 20), 0.05)] * 5, names, names)
    assert max(many.get_size_inches()) <= 24  # 5 x 5 cells of 6 inches shrink to fit
    plt.close(many)


@pytest.mark.parametrize("tokens", [3, 64, 65, 300])
def test_long_inputs_give_bounded_pictures_with_every_kth_token_labelled(tokens):
    names = [f"t{i}" for i in range(tokens)]
    weights = np.full((tokens, tokens), 1 / tokens)
    figure = head_heatmap(weights, names, names)
    width, height = figure.get_size_inches()
    assert width <= 16 and height <= 16
    labels = [t.get_text() for t in figure.axes[0].get_xticklabels()]
    assert labels[0] == "t0" and len(labels) <= 64
    step = 1 if tokens <= 64 else -(-tokens // 64)
    assert labels == names[::step]  # the labels sit on their own tokens' columns
    assert list(figure.axes[0].get_xticks()) == list(range(0, tokens, step))
    plt.close(figure)
    grid = layer_grid(np.stack([weights] * 4), names, names)
    assert max(grid.get_size_inches()) <= 4 * 6
    # every token of a grid's cell up to 64, as in a single map
    assert all(
        len(ax.get_yticklabels()) == min(tokens, 64) or tokens > 64
        for ax in grid.axes
        if ax.axison and ax.get_yticklabels()
    )
    assert all(len(ax.get_yticklabels()) <= 64 for ax in grid.axes if ax.axison)
    plt.close(grid)


def test_heads_that_were_off_are_titled_off():
    """A held or masked head (view.off) still has weights to draw; its pictures say it was off."""
    import dataclasses

    from attnlab.head_ids import HeadId

    view = dataclasses.replace(_view(layers=1, heads=2), off=(HeadId("cross", 0, 1),))
    figures = dict(attention_figures(view))
    assert figures["cross_layer0_head1"].axes[0].get_title().endswith("head 1 (off)")
    assert figures["cross_layer0_head0"].axes[0].get_title().endswith("head 0")
    assert [ax.get_title() for ax in figures["cross_layer0_heads"].axes if ax.axison] == ["head 0", "head 1 (off)"]
    assert "(off)" not in figures["encoder_self_layer0_head1"].axes[0].get_title()
    for figure in figures.values():
        plt.close(figure)


def _pixels(figure) -> np.ndarray:  # noqa: ANN001
    figure.set_dpi(110)
    figure.canvas.draw()
    pixels = np.asarray(figure.canvas.buffer_rgba()).copy()
    plt.close(figure)
    return pixels


@pytest.mark.parametrize("argmax", [False, True])
def test_saved_pictures_equal_the_figures_drawn_one_by_one(tmp_path, argmax):
    from PIL import Image

    view = _view(layers=2, heads=3)
    paths = save_attention_pictures(view, tmp_path, argmax=argmax)
    figures = list(attention_figures(view, argmax=argmax))
    assert [path.stem for path in paths] == [stem for stem, _ in figures]
    for path, (_, figure) in zip(paths, figures, strict=True):
        saved = np.asarray(Image.open(path).convert("RGBA"))  # written as RGB: alpha 255
        drawn = _pixels(figure)
        assert saved.shape == drawn.shape
        assert np.mean(saved != drawn) < 0.002, path.name  # the same picture (antialiasing aside)


def test_layers_keeps_only_the_selected_layers(tmp_path):
    paths = save_attention_pictures(_view(layers=3, heads=2), tmp_path, layers=select_layers("0,2", 3))
    assert {path.stem.split("_")[-2] for path in paths} == {"layer0", "layer2"}


@pytest.mark.parametrize(
    ("spec", "expected"), [("0,5,29", (0, 5, 29)), ("0-3", (0, 1, 2, 3)), ("28-29,0", (28, 29, 0)), ("3,3", (3,))]
)
def test_select_layers_reads_numbers_and_ranges(spec, expected):
    assert select_layers(spec, 30) == expected


@pytest.mark.parametrize("spec", ["30", "a", "3-1", "-1", "", "0,,1"])
def test_select_layers_refuses_what_is_not_a_layer_of_the_model(spec):
    with pytest.raises(UsageError, match="--layers"):
        select_layers(spec, 30)


def test_heads_heatmap_draws_layers_by_heads_with_each_value_written():
    values = torch.tensor([[0.5, -1.0, 0.0], [2.0, 0.25, float("nan")]])
    figure = heads_heatmap(values, title="restored", colorbar="logit difference")
    ax, bar = figure.axes
    np.testing.assert_array_equal(ax.images[0].get_array().filled(np.nan), values.numpy().astype(float))
    assert ax.images[0].get_cmap().name == "RdBu" and ax.images[0].get_clim() == (-2.0, 2.0)  # a value below 0
    assert sorted(text.get_text() for text in ax.texts) == ["-1", "0.25", "0.5", "2"]  # not 0, not NaN
    assert (ax.get_xlabel(), ax.get_ylabel(), ax.get_title(), bar.get_ylabel()) == (
        "head",
        "layer",
        "restored",
        "logit difference",
    )
    plt.close(figure)


def test_heads_heatmap_draws_positions_with_their_tokens_or_sums_them(tmp_path):
    values = torch.arange(12, dtype=torch.float32).reshape(2, 2, 3)
    tokens = ["<s>", "$x$", "cat"]
    figure = heads_heatmap(values, tokens=tokens)
    ax = figure.axes[0]
    assert ax.images[0].get_array().shape == (4, 3) and ax.images[0].get_cmap().name == "viridis"
    assert [label.get_text() for label in ax.get_xticklabels()] == tokens  # "$x$" as text, not math
    assert [label.get_text() for label in ax.get_yticklabels()] == ["L0 H0", "L0 H1", "L1 H0", "L1 H1"]
    plt.close(figure)
    summed = heads_heatmap(values.numpy(), reduce="sum", path=tmp_path / "heads.png")
    np.testing.assert_array_equal(summed.axes[0].images[0].get_array(), values.sum(-1).numpy())
    assert (tmp_path / "heads.png").read_bytes().startswith(PNG)


@pytest.mark.parametrize(
    ("values", "arguments", "message"),
    [
        (torch.zeros(3), {}, "values: shape (3,); expected (layers, heads) or (layers, heads, positions)"),
        (torch.zeros(0, 2), {}, "values: shape (0, 2)"),
        (torch.zeros(1, 2, 3), {"tokens": ["a"]}, "tokens: 1 labels for 3 positions"),
        (torch.zeros(1, 2), {"reduce": "mean"}, "reduce: unknown 'mean'; allowed: None, 'sum'"),
    ],
)
def test_heads_heatmap_refuses_what_it_cannot_draw(values, arguments, message):
    with pytest.raises(UsageError, match="^" + re.escape(message)):
        heads_heatmap(values, **arguments)
