"""The mask convention: bool, True = may attend (Agarwal Def. 5.2; Li's slides)."""

from __future__ import annotations

import pytest
import torch

from attnlab.nn.masks import causal_mask, check_mask, combine_masks, lengths_to_padding_mask, padding_mask


def test_causal_mask_is_lower_triangular():
    assert torch.equal(causal_mask(4)[0, 0], torch.tril(torch.ones(4, 4, dtype=torch.bool)))


def test_causal_mask_bottom_right_for_cache():
    m = causal_mask(2, 5)[0, 0]
    assert m.tolist() == [[True, True, True, True, False], [True] * 5]


def test_padding_masks():
    m = lengths_to_padding_mask(torch.tensor([2, 4]), 4)
    assert m.shape == (2, 1, 1, 4)
    assert m[:, 0, 0].tolist() == [[True, True, False, False], [True] * 4]
    assert torch.equal(padding_mask(m[:, 0, 0]), m)
    with pytest.raises(ValueError):
        lengths_to_padding_mask(torch.tensor([5]), 4)


def test_combine_masks():
    a = causal_mask(3)
    b = lengths_to_padding_mask(torch.tensor([2]), 3)
    assert torch.equal(combine_masks(a, None, b), a & b)
    assert combine_masks(None, None) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.uint8, torch.float16])
def test_check_mask_rejects_non_bool(dtype):
    with pytest.raises(TypeError, match="must be a torch.bool tensor"):
        check_mask(torch.ones(3, 3, dtype=dtype), 3, 3)


def test_check_mask_shapes():
    assert check_mask(torch.ones(2, 1, 1, 5, dtype=torch.bool), 3, 5) is not None
    with pytest.raises(ValueError, match="does not broadcast"):
        check_mask(torch.ones(3, 4, dtype=torch.bool), 3, 5)
