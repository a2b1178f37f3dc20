"""No global state in the user's process (issue 51, item 3): oneDNN's packed weight copies exist only
inside a packed_weights() region and go when it ends, so no write to a weight can leave a stale
copy in use (every torch.optim optimizer, fused and foreach included, ``.data`` edits,
``load_state_dict``); attnlab registers no hook with PyTorch's optimizers; decoding still packs."""

from __future__ import annotations

import importlib
import inspect
import threading

import pytest
import torch
import torch.nn.functional as F

from attnlab.kernels.linear import OneDNNLinear, onednn_available, packed_weights
from attnlab.nn import DecoderOnly, DecoderOnlyConfig, EncoderDecoder, EncoderDecoderConfig

linear_module = importlib.import_module("attnlab.kernels.linear")

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this PyTorch build has no oneDNN")


def _onednn_kernels(model: torch.nn.Module) -> list[OneDNNLinear]:
    """The OneDNNLinear kernels of ``model``'s modules (their own, or inside their MeasuredLinear)."""
    found = [getattr(module, "_linear", None) for module in model.modules()]
    return [
        k if isinstance(k, OneDNNLinear) else k._onednn for k in found if hasattr(k, "_packed") or hasattr(k, "_onednn")
    ]


def _optimizers() -> list:
    """Every optimizer class of torch.optim, each as it is, with ``foreach=True`` and with
    ``fused=True`` where it takes them."""
    params = []
    for name in sorted(torch.optim.__all__):
        cls = getattr(torch.optim, name)
        if not (inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer)) or cls is torch.optim.Optimizer:
            continue
        params.append(pytest.param(cls, {}, id=name))
        accepted = inspect.signature(cls).parameters
        for option in ("foreach", "fused"):
            if option in accepted:
                params.append(pytest.param(cls, {option: True}, id=f"{name}-{option}"))
    return params


