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


SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn_mscale": {
        "type": "yarn",  # the older files' key
        "factor": 8.0,
        "original_max_position_embeddings": 32,
        "beta_fast": 16,
        "beta_slow": 2,
        "mscale": 0.9,
        "mscale_all_dim": 0.7,
    },
}


@pytest.mark.parametrize("name", list(SCALINGS))
@pytest.mark.parametrize("d_rot", [16, 64])
def test_scalings_equal_hugging_faces_rope_init_functions(name: str, d_rot: int) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from attnlab.nn.rotary import rope_frequencies

    params = SCALINGS[name]
    hf_params = {k: v for k, v in params.items() if k != "type"}
    hf_params.update(rope_type=params.get("rope_type", params.get("type")), rope_theta=50000.0)
    config = LlamaConfig(hidden_size=4 * d_rot, num_attention_heads=4, head_dim=d_rot, max_position_embeddings=256)
    config.rope_parameters = hf_params
    expected, expected_factor = ROPE_INIT_FUNCTIONS[hf_params["rope_type"]](config, "cpu")
    ours, factor = rope_frequencies(50000.0, d_rot, params)
    assert torch.equal(ours, expected)
    assert factor == pytest.approx(expected_factor, rel=1e-15)
    assert (factor != 1.0) == name.startswith("yarn")  # only YaRN scales the cosines and sines


def test_the_attention_factor_multiplies_the_cosines_and_sines() -> None:
    torch.manual_seed(4)
    x = torch.randn(1, 2, 5, 8)
    positions = torch.arange(5)
    plain, _ = RotaryEmbedding(8, 100.0)(x, x, positions)
    rope = RotaryEmbedding(
        8, 100.0, scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2}
    )
    rope.inv_freq = RotaryEmbedding(8, 100.0).inv_freq  # the same angles: only the factor differs
    scaled, _ = rope(x, x, positions)
    assert rope.attention_factor == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1.0)
    torch.testing.assert_close(scaled, plain * rope.attention_factor)


@pytest.mark.parametrize(
    "scaling, match",
    [
        ({"rope_type": "dynamic", "factor": 2.0}, "unknown type 'dynamic'; supported: default, linear, llama3, yarn"),
        ({"factor": 2.0}, "rope_type"),
        ({"rope_type": "llama3", "factor": 2.0}, "'low_freq_factor'"),
        ({"rope_type": "linear", "factor": "2"}, "'factor' must be a number"),
    ],
)
def test_bad_scalings_name_rope_scaling(scaling: dict, match: str) -> None:
    with pytest.raises(ValueError, match="rope_scaling") as error:
        RotaryEmbedding(8, 100.0, scaling=scaling)
    assert match in str(error.value)


@pytest.mark.parametrize("fraction", [0.25, 0.5, 1.0])
def test_partial_rotary_equals_hugging_face_gpt_neox(fraction: float) -> None:
    from transformers import GPTNeoXConfig
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding, apply_rotary_pos_emb

    torch.manual_seed(5)
    head_dim, base = 16, 10000.0
    config = GPTNeoXConfig(hidden_size=4 * head_dim, num_attention_heads=4)
    config.rope_parameters = {"rope_type": "default", "rope_theta": base, "partial_rotary_factor": fraction}
    q, k = torch.randn(2, 4, 9, head_dim), torch.randn(2, 4, 9, head_dim)
    positions = torch.stack([torch.arange(9), torch.arange(3, 12)])
    rotated = int(head_dim * fraction)
    cos, sin = GPTNeoXRotaryEmbedding(config)(q, positions)
    assert cos.shape[-1] == rotated
    q_rot, k_rot = apply_rotary_pos_emb(q[..., :rotated], k[..., :rotated], cos, sin)
    expected_q, expected_k = torch.cat((q_rot, q[..., rotated:]), -1), torch.cat((k_rot, k[..., rotated:]), -1)
    ours_q, ours_k = RotaryEmbedding(head_dim, base, fraction=fraction)(q, k, positions)
    assert torch.equal(ours_q, expected_q) and torch.equal(ours_k, expected_k)


@pytest.mark.parametrize("fraction", [0.1, 0.0, 1.5])
def test_a_partial_rotary_width_must_be_even_and_positive(fraction: float) -> None:
    with pytest.raises(ValueError, match="rotated width"):
        RotaryEmbedding(16, fraction=fraction)
