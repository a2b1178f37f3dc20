"""attnlab.kernels.linear: every GEMM kernel computes x W^T + b and its three gradients like a float64
reference; the oneDNN kernel's routes (row threshold, dtypes, grad modes) and the kernel choice."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.kernels import calibration
from attnlab.kernels.linear import (
    LINEAR_KERNELS,
    MIN_ONEDNN_ROWS,
    MeasuredLinear,
    OneDNNLinear,
    linear_kernel,
    linear_setting,
    onednn_available,
    packed_weights,
)
from attnlab.nn import EncoderDecoder, EncoderDecoderConfig

linear_module = importlib.import_module("attnlab.kernels.linear")

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this PyTorch build has no oneDNN")
KERNELS = [pytest.param(name, marks=needs_onednn if name == "onednn" else ()) for name in (*LINEAR_KERNELS, "auto")]


def _float64_reference(x, weight, bias, grad):
    """Output and gradients of x W^T + b in float64 autograd."""
    leaves = [t.detach().double().requires_grad_() for t in (x, weight)] + (
        [] if bias is None else [bias.detach().double().requires_grad_()]
    )
    out = F.linear(leaves[0], leaves[1], leaves[2] if bias is not None else None)
    out.backward(grad.double())
    return out.detach(), [leaf.grad for leaf in leaves]


def _assert_matches_reference(kernel, x, weight, bias, *, rtol=1e-5):
    inputs = [t.detach().clone().requires_grad_() for t in (x, weight)] + (
        [] if bias is None else [bias.detach().clone().requires_grad_()]
    )
    out = kernel(inputs[0], inputs[1], inputs[2] if bias is not None else None)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    out.backward(grad)
    expected, expected_grads = _float64_reference(x, weight, bias, grad)
    assert out.shape == expected.shape and out.dtype == x.dtype

    def close(actual, wanted):
        scale = wanted.abs().max().item() if wanted.numel() else 1.0
        torch.testing.assert_close(actual.double(), wanted, atol=rtol * max(scale, 1.0), rtol=0)

    close(out.detach(), expected)
    for leaf, wanted in zip(inputs, expected_grads):
        assert leaf.grad is not None and leaf.grad.shape == leaf.shape
        close(leaf.grad, wanted)


@pytest.mark.parametrize("kernel_name", KERNELS)
@pytest.mark.parametrize("rows", [1, MIN_ONEDNN_ROWS - 1, MIN_ONEDNN_ROWS, 64])
@pytest.mark.parametrize("d_in,d_out", [(16, 48), (48, 16)])  # both layouts of dL/dW on oneDNN
@pytest.mark.parametrize("with_bias", [True, False])
def test_forward_and_gradients_match_float64(kernel_name, rows, d_in, d_out, with_bias):
    g = torch.Generator().manual_seed(rows + d_in)
    x = torch.randn(rows, d_in, generator=g)
    weight = torch.randn(d_out, d_in, generator=g) / d_in**0.5
    bias = torch.randn(d_out, generator=g) if with_bias else None
    _assert_matches_reference(linear_kernel(kernel_name), x, weight, bias)


@pytest.mark.parametrize("kernel_name", KERNELS)
def test_batched_strided_inputs_and_weight_views(kernel_name):
    """(B, T, d) inputs, a transposed (non-contiguous) input, and row slices of a fused weight,
    as MultiHeadAttention passes them (W^Q = in_proj_weight[:qk])."""
    g = torch.Generator().manual_seed(0)
    fused = torch.randn(96, 32, generator=g) / 32**0.5
    x = torch.randn(5, 32, 7, generator=g).transpose(1, 2)  # (5, 7, 32), not contiguous
    _assert_matches_reference(linear_kernel(kernel_name), x, fused[32:96], torch.randn(96, generator=g)[32:96])


@needs_onednn
@pytest.mark.parametrize(
    "needs", [(True, False, False), (False, True, True), (False, False, True), (True, True, False)]
)
def test_onednn_gradients_for_any_subset_of_leaves(needs):
    """Frozen weights, frozen inputs, a trainable bias alone: only the asked-for gradients exist."""
    g = torch.Generator().manual_seed(2)
    x, weight, bias = torch.randn(8, 12, generator=g), torch.randn(20, 12, generator=g), torch.randn(20, generator=g)
    leaves = [t.requires_grad_(flag) for t, flag in zip((x, weight, bias), needs)]
    out = OneDNNLinear()(*leaves)
    out.sum().backward()
    for leaf, flag, wanted in zip(
        leaves, needs, (torch.ones(8, 20) @ weight.detach(), torch.ones(20, 8) @ x.detach(), torch.full((20,), 8.0))
    ):
        assert (leaf.grad is not None) == flag
        if flag:
            torch.testing.assert_close(leaf.grad, wanted, atol=1e-5, rtol=1e-5)


@needs_onednn
@pytest.mark.parametrize("asked", ["x", "weight", "all"])
def test_onednn_computes_only_the_gradients_the_backward_uses(monkeypatch, asked):
    """autograd.grad(loss, [x]) on a model whose weights require grad (head importance asks for
    dL/dxi alone) must not spend GEMMs on dL/dW, and .backward() still fills every gradient."""
    computed = []
    real = linear_module._weight_gradient
    monkeypatch.setattr(linear_module, "_weight_gradient", lambda *a: computed.append(1) or real(*a))
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 8, generator=g, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(10, 8, generator=g))
    fused = torch.nn.Parameter(torch.randn(20, 8, generator=g))  # a view's gradient flows to its base
    out = OneDNNLinear()(x * 2, weight, None) + OneDNNLinear()(x, fused[10:], None)
    if asked == "all":
        out.square().sum().backward()
        assert len(computed) == 2 and weight.grad is not None and fused.grad is not None and x.grad is not None
        return
    inputs = {"x": [x], "weight": [weight]}[asked]
    (grad,) = torch.autograd.grad(out.square().sum(), inputs)
    assert len(computed) == (0 if asked == "x" else 1)
    reference = [t.detach().requires_grad_() for t in (x, weight, fused)]
    ref_out = (2 * reference[0]) @ reference[1].t() + reference[0] @ reference[2][10:].t()
    ref_grad = torch.autograd.grad(ref_out.square().sum(), [reference[0] if asked == "x" else reference[1]])[0]
    torch.testing.assert_close(grad, ref_grad, atol=1e-4, rtol=1e-4)


@needs_onednn
def test_onednn_without_grad_equals_with_grad():
    g = torch.Generator().manual_seed(3)
    x, weight, bias = torch.randn(2, 9, 24, generator=g), torch.randn(40, 24, generator=g), torch.randn(40, generator=g)
    with torch.no_grad():
        plain = OneDNNLinear()(x, weight, bias)
    tracked = OneDNNLinear()(x, weight.requires_grad_(), bias)
    assert tracked.requires_grad
    torch.testing.assert_close(plain, tracked.detach(), atol=1e-5, rtol=1e-5)  # packed and plain layouts


@needs_onednn
@pytest.mark.parametrize("case", ["float64", "few_rows", "no_rows"])
def test_onednn_routes_other_tensors_away_from_onednn(monkeypatch, case):
    """float64 has no oneDNN kernel, and fewer than MIN_ONEDNN_ROWS rows run faster elsewhere (the
    native kernel, tested in test_native.py): neither calls oneDNN."""
    calls = []
    real = linear_module._onednn_matmul
    monkeypatch.setattr(linear_module, "_onednn_matmul", lambda *a: calls.append(1) or real(*a))
    dtype = {"float64": torch.float64}.get(case, torch.float32)
    rows = {"few_rows": MIN_ONEDNN_ROWS - 1, "no_rows": 0}.get(case, 16)
    x, weight, bias = torch.randn(rows, 8, dtype=dtype), torch.randn(5, 8, dtype=dtype), torch.randn(5, dtype=dtype)
    out = OneDNNLinear()(x, weight, bias)
    assert not calls
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    OneDNNLinear()(torch.randn(16, 8), torch.randn(5, 8), None)
    assert calls  # float32 with enough rows does go to oneDNN


@needs_onednn
@pytest.mark.parametrize("grad", [False, True])
def test_bfloat16_maps_run_on_onednn_packed_for_inference_only(monkeypatch, grad):
    """A bfloat16 map without a gradient runs on oneDNN where the processor has bfloat16 there,
    its weight packed at the second use, equal to PyTorch's bfloat16 product to bfloat16 rounding;
    with a gradient (or without the processor's support) it is F.linear's."""
    calls = []
    real = linear_module._onednn_matmul
    monkeypatch.setattr(linear_module, "_onednn_matmul", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(8)
    x = torch.randn(8, 64, generator=g).bfloat16().requires_grad_(grad)
    weight, bias = torch.randn(48, 64, generator=g).bfloat16(), torch.randn(48, generator=g).bfloat16()
    kernel = OneDNNLinear()
    with packed_weights():
        for _ in range(3):
            out = kernel(x, weight, bias)
            assert out.dtype == torch.bfloat16
            torch.testing.assert_close(out.detach().double(), F.linear(x.detach(), weight, bias).double(),
                                       rtol=2**-7, atol=2e-2)  # fmt: skip
        on_onednn = linear_module.onednn_bf16_available() and not grad
        assert bool(calls) == on_onednn
        assert any(entry.packed is not None for entry in kernel._packed.values()) == on_onednn


@needs_onednn
@pytest.mark.parametrize("grad", [True, False])
def test_onednn_leaves_mixed_precision_to_autocast(grad):
    """Inside torch.autocast the map runs as F.linear does there (bf16 GEMM, bf16 output), not in
    float32 behind autocast's back: train.precision = "bf16" must mean bf16 linear maps."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(8, 16, generator=g, requires_grad=grad)
    weight, bias = torch.randn(12, 16, generator=g), torch.randn(12, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, expected = OneDNNLinear()(x, weight, bias), F.linear(x, weight, bias)
    assert out.dtype == expected.dtype == torch.bfloat16
    assert torch.equal(out, expected)


@needs_onednn
def test_a_model_under_autocast_computes_its_maps_in_bf16(monkeypatch):
    monkeypatch.setenv("ATTNLAB_LINEAR", "onednn")
    config = EncoderDecoderConfig(vocab_size=40, layers=1, d_model=32, heads=4, d_ff=64)
    model = EncoderDecoder(config)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(torch.randint(1, 40, (3, 9)), torch.randint(1, 40, (3, 7)))
    assert logits.dtype == torch.bfloat16  # the output layer, like every map before it, ran in bf16


@needs_onednn
@settings(max_examples=60, deadline=None)
@given(
    lead=st.lists(st.integers(0, 9), min_size=1, max_size=3),
    d_in=st.integers(1, 40),
    d_out=st.integers(1, 40),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_onednn_property_any_shape_matches_float64(lead, d_in, d_out, with_bias, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, d_in, generator=g)
    weight = torch.randn(d_out, d_in, generator=g)
    bias = torch.randn(d_out, generator=g) if with_bias else None
    _assert_matches_reference(OneDNNLinear(), x, weight, bias)


@needs_onednn
@packed_weights()
def test_onednn_packs_each_weight_once_for_inference_and_repacks_when_it_changes():
    """Inside a packed_weights() region, without gradients, the weight is packed at its second use
    (never for a single use) and reused; an in-place update that bumps the version counter, new data
    behind the same parameter, or a gradient pass never leave a stale copy in use."""
    kernel = OneDNNLinear()
    g = torch.Generator().manual_seed(4)
    weight = torch.nn.Parameter(torch.randn(24, 16, generator=g))
    bias = torch.randn(24, generator=g)
    x = torch.randn(6, 16, generator=g)

    def infer():  # noqa: ANN202
        with torch.no_grad():
            out = kernel(x, weight, bias)
        torch.testing.assert_close(out, F.linear(x, weight.detach(), bias), atol=1e-5, rtol=1e-5)
        return kernel._packed

    assert next(iter(infer().values())).packed is None  # used once: not held twice
    first = next(iter(infer().values())).packed
    assert first is not None
    assert next(iter(infer().values())).packed is first and len(kernel._packed) == 1  # reused
    with torch.no_grad():
        weight.mul_(-2.0)  # in place: the version counter moves
    assert next(iter(infer().values())).packed is None  # the stale copy is gone
    assert next(iter(infer().values())).packed is not first
    weight.data = torch.randn(24, 16, generator=g)  # the same parameter, other storage
    infer()
    assert len(kernel._packed) == 1
    kernel(x, weight, bias).sum().backward()  # a training step drops the packed copies
    assert not kernel._packed and weight.grad is not None


@needs_onednn
def test_a_fused_optimizer_step_leaves_no_stale_packed_weight():
    """PyTorch's fused Adam (the trainer's) writes the parameters without bumping their version
    counters: the evaluation after it must score the new weights, not the packed copy of the old
    ones (evaluations during training scored an earlier evaluation's weights)."""
    kernel = OneDNNLinear()
    g = torch.Generator().manual_seed(6)
    weight = torch.nn.Parameter(torch.randn(24, 16, generator=g))
    x = torch.randn(6, 16, generator=g)
    optimizer = torch.optim.Adam([weight], lr=0.5, fused=True)
    for _ in range(3):
        with torch.no_grad(), packed_weights():
            kernel(x, weight, None), kernel(x, weight, None)  # the second use packs
            assert next(iter(kernel._packed.values())).packed is not None
        assert not kernel._packed  # the region's end drops its copies
        version = weight._version
        weight.grad = torch.randn(24, 16, generator=g)
        optimizer.step()
        assert weight._version == version  # why the counter alone does not do
        with torch.no_grad(), packed_weights():
            torch.testing.assert_close(kernel(x, weight, None), x @ weight.detach().t(), atol=1e-5, rtol=1e-5)


@needs_onednn
def test_onednn_packs_only_when_a_row_count_repeats():
    """Prompts of different lengths read one after another (a generation of several prompts) pack
    nothing; the first row count used twice in a row packs, and the copy then serves every shape."""
    kernel = OneDNNLinear()
    g = torch.Generator().manual_seed(5)
    weight = torch.nn.Parameter(torch.randn(24, 16, generator=g))
    with torch.no_grad(), packed_weights():
        for use, rows in enumerate((6, 9, 5, 7, 7, 4, 12)):
            x = torch.randn(rows, 16, generator=g)
            torch.testing.assert_close(kernel(x, weight, None), x @ weight.detach().t(), atol=1e-5, rtol=1e-5)
            (entry,) = kernel._packed.values()
            assert (entry.packed is not None) == (use >= 4), use  # from the second 7 on


@needs_onednn
def test_onednn_packs_views_of_a_fused_weight_apart():
    """W^Q and W^KV of encoder-decoder attention are row slices of one parameter."""
    kernel = OneDNNLinear()
    fused = torch.nn.Parameter(torch.randn(48, 16))
    x = torch.randn(5, 16)
    with torch.no_grad(), packed_weights():
        for _ in range(2):
            for part in (fused[:16], fused[16:]):
                torch.testing.assert_close(kernel(x, part, None), x @ part.t(), atol=1e-5, rtol=1e-5)
        assert len(kernel._packed) == 2


@needs_onednn
def test_a_copied_or_pickled_module_starts_without_packed_weights(monkeypatch):
    import copy
    import pickle

    from attnlab.nn import PositionwiseFeedForward

    monkeypatch.setenv("ATTNLAB_LINEAR", "onednn")
    ffn = PositionwiseFeedForward(16, 32).eval()
    x = torch.randn(2, 5, 16)
    with torch.no_grad(), packed_weights():
        expected = ffn(x)
        ffn(x)  # the second use packs
        assert any(entry.packed is not None for entry in ffn._linear._packed.values())
        twin = copy.deepcopy(ffn)
        assert not twin._linear._packed
        twin.linear1.weight.add_(1.0)  # its own weights: the original's packed copies do not apply
        torch.testing.assert_close(ffn(x), expected)
        assert not torch.allclose(twin(x), expected)
        assert not pickle.loads(pickle.dumps(ffn._linear))._packed


@needs_onednn
def test_evaluation_after_training_steps_uses_the_updated_weights(monkeypatch):
    """eval -> optimizer step -> eval, as a training run's validation does: the second evaluation
    equals a fresh model on aten GEMMs loaded with the updated weights."""
    torch.manual_seed(1)
    config = EncoderDecoderConfig(vocab_size=30, layers=1, d_model=16, heads=2, d_ff=32, dropout=0.0)
    monkeypatch.setenv("ATTNLAB_LINEAR", "onednn")
    model = EncoderDecoder(config)
    monkeypatch.setenv("ATTNLAB_LINEAR", "aten")
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    src, tgt = torch.randint(1, 30, (4, 7)), torch.randint(1, 30, (4, 6))
    for _ in range(2):
        model.eval()
        with torch.no_grad(), packed_weights():
            model(src, tgt)
            model(src, tgt)  # packs
        model.train()
        optimizer.zero_grad()
        model(src, tgt).logsumexp(-1).sum().backward()
        optimizer.step()
    model.eval()
    reference = EncoderDecoder(config).eval()
    reference.load_state_dict(model.state_dict())
    with torch.no_grad(), packed_weights():
        torch.testing.assert_close(model(src, tgt), reference(src, tgt), atol=1e-5, rtol=1e-5)
        # new weights loaded into a model in eval mode, no gradient pass between: no stale copy either
        other = EncoderDecoder(config).eval()
        model.load_state_dict(other.state_dict())
        torch.testing.assert_close(model(src, tgt), other(src, tgt), atol=1e-5, rtol=1e-5)


def test_the_setting_is_read_from_the_environment_and_checked(monkeypatch):
    monkeypatch.delenv("ATTNLAB_LINEAR", raising=False)
    assert linear_setting() == "auto" and isinstance(linear_kernel(), MeasuredLinear)
    monkeypatch.setenv("ATTNLAB_LINEAR", "aten")
    assert linear_kernel() is LINEAR_KERNELS["aten"]()
    monkeypatch.setenv("ATTNLAB_LINEAR", "mkl")
    with pytest.raises(ValueError, match=r"ATTNLAB_LINEAR: unknown 'mkl'; allowed: auto, aten, onednn"):
        EncoderDecoder(EncoderDecoderConfig(vocab_size=20, layers=1, d_model=16, heads=2, d_ff=32))
    monkeypatch.setenv("ATTNLAB_LINEAR", "onednn")
    monkeypatch.setattr(linear_module, "onednn_available", lambda: False)
    with pytest.raises(ValueError, match="ATTNLAB_LINEAR: 'onednn' needs a PyTorch build with oneDNN"):
        linear_kernel()


def _gemms(many: list[str]) -> list[str]:
    """aten and those of ``many`` that apply, in the processor's order of preference (oneDNN first
    where PyTorch reports AVX-512)."""
    return [name for name in linear_module._gemm_preference(None) if name == "aten" or name in many]


def test_a_fixed_record_takes_onednn_first_only_with_avx512(monkeypatch):
    """The GEMM a fixed kernel record takes (never timed) is a rule of the processor: oneDNN where
    PyTorch reports AVX-512, MKL (aten) elsewhere."""
    for capability, first in (("AVX512", "onednn"), ("AVX2", "aten"), ("DEFAULT", "aten")):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda capability=capability: capability)
        assert list(MeasuredLinear()._kernels) == ["few_rows", first, ({"onednn", "aten"} - {first}).pop()]


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 4, 40])
def test_the_measured_kernel_takes_only_kernels_that_apply_and_remembers(monkeypatch, tmp_path, grad, rows):
    """Whichever kernel wins the timing (each is made to win once), the map equals F.linear's and
    its gradients; a second call of the class is looked up, not timed."""
    monkeypatch.setattr(calibration, "MEASURING", True)
    g = torch.Generator().manual_seed(rows)
    x, weight, bias = torch.randn(rows, 16, generator=g), torch.randn(24, 16, generator=g), torch.randn(24, generator=g)
    offered, winner = [], [0]

    def pick(candidates, tie=None):  # noqa: ANN001, ANN202
        offered.append(list(candidates))
        return list(candidates)[min(winner[0], len(candidates) - 1)]

    monkeypatch.setattr(calibration, "measure", pick)
    few = ["few_rows"] if rows < MIN_ONEDNN_ROWS and calibration.native.available() else []
    many = ["onednn"] if rows >= MIN_ONEDNN_ROWS and onednn_available() else []
    expected = [_gemms(many)] if grad and many else []  # one candidate: nothing to time
    expected += [[*few, *_gemms(many)]] if many or few else []
    for winner[0] in range(3):
        monkeypatch.setenv("ATTNLAB_CALIBRATION_DIR", str(tmp_path / str(winner[0])))  # an empty cache each time
        calibration.forget()
        offered.clear()
        kernel = MeasuredLinear()
        for _ in range(2):
            if grad:
                _assert_matches_reference(kernel, x, weight, bias)
            with torch.no_grad():
                torch.testing.assert_close(kernel(x, weight, bias), F.linear(x, weight, bias), atol=1e-5, rtol=1e-5)
        assert offered == expected  # one timing per class (grad, no grad), only of kernels that apply


