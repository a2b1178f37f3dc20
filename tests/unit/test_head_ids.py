"""A run's held heads (train.mask_heads) as one head mask, shared by every command."""

from __future__ import annotations

import pytest
import torch

from attnlab.errors import ConfigError, UsageError
from attnlab.head_ids import (
    HeadId,
    head_ids,
    head_site,
    heads_off,
    held_heads,
    held_mask,
    mask_without,
    parse_head_name,
)
from attnlab.nn import EncoderDecoder, EncoderDecoderConfig, model_sites


@pytest.fixture(scope="module")
def model():
    return EncoderDecoder(EncoderDecoderConfig(vocab_size=12, layers=2, d_model=8, heads=2, d_ff=16))


def test_held_mask_holds_the_named_heads_and_more_on_top_of_a_base(model):
    assert held_mask(model, []) is None  # nothing held: the unmasked fast path
    mask = held_mask(model, ["cross:0:1", "encoder_self:1:0", "cross:0:1"])
    assert held_heads(model, ["cross:0:1", "cross:0:1"]) == [HeadId("cross", 0, 1)]
    assert heads_off(model, mask) == [HeadId("encoder_self", 1, 0), HeadId("cross", 0, 1)]
    assert float(sum(m.sum() for m in mask.values())) == 3 * 2 * 2 - 2
    more = held_mask(model, ["cross:0:1"], [HeadId("decoder_self", 0, 0)])
    assert heads_off(model, more) == [HeadId("decoder_self", 0, 0), HeadId("cross", 0, 1)]
    base = mask_without(model, [HeadId("encoder_self", 0, 0)])
    assert heads_off(model, held_mask(model, ["cross:0:1"], base=base)) == [
        HeadId("encoder_self", 0, 0),
        HeadId("cross", 0, 1),
    ]
    assert held_mask(model, [], base=base) == base


def test_a_per_example_base_gets_the_held_heads_in_every_row(model):
    base = {kind: torch.ones(3, *shape) for kind, shape in model.head_mask_shapes().items()}
    mask = held_mask(model, ["cross:1:0"], base=base)
    assert mask["cross"].shape == (3, 2, 2)
    assert torch.equal(mask["cross"][:, 1, 0], torch.zeros(3)) and float(mask["cross"].sum()) == 3 * 3
    assert heads_off(model, mask) == [HeadId("cross", 1, 0)]


def test_a_held_head_the_model_lacks_is_a_config_error_naming_the_key(model):
    with pytest.raises(ConfigError, match=r"train.mask_heads: head 'cross:0:2': head 2 is out of range"):
        held_mask(model, ["cross:0:2"])


def test_head_names_come_from_attention_sites_and_back(model):
    heads = head_ids(model)
    assert [str(h) for h in heads[:3]] == ["encoder_self:0:0", "encoder_self:0:1", "encoder_self:1:0"]
    assert [h.kind for h in heads[::4]] == ["encoder_self", "decoder_self", "cross"]  # kinds in forward order
    assert head_site(model, HeadId("cross", 1, 0)).name == "decoder.1.cross.z"
    assert head_site(model, HeadId("decoder_self", 0, 1)).name == "decoder.0.attn.z"
    site = model_sites(model)["decoder.1.cross.pattern"]
    assert HeadId.of(site, 1) == HeadId("cross", 1, 1) and str(parse_head_name("cross:1:1")) == "cross:1:1"
    with pytest.raises(UsageError, match="expected kind:layer:head"):
        parse_head_name("cross-1-1")
    with pytest.raises(ValueError, match="not an attention site"):
        HeadId.of(model_sites(model)["encoder.0.resid_pre"], 0)
