"""attention_view: every map of one input, with the output, the class or next-token distribution."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnlab.analysis.maps import attention_view, kind_maps
from attnlab.head_ids import HeadId, mask_without
from attnlab.run.loaded import open_run
from tests.unit.analysis.tiny_runs import tiny_run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("maps")
    return {
        kind: open_run(tiny_run(folder, kind)) for kind in ("encoder_decoder", "encoder_classifier", "decoder_only")
    }


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
    maps = np.stack(kind_maps(view, "encoder_self"))
    assert maps.shape == (2, 2, len(source), len(source))
    np.testing.assert_allclose(maps.sum(-1), 1.0, atol=1e-5)
    targets, sources = view.axes["cross"]
    assert np.stack(kind_maps(view, "cross")).shape == (2, 2, len(targets), len(sources))
    with pytest.raises(KeyError):
        kind_maps(view, "self")


def test_a_head_switched_off_changes_later_layers_only(runs):
    loaded = runs["encoder_decoder"]
    plain = kind_maps(attention_view(loaded, "abcd"), "encoder_self")
    masked = kind_maps(
        attention_view(loaded, "abcd", head_mask=mask_without(loaded.model, [HeadId("encoder_self", 0, 0)])),
        "encoder_self",
    )
    np.testing.assert_allclose(masked[0], plain[0], atol=1e-6)  # xi scales outputs, not weights
    assert not np.allclose(masked[1], plain[1], atol=1e-4)


def test_heads_held_in_training_are_off_in_every_view(tmp_path_factory):
    """A run's train.mask_heads stay off in the maps and the output; a head_mask switches more off."""
    from attnlab.generate.search import DecodeOptions, decode
    from attnlab.nn import masking_heads, trace
    from tests.unit.analysis.tiny_runs import HELD

    loaded = open_run(tiny_run(tmp_path_factory.mktemp("maps-held"), "held"))
    held = [HeadId(kind, int(layer), int(head)) for kind, layer, head in (s.split(":") for s in HELD)]
    extra = HeadId("decoder_self", 1, 0)
    for head_mask, off in ((None, held), (mask_without(loaded.model, [extra]), [*held, extra])):
        view = attention_view(loaded, "abcd", head_mask=head_mask)
        assert sorted(view.off) == sorted(off)
        expected_mask = mask_without(loaded.model, off)
        task = loaded.task
        src = torch.tensor([loaded.codec.encode("abcd") + [task.eos_id]])
        hypothesis = decode(
            loaded.model,
            src,
            bos_id=task.bos_id,
            eos_id=task.eos_id,
            pad_id=task.pad_id,
            options=DecodeOptions(max_length=64),
            head_mask=expected_mask,
        )[0]
        assert view.output == loaded.codec.decode(hypothesis.tokens)
        with torch.no_grad(), trace(loaded.model, "*.pattern") as traced, masking_heads(loaded.model, expected_mask):
            loaded.model(src, torch.tensor([[task.bos_id, *hypothesis.tokens]]))
        for kind, site in (
            ("encoder_self", "encoder.{}.attn"),
            ("decoder_self", "decoder.{}.attn"),
            ("cross", "decoder.{}.cross"),
        ):
            layers = len(kind_maps(view, kind))
            expected = np.stack([traced.cache[f"{site.format(layer)}.pattern"][0].numpy() for layer in range(layers)])
            np.testing.assert_allclose(kind_maps(view, kind), expected, atol=1e-6)
    plain = attention_view(loaded, "abcd", head_mask=mask_without(loaded.model, []))
    with torch.no_grad(), trace(loaded.model, "encoder.1.attn.pattern") as traced:
        loaded.model(
            torch.tensor([loaded.codec.encode("abcd") + [loaded.task.eos_id]]), torch.tensor([[loaded.task.bos_id]])
        )
    unmasked = traced.cache["encoder.1.attn.pattern"][0].numpy()
    assert not np.allclose(kind_maps(plain, "encoder_self")[1], unmasked, atol=1e-4)  # the held heads did matter