def test_a_bfloat16_map_of_few_rows_is_measured_between_the_few_rows_kernel_and_aten(monkeypatch, tmp_path):
    """bfloat16 decoding steps: the few-rows kernel against PyTorch's bf16 product, remembered under
    a key of its own (not the float32 class of the same shape); many rows: aten, and oneDNN's
    packed weights where the processor runs bfloat16 there."""
    monkeypatch.setattr(calibration, "MEASURING", True)
    monkeypatch.setenv("ATTNLAB_CALIBRATION_DIR", str(tmp_path))
    calibration.forget()
    offered = []

    def pick(candidates, tie=None):  # noqa: ANN001, ANN202
        offered.append(list(candidates))
        return list(candidates)[0]

    monkeypatch.setattr(calibration, "measure", pick)
    g = torch.Generator().manual_seed(9)
    weight, bias = torch.randn(24, 16, generator=g).bfloat16(), torch.randn(24, generator=g).bfloat16()
    kernel = MeasuredLinear()
    with torch.no_grad():
        for rows in (1, 40):
            x = torch.randn(rows, 16, generator=g).bfloat16()
            out = kernel(x, weight, bias)
            assert out.dtype == torch.bfloat16
            expected = F.linear(x.double(), weight.double(), bias.double())
            torch.testing.assert_close(out.double(), expected, rtol=2**-7, atol=1e-3)
        kernel(torch.randn(1, 16, generator=g), weight.float(), bias.float())
    few = ["few_rows"] if calibration.native.available() else []
    many = _gemms(["onednn"]) if linear_module.onednn_bf16_available() else ["aten"]
    expected = ([[*few, "aten"]] if few else []) + ([many] if len(many) > 1 else []) + ([[*few, "aten"]] if few else [])
    assert offered == expected
    bf16_keys = [key for key in calibration.CHOICES if key[-1] == "bfloat16"]
    assert len(bf16_keys) == (1 if few else 0) + (1 if len(many) > 1 else 0)


