"""Positional encodings (Vaswani §3.5; Hahn §3 f(v_i, p_i); Agarwal §6.3)."""

from __future__ import annotations

import math

import pytest
import torch

from attnlab.nn.positional import POSITIONAL, GehringJoint, GehringSum, make_positional, sinusoidal_table


def test_sinusoidal_formula():
    table = sinusoidal_table(50, 12)
    for pos in (0, 1, 7, 49):
        for i in range(6):
            angle = pos / 10000 ** (2 * i / 12)
            assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def test_sinusoidal_odd_width_and_offset():
    table = sinusoidal_table(10, 7)
    assert table.shape == (10, 7)
    torch.testing.assert_close(sinusoidal_table(4, 7, offset=6), table[6:])


def test_sinusoidal_extrapolates_past_max_len():
    enc = make_positional("sinusoidal", d_model=8, max_len=5)
    x = torch.zeros(1, 9, 8)
    torch.testing.assert_close(enc(x)[0], sinusoidal_table(9, 8))


def _float64_formula(positions: range, dim: int) -> torch.Tensor:
    return torch.tensor(
        [
            [(math.sin if j % 2 == 0 else math.cos)(n / 10000 ** ((j - j % 2) / dim)) for j in range(dim)]
            for n in positions
        ],
        dtype=torch.float64,
    )


@pytest.mark.parametrize("combine", ["add", "concat"])
def test_float64_module_has_float64_accurate_positions(combine):
    # Casting a float32 table to float64 would leave errors of about 3e-8.
    enc = make_positional("sinusoidal", d_model=16, max_len=40, combine=combine, positional_dim=8).double()
    x = torch.zeros(1, 60, enc.token_dim, dtype=torch.float64)  # past max_len: the extrapolated rows too
    out = enc(x)[0]
    positions = out if combine == "add" else out[:, enc.token_dim :]  # [v_i; p_i]
    assert positions.dtype == torch.float64 and positions.shape == (60, 16 if combine == "add" else 8)
    torch.testing.assert_close(positions, _float64_formula(range(60), positions.shape[1]), atol=1e-15, rtol=0)


def test_float32_after_float64_round_trip_is_the_float32_table():
    enc = make_positional("sinusoidal", d_model=8, max_len=30).double().float()
    torch.testing.assert_close(enc(torch.zeros(1, 30, 8))[0], sinusoidal_table(30, 8), atol=0, rtol=0)


@pytest.mark.parametrize("name", sorted(POSITIONAL))
@pytest.mark.parametrize("combine", ["add", "concat"])
def test_every_encoding_maps_token_dim_to_d_model(name, combine):
    enc = make_positional(name, d_model=16, max_len=20, combine=combine, positional_dim=6)
    x = torch.randn(3, 11, enc.token_dim)
    assert enc(x).shape == (3, 11, 16)
    if combine == "concat" and name in ("sinusoidal", "learned"):
        assert enc.token_dim == 10
        torch.testing.assert_close(enc(x)[..., :10], x)  # token part untouched


@pytest.mark.parametrize("name", ["sinusoidal", "learned", "gehring_joint", "gehring_sum"])
def test_offset_matches_slice(name):
    enc = make_positional(name, d_model=16, max_len=20)
    x = torch.randn(2, 9, 16)
    torch.testing.assert_close(enc(x[:, 4:], offset=4), enc(x)[:, 4:])


def test_positions_break_permutation_symmetry():
    enc = make_positional("sinusoidal", d_model=16, max_len=20)
    x = torch.randn(1, 1, 16).expand(1, 5, 16)  # the same token five times
    out = enc(x)
    assert not torch.allclose(out[:, 0], out[:, 1])
    assert torch.equal(make_positional("none", d_model=16, max_len=20)(x), x)


def test_gehring_joint_formula():
    """z_n = ReLU(x_n W_x + e_n W_e) W_z with e_n one-hot (Agarwal §6.3)."""
    enc = GehringJoint(8, max_len=10, hidden=5)
    x = torch.randn(2, 4, 8)
    one_hot = torch.eye(10)[:4]  # e_1..e_4
    expected = torch.relu(x @ enc.w_x.weight.T + one_hot @ enc.w_e.weight) @ enc.w_z.weight.T
    torch.testing.assert_close(enc(x), expected)


def test_gehring_sum_formula():
    """z_n = ReLU(x_n W_x) W_zx + ReLU(e_n W_e) W_ze (Agarwal §6.3)."""
    enc = GehringSum(8, max_len=10, hidden=5)
    x = torch.randn(2, 4, 8)
    one_hot = torch.eye(10)[:4]
    expected = (
        torch.relu(x @ enc.w_x.weight.T) @ enc.w_zx.weight.T + torch.relu(one_hot @ enc.w_e.weight) @ enc.w_ze.weight.T
    )
    torch.testing.assert_close(enc(x), expected)


def test_learned_positions_reject_overlong_input():
    enc = make_positional("learned", d_model=8, max_len=5)
    with pytest.raises(ValueError, match="exceeds max_len=5"):
        enc(torch.zeros(1, 6, 8))


def test_bad_options():
    with pytest.raises(ValueError, match="positional: unknown 'rotary'"):
        make_positional("rotary", d_model=8, max_len=5)
    with pytest.raises(ValueError, match="positional_combine"):
        make_positional("learned", d_model=8, max_len=5, combine="multiply")
    with pytest.raises(ValueError, match="positional_dim"):
        make_positional("learned", d_model=8, max_len=5, combine="concat", positional_dim=8)
