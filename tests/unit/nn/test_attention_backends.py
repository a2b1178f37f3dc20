"""attnlab.nn.attention's backends: each equals the explicit formula wherever it applies (forced by
ATTNLAB_BACKEND), the selection returns only backends that apply, the override is checked, and a
measured selection leaves the caller's graph, random state and results as they were."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from attnlab.kernels import calibration, native
from attnlab.nn import attention_backends
from attnlab.nn.attention import attention
from attnlab.nn.attention_backends import BACKENDS, select_backend

attention_module = importlib.import_module("attnlab.nn.attention_backends")

NATIVE = pytest.mark.skipif(not native.available(), reason="attnlab's C++ kernels are not built")
FLOAT32_ONLY = {"short", "decode"}  # the C++ kernels run float32 alone


@pytest.fixture
def measured(monkeypatch, tmp_path):
    """Calibration on, with an empty cache of this test's own."""
    monkeypatch.setattr(calibration, "MEASURING", True)
    monkeypatch.setenv("ATTNLAB_CALIBRATION_DIR", str(tmp_path))
    calibration.forget()
    yield tmp_path
    calibration.forget()


def _case(t_q, t_k, mask_kind, *, with_bias=False, b=2, h=3, d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, t_q, d, generator=g, dtype=dtype)
    k, v = (torch.randn(b, h, t_k, d, generator=g, dtype=dtype) for _ in range(2))
    mask = {
        "none": None,
        "padding": torch.arange(t_k).expand(b, t_k).lt(torch.tensor([[t_k], [max(1, t_k - 2)]]))[:, None, None, :],
        "arbitrary": torch.rand(b, h, t_q, t_k, generator=g) < 0.6,
        "empty_row": torch.ones(b, 1, t_q, t_k, dtype=torch.bool).index_fill(2, torch.tensor([0]), False),
    }[mask_kind]
    bias = torch.randn(1, h, t_q, t_k, generator=g, dtype=dtype) if with_bias else None
    return q, k, v, mask, bias


def _explicit(q, k, v, mask, bias, causal):
    return attention(q, k, v, mask, causal=causal, bias=bias, return_weights=True)[0]  # weights: explicit only