@needs_onednn
def test_models_with_either_kernel_agree_and_share_state_dict_keys(monkeypatch):
    """The kernel is how the maps are computed, not what they are: one state dict loads into
    both, and logits and every parameter gradient agree to float32 rounding."""
    torch.manual_seed(0)
    config = EncoderDecoderConfig(vocab_size=40, layers=2, d_model=32, heads=4, d_ff=64, dropout=0.0)
    models = {}
    for name in LINEAR_KERNELS:
        monkeypatch.setenv("ATTNLAB_LINEAR", name)
        models[name] = EncoderDecoder(config)
    assert len({tuple(m.state_dict()) for m in models.values()}) == 1
    models["onednn"].load_state_dict(models["aten"].state_dict())
    src, tgt = torch.randint(1, 40, (3, 11)), torch.randint(1, 40, (3, 9))
    logits, grads = {}, {}
    for name, model in models.items():
        logits[name] = model(src, tgt)
        logits[name].logsumexp(-1).sum().backward()
        grads[name] = {key: p.grad for key, p in model.named_parameters()}
    torch.testing.assert_close(logits["onednn"], logits["aten"], atol=1e-5, rtol=1e-5)
    for key, grad in grads["aten"].items():
        torch.testing.assert_close(grads["onednn"][key], grad, atol=1e-4, rtol=1e-4, msg=lambda m, k=key: f"{k}: {m}")


