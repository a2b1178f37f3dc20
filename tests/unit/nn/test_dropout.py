"""Dropout_p(x) = x * m / (1 - p), m_i ~ Bernoulli(1 - p) (Vaswani §5.4)."""

import pytest
import torch

from attnlab.nn.dropout import Dropout, dropout


@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_every_entry_is_dropped_or_scaled(p, dtype):
    torch.manual_seed(0)
    x = torch.rand(64, 128, dtype=dtype) + 0.5  # no zeros, so a zero output means "dropped"
    out = dropout(x, p, True)
    assert out.dtype == dtype and out.shape == x.shape
    kept = out != 0
    torch.testing.assert_close(out[kept], (x / (1 - p))[kept])
    keep_rate = kept.double().mean().item()
    assert abs(keep_rate - (1 - p)) < 4 * ((p * (1 - p)) / x.numel()) ** 0.5 + 1e-3  # 4 binomial s.d.


@pytest.mark.parametrize("p", [0.1, 0.3, 0.999])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_keep_rate_of_16_bit_inputs_is_one_minus_p(p, dtype):
    # bfloat16 noise has 256 levels in [0, 1): drawn in that dtype, p = 0.1 kept 0.898 and
    # p = 0.999 kept nothing. 1M entries put 4 binomial s.d. at 0.0012 (p = 0.1).
    torch.manual_seed(0)
    x = torch.ones(1_000_000, dtype=dtype)
    kept = (dropout(x, p, True) != 0).double().mean().item()
    assert abs(kept - (1 - p)) < 4 * ((p * (1 - p)) / x.numel()) ** 0.5


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
    torch.testing.assert_close(x.grad, (out != 0).double() / 0.75)


def test_identity_in_eval_mode_or_at_zero_rate():
    x = torch.randn(4, 5)
    assert dropout(x, 0.5, False) is x and dropout(x, 0.0, True) is x
    module = Dropout(0.5).eval()
    assert module(x) is x


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5])
def test_rate_outside_the_unit_interval_is_rejected(p):
    with pytest.raises(ValueError, match="dropout"):
        Dropout(p)