@pytest.mark.parametrize("name", [pytest.param(n, marks=NATIVE if n in FLOAT32_ONLY else ()) for n in BACKENDS])
@pytest.mark.parametrize("mask_kind", ["none", "padding", "arbitrary", "empty_row"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(("t_q", "t_k"), [(1, 9), (3, 9), (9, 9)])
def test_every_backend_equals_the_explicit_formula_where_it_applies(
    monkeypatch, name, mask_kind, causal, with_bias, t_q, t_k
):
    """Forward and gradients, in float64 (float32 for the float32-only kernels, against a float64
    explicit reference); a backend that does not take the call is not selected."""
    dtype = torch.float32 if name in FLOAT32_ONLY else torch.float64
    q, k, v, mask, bias = _case(t_q, t_k, mask_kind, with_bias=with_bias, dtype=dtype)
    backend = BACKENDS[name]
    wants_grad = name != "decode"  # the decode kernel takes only calls without a gradient
    leaves = [t.clone().requires_grad_(wants_grad) for t in (q, k, v)]
    if not backend.applies(*leaves, mask, bias, 0.0, False, None):
        monkeypatch.setattr(attention_backends, "OVERRIDE", name)
        assert select_backend(*leaves, mask, bias, 0.0, False, None, causal=causal) is not backend
        return
    monkeypatch.setattr(attention_backends, "OVERRIDE", name)
    assert select_backend(*leaves, mask, bias, 0.0, False, None, causal=causal) is backend
    out = attention(*leaves, mask, causal=causal, bias=bias)
    monkeypatch.setattr(attention_backends, "OVERRIDE", None)
    reference_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected = _explicit(*reference_leaves, mask, None if bias is None else bias.double(), causal)
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-12, "rtol": 1e-10}
    torch.testing.assert_close(out.double(), expected, **tolerance)
    if wants_grad:
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        out.backward(grad.to(out.dtype))
        expected.backward(grad)
        for leaf, reference in zip(leaves, reference_leaves):
            torch.testing.assert_close(leaf.grad.double(), reference.grad, **tolerance)


def _calls():
    """Soft-attention calls of many kinds: (q, k, v, mask, bias, dropout_p, need_weights, score_fn, causal)."""
    g = torch.Generator().manual_seed(2)
    for t_q, t_k in [(1, 5), (2, 5), (6, 6), (4, 300)]:
        for mask_kind in ("none", "padding"):
            for with_bias in (False, True):
                for grad in (False, True):
                    q, k, v, mask, bias = _case(t_q, t_k, mask_kind, with_bias=with_bias, dtype=torch.float32)
                    q.requires_grad_(grad)
                    yield q, k, v, mask, bias, 0.0, False, None, t_q == t_k
    q = torch.randn(2, 3, 4, 8, generator=g)
    yield q, q, q, None, None, 0.1, False, None, False  # dropout
    yield q, q, q, None, None, 0.0, True, None, False  # the weights
    yield q, q, q, None, None, 0.0, False, lambda a, b: a @ b.transpose(-2, -1), False  # a custom score
    yield q.double(), q.double(), q.double(), None, None, 0.0, False, None, False


@pytest.mark.parametrize("forced", [None, *BACKENDS])
def test_the_selection_returns_only_a_backend_that_applies(measured, monkeypatch, forced):
    if forced is not None:
        monkeypatch.setattr(attention_backends, "OVERRIDE", forced)
    for q, k, v, mask, bias, dropout_p, need_weights, score_fn, causal in _calls():
        for _ in range(2):  # measured, then remembered
            backend = select_backend(q, k, v, mask, bias, dropout_p, need_weights, score_fn, causal=causal)
            assert backend.applies(q, k, v, mask, bias, dropout_p, need_weights, score_fn)
            if forced is not None and BACKENDS[forced].applies(q, k, v, mask, bias, dropout_p, need_weights, score_fn):
                assert backend.name == forced


def test_only_the_explicit_formula_returns_weights_or_takes_a_score():
    q = torch.randn(1, 2, 3, 4)
    score = lambda a, b: a @ b.transpose(-2, -1)  # noqa: E731
    assert [name for name, b in BACKENDS.items() if b.applies(q, q, q, None, None, 0.0, True, None)] == ["explicit"]
    assert [name for name, b in BACKENDS.items() if b.applies(q, q, q, None, None, 0.0, False, score)] == ["explicit"]


def test_an_unknown_override_names_the_variable_and_the_backends(monkeypatch):
    monkeypatch.setattr(attention_backends, "OVERRIDE", "flash")
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(
        ValueError, match=r"ATTNLAB_BACKEND: unknown 'flash'; allowed: auto, decode, explicit, native, sdpa, short"
    ):
        attention(q, q, q)


def test_a_measured_selection_leaves_graph_random_state_and_results_alone(measured):
    """The timing runs on detached tensors and draws no random number: the caller's graph has one
    attention call, the generator is where it was, and the output equals the fixed choice's."""
    q, k, v, mask, _ = _case(6, 6, "padding", dtype=torch.float32)
    q.requires_grad_()
    state = torch.get_rng_state()
    out = attention(q, k, v, mask)
    assert torch.equal(torch.get_rng_state(), state)
    assert calibration.CHOICES  # this call was measured
    (grad,) = torch.autograd.grad(out.sum(), q)
    assert q.grad is None and k.grad is None
    explicit = _explicit(q.detach().double(), k.double(), v.double(), mask, None, False)
    torch.testing.assert_close(out.double(), explicit, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(grad).all()


def test_nothing_is_measured_under_a_dispatch_mode_or_with_dropout(measured):
    q = torch.randn(2, 3, 6, 8)
    with FlopCounterMode(display=False):
        attention(q, q, q)
    attention(q, q, q, dropout_p=0.1)
    assert not calibration.CHOICES and not list(measured.iterdir())


def test_a_measured_class_is_remembered_and_looked_up(measured, monkeypatch):
    q = torch.randn(2, 3, 6, 8)
    attention(q, q, q)
    assert len(calibration.CHOICES) == 1
    timings = []
    monkeypatch.setattr(
        calibration, "measure", lambda candidates, tie=None: timings.append(1) or next(iter(candidates))
    )
    attention(torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8))  # 5 rounds up to 8, as 6
    assert not timings and len(calibration.CHOICES) == 1
    attention(torch.randn(2, 3, 9, 8), torch.randn(2, 3, 9, 8), torch.randn(2, 3, 9, 8))  # another class
    assert timings == [1] and len(calibration.CHOICES) == 2


def test_a_models_backend_is_resolved_once_when_it_is_built(monkeypatch):
    """MultiHeadAttention reads the override ATTNLAB_BACKEND when it is built, never per call: a
    variable set (even to nonsense) after that changes nothing; set_attention_backend is the one
    place the setting of a built model changes, checked like the variable."""
    from attnlab.nn import DecoderOnly, DecoderOnlyConfig
    from attnlab.nn.multi_head import MultiHeadAttention, set_attention_backend

    monkeypatch.setattr(attention_backends, "OVERRIDE", "explicit")
    torch.manual_seed(0)
    model = DecoderOnly(DecoderOnlyConfig(vocab_size=20, layers=2, d_model=16, heads=2, d_ff=32, dropout=0.0)).eval()
    attentions = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    assert attentions and {m.backend for m in attentions} == {"explicit"}
    monkeypatch.setattr(attention_backends, "OVERRIDE", None)
    assert MultiHeadAttention(16, 2).backend == "auto"
    assert MultiHeadAttention(16, 2, backend="sdpa").backend == "sdpa"
    tokens = torch.randint(1, 20, (2, 7))
    picked = []
    real = attention_module.select_backend

    def spy(*args, **kwargs):  # noqa: ANN202
        backend = real(*args, **kwargs)
        picked.append(backend.name)
        return backend

    monkeypatch.setattr(attention_module, "select_backend", spy)
    monkeypatch.setattr(attention_backends, "OVERRIDE", "flash")  # would be an error if it were read now
    with torch.no_grad():
        expected = model(tokens)
        assert set(picked) == {"explicit"}
        picked.clear()
        set_attention_backend(model, "sdpa")
        assert {m.backend for m in attentions} == {"sdpa"}
        torch.testing.assert_close(model(tokens), expected, atol=1e-5, rtol=1e-5)
        assert set(picked) == {"sdpa"}
    with pytest.raises(ValueError, match=r"attention backend: unknown 'flash'; allowed: auto, decode"):
        set_attention_backend(model, "flash")
    with pytest.raises(ValueError, match=r"attention backend: unknown 'flash'"):
        MultiHeadAttention(16, 2, backend="flash")


def test_runtime_settings_are_applied_once_and_native_forces_attnlabs_kernels():
    """apply_runtime sets every attention module's setting and the model's kernel record; ``native``
    takes attnlab's kernel where one applies (short heads without a mask) and falls back where none
    does (a mask), with the same outputs as the explicit formula."""
    from attnlab.kernels.calibration import KernelRecord
    from attnlab.nn import DecoderOnly, DecoderOnlyConfig
    from attnlab.nn.multi_head import MultiHeadAttention
    from attnlab.nn.runtime_config import RuntimeConfig, apply_runtime

    torch.manual_seed(0)
    model = DecoderOnly(DecoderOnlyConfig(vocab_size=20, layers=2, d_model=16, heads=2, d_ff=32, dropout=0.0)).eval()
    tokens = torch.randint(1, 20, (2, 7))
    with torch.no_grad():
        record = apply_runtime(model, RuntimeConfig(attention="explicit", kernels="measured"))
        expected = model(tokens)
        assert isinstance(record, KernelRecord) and record.mode == "measured" and model.kernel_record is record
        apply_runtime(model, RuntimeConfig(attention="native"), record=record)
        assert {m.backend for m in model.modules() if isinstance(m, MultiHeadAttention)} == {"native"}
        torch.testing.assert_close(model(tokens), expected, atol=1e-5, rtol=1e-5)
    q, k, v = (torch.randn(2, 2, 6, 8) for _ in range(3))
    short = select_backend(q, k, v, None, None, 0.0, False, None, causal=True, backend="native")
    assert short.name == ("short" if native.available() else "sdpa")
    masked = select_backend(q, k, v, torch.ones(6, 6, dtype=torch.bool), None, 0.0, False, None, backend="native")
    assert masked.name not in ("short", "decode")
    with pytest.raises(ValueError, match=r"runtime.attention: unknown 'flash'"):
        RuntimeConfig(attention="flash")
