"""Rotary position embeddings: equal to Hugging Face's Llama rotary code, relative, cache-safe."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.nn.rotary import RotaryEmbedding, positions_of_tokens, rotate_half

transformers = pytest.importorskip("transformers")


def _hf_rotary(head_dim: int, base: float, positions: torch.Tensor, x: torch.Tensor):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2, rope_theta=base, head_dim=head_dim)
    config.rope_parameters = {"rope_type": "default", "rope_theta": base}
    cos, sin = LlamaRotaryEmbedding(config)(x, positions)
    return apply_rotary_pos_emb(x, x, cos, sin)[0]


@pytest.mark.parametrize("base", [10000.0, 100000.0])
@pytest.mark.parametrize("head_dim", [8, 64])
def test_equals_hugging_face_llama(base: float, head_dim: int) -> None:
    torch.manual_seed(0)
    q = torch.randn(2, 3, 40, head_dim)
    positions = torch.stack([torch.arange(40), torch.arange(100, 140)])  # (B, T), two offsets
    ours, _ = RotaryEmbedding(head_dim, base)(q, q[:, :1], positions)
    assert torch.equal(ours, _hf_rotary(head_dim, base, positions, q))


def test_scores_depend_on_relative_position_only() -> None:
    torch.manual_seed(1)
    rope = RotaryEmbedding(16, 10000.0).double()
    rope.inv_freq = rope.inv_freq.double()
    q, k = torch.randn(1, 1, 1, 16, dtype=torch.float64), torch.randn(1, 1, 1, 16, dtype=torch.float64)

    def score(m: int, n: int) -> float:
        q_m, _ = rope(q, k, torch.tensor([m]))
        _, k_n = rope(q, k, torch.tensor([n]))
        return float((q_m * k_n).sum())

    assert score(7, 3) == pytest.approx(score(107, 103), abs=1e-9)
    assert score(7, 3) != pytest.approx(score(7, 4), abs=1e-6)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 300), st.integers(1, 12))
def test_a_cached_step_equals_the_whole_sequence(offset: int, length: int) -> None:
    """Rotating positions offset..offset+length-1 at once or one at a time gives the same keys
    (the table grows between calls)."""
    torch.manual_seed(2)
    x = torch.randn(1, 2, length, 8)
    rope = RotaryEmbedding(8)
    positions = torch.arange(offset, offset + length)
    whole, _ = rope(x, x, positions)
    steps = [RotaryEmbedding(8)(x[:, :, i : i + 1], x[:, :, :1], positions[i : i + 1])[0] for i in range(length)]
    assert torch.allclose(whole, torch.cat(steps, dim=2), atol=1e-6)


def test_rotate_half_is_a_quarter_turn() -> None:
    x = torch.arange(6.0)
    assert torch.equal(rotate_half(x), torch.tensor([-3.0, -4.0, -5.0, 0.0, 1.0, 2.0]))
    assert torch.equal(rotate_half(rotate_half(x)), -x)


def test_positions_count_real_tokens_only() -> None:
    is_token = torch.tensor([[False, False, True, True, True], [True, True, True, True, True]])
    assert positions_of_tokens(is_token, 5).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]
    assert positions_of_tokens(is_token, 2).tolist() == [[1, 2], [3, 4]]


@pytest.mark.parametrize("head_dim, base", [(7, 10000.0), (8, 0.0)])
def test_invalid_settings_are_named(head_dim: int, base: float) -> None:
    with pytest.raises(ValueError, match="rope"):
        RotaryEmbedding(head_dim, base)
