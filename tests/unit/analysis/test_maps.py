"""attention_view: every map of one input, with the output, the class or next-token distribution."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnlab.analysis.maps import attention_view, kind_maps
from attnlab.experiment import open_run
from attnlab.head_ids import HeadId, mask_without
from tests.unit.analysis.tiny_runs import tiny_run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("maps")
    return {kind: open_run(tiny_run(folder, kind)) for kind in ("encoder_decoder", "encoder_classifier", "decoder_only")}


def test_classifier_distribution_is_every_class_and_holds_the_label(runs):
    loaded = runs["encoder_classifier"]
    view = attention_view(loaded, "(()")
    labels = [label for label, _ in view.distribution]
    probabilities = np.array([p for _, p in view.distribution])
    assert labels == ["0", "1"]
    assert probabilities.sum() == pytest.approx(1.0, abs=1e-6)
    assert view.output == labels[int(probabilities.argmax())]
    assert view.probability == pytest.approx(probabilities.max())


def test_next_token_distribution_is_the_models_softmax_right_after_the_prompt(runs):
    loaded = runs["decoder_only"]
    view = attention_view(loaded, "the c", max_length=4, top_k=3)
    prompt = [loaded.task.bos_id, *loaded.codec.encode("the c")]
    with torch.no_grad():
        expected = torch.softmax(loaded.model(torch.tensor([prompt]))[0, -1], -1)
    values, indices = expected.topk(3)
    assert [token for token, _ in view.distribution] == loaded.codec.tokens(indices.tolist())
    assert [p for _, p in view.distribution] == pytest.approx(values.tolist(), abs=1e-5)


def test_kind_maps_stacks_layers_with_rows_that_sum_to_one(runs):
    view = attention_view(runs["encoder_decoder"], "abcd")
    source, _ = view.axes["encoder_self"]
    maps = kind_maps(view, "encoder_self")
    assert maps.shape == (2, 2, len(source), len(source))
    np.testing.assert_allclose(maps.sum(-1), 1.0, atol=1e-5)
    targets, sources = view.axes["cross"]
    assert kind_maps(view, "cross").shape == (2, 2, len(targets), len(sources))
    with pytest.raises(KeyError):
        kind_maps(view, "self")


def test_a_head_switched_off_changes_later_layers_only(runs):
    loaded = runs["encoder_decoder"]
    plain = kind_maps(attention_view(loaded, "abcd"), "encoder_self")
    masked = kind_maps(attention_view(loaded, "abcd", head_mask=mask_without(loaded.model, [HeadId("encoder_self", 0, 0)])),
                       "encoder_self")
    np.testing.assert_allclose(masked[0], plain[0], atol=1e-6)  # xi scales outputs, not weights
    assert not np.allclose(masked[1], plain[1], atol=1e-4)