def test_every_optimizer_of_torch_optim_is_covered():
    names = {param.values[0].__name__ for param in _optimizers()}
    assert {"SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "LBFGS", "SparseAdam"} <= names
    fused = {param.values[0].__name__ for param in _optimizers() if param.values[1] == {"fused": True}}
    assert {"SGD", "Adam", "AdamW", "Adagrad"} <= fused


def _step(optimizer: torch.optim.Optimizer, weight: torch.nn.Parameter, x: torch.Tensor) -> None:
    """One in-place step of ``optimizer`` on a fresh gradient of ``weight``."""
    sparse = isinstance(optimizer, torch.optim.SparseAdam)

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = (x @ weight.t()).square().sum()
        loss.backward()
        if sparse:
            weight.grad = weight.grad.to_sparse()
        return loss

    if isinstance(optimizer, torch.optim.LBFGS):
        optimizer.step(closure)
    else:
        closure()
        optimizer.step()


@pytest.mark.parametrize(("cls", "options"), _optimizers())
def test_an_in_place_step_of_every_optimizer_never_meets_a_stale_packed_weight(cls, options):
    """Evaluate (packed) -> step -> evaluate, as a training run's validation does: every evaluation
    computes x W^T of the weights as they are now, whatever the step bypassed (fused optimizers do
    not bump the version counter)."""
    g = torch.Generator().manual_seed(3)
    weight = torch.nn.Parameter(torch.randn(24, 16, generator=g))
    x = torch.randn(6, 16, generator=g)
    try:
        optimizer = cls([weight], lr=0.05, **options)
        _step(optimizer, weight, x)
    except RuntimeError as error:  # a fused or foreach kernel this build has no CPU version of
        pytest.skip(f"{cls.__name__}({options}): {error}")
    kernel = OneDNNLinear()
    for _ in range(3):
        with torch.no_grad(), packed_weights():
            for _ in range(3):  # the second use packs, the third uses the copy
                out = kernel(x, weight, None)
            assert next(iter(kernel._packed.values())).packed is not None
            torch.testing.assert_close(out, x @ weight.detach().t(), atol=1e-5, rtol=1e-5)
        assert not kernel._packed  # dropped with the region
        before = weight.detach().clone()
        _step(optimizer, weight, x)
        assert not torch.equal(before, weight.detach())  # the step wrote the weight in place
        with torch.no_grad():  # outside any region: never packed, always the weight as it is
            for _ in range(3):
                torch.testing.assert_close(kernel(x, weight, None), x @ weight.detach().t(), atol=1e-5, rtol=1e-5)
        assert not kernel._packed


def test_data_edits_never_meet_a_stale_packed_weight():
    """Outside a region nothing is packed, so any edit of ``.data`` is seen; inside one, a new
    storage or an in-place write that bumps the counter is seen at once, and a write behind the
    counter (``.data.mul_``, which the region promises not to make) no later than its end."""
    g = torch.Generator().manual_seed(5)
    weight = torch.nn.Parameter(torch.randn(24, 16, generator=g))
    x = torch.randn(8, 16, generator=g)
    kernel = OneDNNLinear()

    def check() -> None:
        with torch.no_grad():
            torch.testing.assert_close(kernel(x, weight, None), F.linear(x, weight.detach()), atol=1e-5, rtol=1e-5)

    for _ in range(2):
        check()
    weight.data.mul_(-3.0)  # no version bump
    check()
    assert not kernel._packed
    with packed_weights():
        check(), check()
        first = next(iter(kernel._packed.values())).packed
        assert first is not None
        weight.data = torch.randn(24, 16, generator=g)  # new storage
        check(), check()
        assert next(iter(kernel._packed.values())).packed is not first
        with torch.no_grad():
            weight.add_(1.0)  # in place, counted
        check()
        weight.data.mul_(2.0)  # behind the counter: the region's promise broken
    check()  # the region's end dropped the copy
    with packed_weights():
        check(), check(), check()


def test_load_state_dict_never_meets_a_stale_packed_weight(monkeypatch):
    """Loading new weights into a model, inside a region or between two, is seen at its next call."""
    monkeypatch.setenv("ATTNLAB_LINEAR", "onednn")
    torch.manual_seed(2)
    config = EncoderDecoderConfig(vocab_size=30, layers=1, d_model=16, heads=2, d_ff=32, dropout=0.0)
    model, other, third = (EncoderDecoder(config).eval() for _ in range(3))
    src, tgt = torch.randint(1, 30, (4, 7)), torch.randint(1, 30, (4, 6))
    with torch.no_grad():
        expected = {id(m): m(src, tgt) for m in (other, third)}  # outside a region: unpacked
        with packed_weights():
            model(src, tgt), model(src, tgt)  # packs
            assert any(
                entry.packed is not None for kernel in _onednn_kernels(model) for entry in kernel._packed.values()
            )
            model.load_state_dict(other.state_dict())  # inside the region
            torch.testing.assert_close(model(src, tgt), expected[id(other)], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(model(src, tgt), expected[id(other)], atol=1e-5, rtol=1e-5)
        model.load_state_dict(third.state_dict())  # between two regions
        with packed_weights():
            for _ in range(2):
                torch.testing.assert_close(model(src, tgt), expected[id(third)], atol=1e-5, rtol=1e-5)


def test_a_fused_adamw_training_loop_with_evaluations_scores_the_current_weights(monkeypatch):
    """The trainer's sequence on a whole model (auto kernels: whichever the calibration picks):
    fused AdamW steps between evaluations in packed_weights() regions."""
    torch.manual_seed(1)
    config = EncoderDecoderConfig(vocab_size=30, layers=1, d_model=16, heads=2, d_ff=32, dropout=0.0)
    monkeypatch.setenv("ATTNLAB_LINEAR", "onednn")
    model = EncoderDecoder(config)
    monkeypatch.setenv("ATTNLAB_LINEAR", "aten")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    src, tgt = torch.randint(1, 30, (4, 7)), torch.randint(1, 30, (4, 6))
    for _ in range(3):
        model.eval()
        reference = EncoderDecoder(config).eval()
        reference.load_state_dict(model.state_dict())
        with torch.no_grad(), packed_weights():
            for _ in range(3):
                torch.testing.assert_close(model(src, tgt), reference(src, tgt), atol=1e-5, rtol=1e-5)
        model.train()
        optimizer.zero_grad()
        model(src, tgt).logsumexp(-1).sum().backward()
        optimizer.step()


def test_regions_nest_and_are_local_to_their_thread():
    g = torch.Generator().manual_seed(7)
    weight, x = torch.randn(24, 16, generator=g), torch.randn(8, 16, generator=g)
    kernel = OneDNNLinear()
    with packed_weights():
        with packed_weights():  # the outer region's: its end drops nothing
            kernel(x, weight, None), kernel(x, weight, None)
        assert next(iter(kernel._packed.values())).packed is not None
        elsewhere = OneDNNLinear()

        def in_another_thread() -> None:
            elsewhere(x, weight, None), elsewhere(x, weight, None)

        thread = threading.Thread(target=in_another_thread)
        thread.start()
        thread.join()
        assert not elsewhere._packed  # this thread's region is not the other thread's
    assert not kernel._packed


def test_attnlab_registers_no_hook_with_pytorchs_optimizers():
    from torch.optim import optimizer

    import attnlab  # noqa: F401
    import attnlab.generate.search  # noqa: F401
    import attnlab.kernels.linear  # noqa: F401
    import attnlab.nn  # noqa: F401

    hooks = [*optimizer._global_optimizer_pre_hooks.values(), *optimizer._global_optimizer_post_hooks.values()]
    assert not [hook for hook in hooks if getattr(hook, "__module__", "").startswith("attnlab")]


@pytest.mark.parametrize("batch", [4, 6])
def test_decoding_packs_its_weights_for_the_steps_and_drops_them_after(monkeypatch, batch):
    """greedy_search enters a region: the maps of 4 rows and more (a batch of 4 and more) are
    packed once and reused over the steps; nothing is held after the search."""
    from attnlab.generate.search import DecoderOnlyStepper, greedy_search

    monkeypatch.setenv("ATTNLAB_LINEAR", "onednn")
    torch.manual_seed(0)
    model = DecoderOnly(DecoderOnlyConfig(vocab_size=40, layers=2, d_model=32, heads=4, d_ff=64, dropout=0.0)).eval()
    packs = []
    real = linear_module._pack
    monkeypatch.setattr(linear_module, "_pack", lambda weight, rows: packs.append(rows) or real(weight, rows))
    prefix = torch.randint(3, 40, (batch, 5))
    stepper = DecoderOnlyStepper(model, use_cache=True)
    found = greedy_search(stepper, prefix, eos_id=2, banned=(0, 1, 2), max_length=12)
    assert len(found) == batch and all(len(h.tokens) == 12 for h in found)
    kernels = _onednn_kernels(model)
    assert kernels
    assert packs and set(packs) == {batch}  # the steps' row count, packed once per weight
    assert len(packs) <= sum(p.numel() > 0 for p in model.parameters())
    assert all(not kernel._packed for kernel in kernels)  # dropped when the search ended
    packs.clear()
    with torch.no_grad():  # the same prompt read again and again outside a region: nothing packed
        for _ in range(3):
            DecoderOnlyStepper(model, use_cache=True).next_logits(prefix)
    assert not packs