def test_a_copied_or_pickled_measured_kernel_computes_the_map():
    import copy
    import pickle

    x, weight = torch.randn(5, 8), torch.randn(6, 8)
    for kernel in (pickle.loads(pickle.dumps(MeasuredLinear())), copy.deepcopy(MeasuredLinear())):
        torch.testing.assert_close(kernel(x, weight, None), F.linear(x, weight, None))


@pytest.mark.parametrize(("d_out", "copies"), [(16, 4), (4096, 1)])
def test_a_timed_map_cycles_through_copies_of_a_small_weight(monkeypatch, d_out, copies):
    """A weight smaller than twice the core's cache is timed from copies that together fill it, so
    the timing reads W from where a forward pass finds it (not from L1/L2); a large one is used
    as it is. Every copy holds W's values."""
    monkeypatch.setattr(calibration, "cache_bytes", lambda: 2 * 16 * 64 * 4)  # 2 x 16 x 64 floats: 4 copies of (16, 64)
    x, weight, bias = torch.randn(1, 64), torch.randn(d_out, 64), torch.randn(d_out)
    seen = []
    monkeypatch.setattr(linear_module, "aten_linear", lambda x_, w, b: seen.append(w) or F.linear(x_, w, b))
    run = linear_module._timed_linear("aten", x, weight, bias, False)
    for _ in range(2 * copies):
        run()
    assert len({w.data_ptr() for w in seen}) == copies
    assert all(torch.equal(w, weight) for w in seen)
    assert (weight.data_ptr() in {w.data_ptr() for w in seen}) and not any(w.requires_grad for w in seen)


