"""Dropout_p(x) = x * m / (1 - p), m_i ~ Bernoulli(1 - p) (Vaswani §5.4), with p realised on a grid of
2^-16 (2^-32 below 2^-7) and the scale taken from the realised rate."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnlab.kernels import dropout_masks as dropout_module
from attnlab.kernels.dropout_masks import SHORT_WORD_MIN_RATE, Dropout, dropout, keep_mask, realised_rate, word_bits

WORD_SOURCES = {"numpy (cpu)": dropout_module._numpy_words}


def _within_binomial_sd(rate: float, p: float, n: int, sds: float = 4.0) -> bool:
    return abs(rate - p) <= sds * (p * (1 - p) / n) ** 0.5


@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_every_entry_is_dropped_or_scaled_by_the_realised_rate(p, dtype):
    torch.manual_seed(0)
    x = torch.rand(64, 128, dtype=dtype) + 0.5  # no zeros, so a zero output means "dropped"
    out = dropout(x, p, True)
    assert out.dtype == dtype and out.shape == x.shape
    kept = out != 0
    torch.testing.assert_close(out[kept], (x / (1 - realised_rate(p)))[kept])
    assert _within_binomial_sd(1 - kept.double().mean().item(), p, x.numel(), sds=4.0)


@pytest.mark.parametrize("source", WORD_SOURCES)
@pytest.mark.parametrize("p", [0.1, 0.3, 0.999, 0.002, 1e-4])  # 16-bit words, then 32-bit
def test_drop_rate_is_the_realised_rate(source, p, monkeypatch):
    # 2M entries: 4 binomial s.d. are 0.0008 at p = 0.1, 2.8e-5 at p = 1e-4.
    monkeypatch.setattr(dropout_module, "_numpy_words", WORD_SOURCES[source])
    torch.manual_seed(0)
    dropped = 1 - keep_mask((2_000_000,), p).double().mean().item()
    assert _within_binomial_sd(dropped, realised_rate(p), 2_000_000)


@pytest.mark.parametrize("p", [0.1, 0.3, 0.999])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_keep_rate_of_16_bit_inputs_is_one_minus_p(p, dtype):
    # Noise drawn in bfloat16 (256 levels in [0, 1)) had kept 0.898 at p = 0.1 and nothing at
    # p = 0.999: the words do not depend on the input's dtype.
    torch.manual_seed(0)
    x = torch.ones(1_000_000, dtype=dtype)
    kept = (dropout(x, p, True) != 0).double().mean().item()
    assert _within_binomial_sd(1 - kept, p, x.numel())


@pytest.mark.parametrize("source", WORD_SOURCES)
@pytest.mark.parametrize("bits", [16, 32])
def test_words_are_uniform_and_neighbours_independent(source, bits):
    # Four 16-bit words (two 32-bit ones) share each 64-bit draw: each bit must be a fair coin, and
    # neighbouring words (in one draw and across draws) uncorrelated.
    torch.manual_seed(0)
    n = 400_000
    words = WORD_SOURCES[source]((n,), bits).long()
    bit_rates = torch.stack([((words >> b) & 1).double().mean() for b in range(bits)])
    assert (bit_rates - 0.5).abs().max().item() < 4 * (0.25 / n) ** 0.5
    for lag in (1, 2, 3, 4):
        a, b = words[:-lag].double(), words[lag:].double()
        correlation = torch.corrcoef(torch.stack([a, b]))[0, 1].item()
        assert abs(correlation) < 4 / (n - lag) ** 0.5


def test_torch_seed_fixes_the_mask_and_each_call_draws_a_new_one():
    torch.manual_seed(3)
    first, second = keep_mask((4096,), 0.5), keep_mask((4096,), 0.5)
    torch.manual_seed(3)
    assert torch.equal(keep_mask((4096,), 0.5), first)
    assert not torch.equal(first, second)
    torch.manual_seed(4)
    assert not torch.equal(keep_mask((4096,), 0.5), first)


def test_saved_rng_state_replays_the_masks():
    torch.manual_seed(0)
    state = torch.get_rng_state()
    masks = [keep_mask((8, 33), 0.2) for _ in range(3)]
    torch.set_rng_state(state)
    assert all(torch.equal(keep_mask((8, 33), 0.2), mask) for mask in masks)


@given(st.floats(min_value=0.0, max_value=0.9999, allow_nan=False))
def test_realised_rate_is_p_on_the_word_grid(p):
    bits = word_bits(p)
    assert bits == (16 if p >= SHORT_WORD_MIN_RATE else 32)
    rate = realised_rate(p)
    assert abs(rate - p) <= 2 ** -(bits + 1)
    assert (rate * 2**bits).is_integer() and 0.0 <= rate < 1.0
    if p >= SHORT_WORD_MIN_RATE:
        assert abs(rate - p) <= 1e-3 * p  # 0.1% of the rate at worst


def test_expectation_is_the_input():
    torch.manual_seed(0)
    x = torch.randn(8, dtype=torch.float64)
    mean = torch.stack([dropout(x, 0.3, True) for _ in range(20000)]).mean(0)
    torch.testing.assert_close(mean, x, atol=0.03, rtol=0)


def test_gradient_is_the_same_mask():
    torch.manual_seed(0)
    x = (torch.rand(32, 16, dtype=torch.float64) + 0.5).requires_grad_()
    out = dropout(x, 0.25, True)
    out.sum().backward()
    torch.testing.assert_close(x.grad, (out != 0).double() / (1 - realised_rate(0.25)))


@pytest.mark.parametrize("shape", [(0,), (1,), (3,), (5, 7), (2, 3, 5)])
def test_any_entry_count_gets_a_mask_of_its_shape(shape):
    # Entry counts that do not fill the last 64-bit draw.
    assert keep_mask(shape, 0.1).shape == shape and keep_mask(shape, 0.001).shape == shape


def test_identity_in_eval_mode_or_at_zero_rate():
    x = torch.randn(4, 5)
    assert dropout(x, 0.5, False) is x and dropout(x, 0.0, True) is x
    module = Dropout(0.5).eval()
    assert module(x) is x


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5])
def test_rate_outside_the_unit_interval_is_rejected(p):
    with pytest.raises(ValueError, match="dropout"):
        Dropout(p)


def test_other_devices_take_pytorchs_dropout(monkeypatch):
    """Off the CPU, dropout is F.dropout (one fused kernel on the device); attnlab draws no words."""
    calls = []
    real = torch.nn.functional.dropout
    monkeypatch.setattr(torch.nn.functional, "dropout", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    monkeypatch.setattr(dropout_module, "scaled_keep_mask", lambda *a: pytest.fail("drew attnlab's words"))
    x = torch.empty(4, 5, device="meta")
    out = dropout(x, 0.25, True)
    assert out.shape == x.shape and out.device.type == "meta" and calls == [{"training": True}]
    assert dropout(x, 0.25, False) is x
