"""attnlab's C++ CPU kernels: the same results as the PyTorch and NumPy paths they replace."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.nn import dropout as dropout_module
from attnlab.nn import linear as linear_module
from attnlab.nn import native
from attnlab.nn.dropout import dropout, keep_mask, realised_rate, signed_threshold, word_bits

pytestmark = pytest.mark.skipif(native.kernels() is None, reason=f"no C++ kernels: {native.unavailable_reason()}")


@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (64, 64), (65, 130), (2048, 256), (17, 1), (1, 300)])
def test_transpose_is_the_contiguous_transposed_copy(shape):
    x = torch.randn(shape)
    out = native.transpose(x)
    assert out.is_contiguous() and out.shape == (shape[1], shape[0])
    assert torch.equal(out, x.t().contiguous())


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 200), cols=st.integers(1, 200))
def test_transpose_property(rows, cols):
    x = torch.arange(rows * cols, dtype=torch.float32).view(rows, cols)
    assert torch.equal(native.transpose(x), x.t().contiguous())


def test_transpose_rejects_what_it_cannot_copy():
    with pytest.raises(RuntimeError, match="contiguous 2-D float32"):
        native.transpose(torch.randn(4, 5).t())
    with pytest.raises(RuntimeError, match="contiguous 2-D float32"):
        native.transpose(torch.randn(4, 5, dtype=torch.float64))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 0.002, 1e-4])  # 16-bit words, then 32-bit
@pytest.mark.parametrize("shape", [(1,), (7, 5), (3, 11, 13), (32, 64, 256), (0, 4)])
def test_scaled_mask_is_keep_mask_scaled_bit_for_bit(p, shape):
    scale = 1.0 / (1.0 - realised_rate(p))
    torch.manual_seed(3)
    expected = keep_mask(shape, p).to(torch.float32) * scale
    torch.manual_seed(3)
    seed = dropout_module._numpy_seed()
    got = native.scaled_keep_mask(shape, seed=seed, bits=word_bits(p), threshold=signed_threshold(p), scale=scale)
    assert got.dtype == torch.float32 and got.shape == torch.Size(shape)
    assert torch.equal(got, expected)


def test_scaled_mask_words_are_numpys_pcg64_stream():
    # All-keep threshold at the signed minimum, so the mask reads the scale everywhere, and a
    # threshold between two words read off NumPy's own draws: entry i is kept iff word i >= it.
    words = np.random.PCG64(123).random_raw(40).view(np.int16)[:157]
    threshold = int(np.median(words))
    got = native.scaled_keep_mask((157,), seed=123, bits=16, threshold=threshold, scale=2.0)
    assert torch.equal(got, torch.from_numpy((words >= threshold).astype(np.float32) * 2.0))


@pytest.mark.parametrize("p", [0.1, 0.003])
def test_dropout_gives_the_same_output_with_and_without_the_kernels(p, monkeypatch):
    x = torch.randn(4, 33, 17)
    torch.manual_seed(0)
    with_kernels = dropout(x, p, True)
    monkeypatch.setattr(native, "kernels", lambda: None)
    torch.manual_seed(0)
    assert torch.equal(dropout(x, p, True), with_kernels)


def test_weight_gradients_are_the_same_with_and_without_the_kernels(monkeypatch):
    if not linear_module.onednn_available():
        pytest.skip("no oneDNN")
    torch.manual_seed(0)
    kernel = linear_module.OneDNNLinear()
    grads = []
    for use_kernels in (True, False):
        if not use_kernels:
            monkeypatch.setattr(native, "kernels", lambda: None)
        for d_in, d_out in [(32, 96), (96, 32)]:  # both forms: (X^T G)^T and G^T X
            torch.manual_seed(d_in)
            x = torch.randn(5, 16, d_in)
            w = torch.randn(d_out, d_in, requires_grad=True)
            b = torch.randn(d_out, requires_grad=True)
            kernel(x, w, b).pow(2).sum().backward()
            grads.append(w.grad)
    for with_kernels, without in zip(grads[:2], grads[2:]):
        torch.testing.assert_close(with_kernels, without, rtol=0, atol=0)


def test_build_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("ATTNLAB_NATIVE", "0")
    module, reason = native._build.__wrapped__()
    assert module is None and "ATTNLAB_NATIVE=0" in reason