def test_a_class_on_disk_is_not_prepared_for_timing_again(monkeypatch, tmp_path) -> None:
    """A fresh process finds the class's kernel in the disk cache before it copies and packs W to
    time the candidates (that preparation cost about a second per shape)."""
    monkeypatch.setattr(calibration, "MEASURING", True)
    monkeypatch.setenv("ATTNLAB_CALIBRATION_DIR", str(tmp_path))
    monkeypatch.setattr(calibration, "machine_busy", lambda: False)  # written to disk, whatever runs beside
    calibration.forget()
    x, weight = torch.randn(8, 16), torch.randn(24, 16)
    with torch.no_grad():
        MeasuredLinear()(x, weight, None)  # measured and written to disk
    calibration.forget()  # a new process: nothing in memory
    prepared = []
    real = linear_module._timed_linear
    monkeypatch.setattr(linear_module, "_timed_linear", lambda *a: prepared.append(a[0]) or real(*a))
    with torch.no_grad():
        torch.testing.assert_close(MeasuredLinear()(x, weight, None), F.linear(x, weight, None))
    assert prepared == []
    calibration.forget()


@pytest.mark.skipif(not calibration.native.available(), reason="attnlab's kernels are not built")
def test_a_decoding_steps_map_keeps_the_few_rows_kernel_unless_another_is_far_faster(monkeypatch, tmp_path) -> None:
    """A one-row map without gradient is timed with the few-rows kernel first and the switching
    margin; a many-row map with the default margin."""
    monkeypatch.setattr(calibration, "MEASURING", True)
    monkeypatch.setenv("ATTNLAB_CALIBRATION_DIR", str(tmp_path))
    calibration.forget()
    asked = []
    monkeypatch.setattr(
        calibration, "measure", lambda candidates, tie=None: asked.append((list(candidates), tie)) or "aten"
    )
    weight = torch.randn(24, 16)
    with torch.no_grad():
        for rows in (1, 40):
            MeasuredLinear()(torch.randn(rows, 16), weight, None)
    assert asked[0] == (["few_rows", "aten"], linear_module.SWITCH_MARGIN)
    assert asked[1][1] is None and "few_rows" not in asked[1][0]
    calibration.forget()
