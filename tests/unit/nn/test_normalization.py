"""The norms of NORMS against Hugging Face's: RMSNorm as LlamaRMSNorm, Gemma's 1 + w RMSNorm as
Gemma2RMSNorm, bit for bit in float32, bfloat16 and float16."""

from __future__ import annotations

import pytest
import torch

from attnlab.nn.normalization import NORMS, make_norm

transformers = pytest.importorskip("transformers")


def _pair(name: str, hf_class, dtype: torch.dtype, seed: int = 0):
    torch.manual_seed(seed)
    ours = make_norm(name, 64, 1e-6)
    theirs = hf_class(64, eps=1e-6)
    with torch.no_grad():
        ours.weight.normal_(std=0.5)
        theirs.weight.copy_(ours.weight)
    return ours.to(dtype), theirs.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_equals_llama_rms_norm(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    ours, theirs = _pair("rms", LlamaRMSNorm, dtype)
    x = (torch.randn(4, 7, 64) * 3).to(dtype)
    assert torch.equal(ours(x), theirs(x))
    assert torch.equal(NORMS["rms"].apply(ours, x), theirs(x))  # the functional form Add & Norm calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_one_plus_equals_gemma2_rms_norm(dtype):
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    ours, theirs = _pair("rms_one_plus", Gemma2RMSNorm, dtype)
    x = (torch.randn(4, 7, 64) * 3).to(dtype)
    assert torch.equal(ours(x), theirs(x))
    assert torch.equal(NORMS["rms_one_plus"].apply(ours, x), theirs(x))


def test_rms_one_plus_starts_as_the_plain_rms_norm():
    ours, plain = make_norm("rms_one_plus", 16, 1e-6).double(), make_norm("rms", 16, 1e-6).double()
    assert torch.equal(ours.weight, torch.zeros(16, dtype=torch.float64))
    x = torch.randn(3, 16, dtype=torch.float64)
    torch.testing.assert_close(ours(x), plain(x), rtol=1e-15, atol=1e-15)
    assert set(dict(ours.named_parameters())) == {"weight"}
