"""`attnlab bench ... --quick`: every benchmark runs and reports the agreed JSON (no timing asserted)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from attnlab import kernels
from attnlab.bench import BENCHMARKS, NOT_IN_ALL
from attnlab.bench.attention import _measure, loglog_slope
from attnlab.bench.harness import BenchResult, interleaved_median_times
from attnlab.bench.heads import equal_slices
from attnlab.bench.mfu import count_step_flops
from attnlab.kernels import native
from attnlab.kernels.linear import onednn_available
from attnlab.nn import attention_backends
from attnlab.nn.attention import attention


def test_all_quick_reports_every_benchmark(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "attnlab", "bench", "all", "--quick", "--json", "--save", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    reports = json.loads(result.stdout)
    assert [r["benchmark"] for r in reports] == [name for name in BENCHMARKS if name not in NOT_IN_ALL]
    for report in reports:
        assert {"benchmark", "machine", "results", "ratios", "targets"} <= set(report)
        assert {"torch", "threads", "cpu"} <= set(report["machine"])
        assert report["results"] and all({"system", "metric", "value", "unit"} == set(r) for r in report["results"])
        assert all(isinstance(value, float) and value == value for value in report["ratios"].values())
        assert json.loads((tmp_path / f"{report['benchmark']}.json").read_text())["benchmark"] == report["benchmark"]
    systems = {r["system"] for r in reports[0]["results"]}
    assert {"attnlab", "torch.nn.Transformer"} <= systems
    assert (tmp_path / "attention.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_lm_quick_reports_every_figure():
    """`bench lm --quick`: the real SmolLM2 imported, timed against Hugging Face (minutes: slow)."""
    pytest.importorskip("transformers", reason="transformers (the [dev] extra) is needed")
    pytest.importorskip("gguf", reason="gguf (the [pretrained] extra) is needed")
    result = subprocess.run(
        [sys.executable, "-m", "attnlab", "bench", "lm", "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["benchmark"] == "lm"
    targeted = {
        "import_gguf_rss_vs_weights",
        "generate_rss_vs_weights",
        "prefill_vs_hf",
        "decode_vs_hf_batch1",
        "decode_vs_hf_batch2",
        "importance_vs_forward_backward",
    }
    assert set(report["targets"]) == targeted
    assert set(report["ratios"]) == targeted | {"generate_rss_above_imports_vs_weights"}
    assert all(math.isfinite(value) and value > 0 for value in report["ratios"].values())
    # RSS multiples are of the fp32 weights' size: a process holding the model holds at least it.
    assert report["ratios"]["generate_rss_vs_weights"] > report["ratios"]["generate_rss_above_imports_vs_weights"] > 1.0


@pytest.mark.slow
def test_sweep_quick_times_singles_and_both_job_counts():
    """`bench sweep --quick`: 2 single commands, then the same 2 runs as sweeps with --jobs 1 and 2."""
    result = subprocess.run(
        [sys.executable, "-m", "attnlab", "bench", "sweep", "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["benchmark"] == "sweep"
    assert {r["system"] for r in report["results"]} == {"singles", "jobs1", "jobs2"}
    assert set(report["targets"]) == {"jobs1_over_singles", "jobs2_over_jobs1"}
    assert all(math.isfinite(value) and value > 0 for value in report["ratios"].values())


def test_unknown_benchmark_is_exit_2():
    result = subprocess.run(
        [sys.executable, "-m", "attnlab", "bench", "speed"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2 and "'speed' is not one of 'train', 'train-headmask'" in result.stderr


def test_one_system_needs_five_repetitions_after_its_warmup():
    calls = []
    assert interleaved_median_times({"fn": lambda: calls.append(1)}, repeats=5, warmup=2)["fn"] >= 0
    assert len(calls) == 7
    with pytest.raises(ValueError, match="at least 5"):
        interleaved_median_times({"fn": lambda: None}, repeats=3)


def test_targets_are_checked():
    result = BenchResult("x", ratios={"a": 1.2, "b": 0.5}, targets={"a": (">=", 1.15), "b": ("<=", 0.4)})
    assert result.met() == {"a": True, "b": False}
    assert result.to_json()["targets"]["b"] == {"op": "<=", "bound": 0.4, "met": False}


def test_interleaved_rounds_rotate_the_order():
    calls = []
    systems = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    medians = interleaved_median_times(systems, repeats=5, warmup={"c": 0})
    assert set(medians) == {"a", "b", "c"} and all(seconds >= 0 for seconds in medians.values())
    warmups, rounds = calls[:2], [calls[2 + 3 * i : 5 + 3 * i] for i in range(5)]
    assert warmups == ["a", "b"] and len(calls) == 2 + 15
    assert rounds == [list("abc"), list("bca"), list("cab"), list("abc"), list("bca")]
    with pytest.raises(ValueError, match="at least 5"):
        interleaved_median_times(systems, repeats=4)


def test_attention_point_reports_its_own_peak_memory():
    """A point's subprocess reports its own peak, not the RSS of the process that started it."""
    held = torch.ones(384 * 2**20)  # this process holds 1.5 GiB
    values = _measure("soft", 64, 5)
    assert 0 < values["baseline_rss"] <= values["peak_rss"] < 2**30
    del held


def test_a_system_that_counts_its_units_is_timed_per_unit(monkeypatch):
    """A clock that advances one second per reading: each call takes one second, whatever it does."""
    ticks = iter(range(10**6))
    monkeypatch.setattr("attnlab.bench.harness.time.perf_counter", lambda: float(next(ticks)))
    medians = interleaved_median_times({"whole": lambda: None, "four units": lambda: 4}, repeats=5, warmup=0)
    assert medians == {"whole": 1.0, "four units": 0.25}
    with pytest.raises(ValueError, match="at least one"):
        interleaved_median_times({"none": lambda: 0}, repeats=5, warmup=0)


@pytest.mark.parametrize("count", [1, 4, 5, 73])
def test_per_head_loop_slices_cover_every_unit_in_equal_rounds(count):
    units = list(range(count))
    slices = equal_slices(units, 5)
    assert len(slices) == 5 and len({len(s) for s in slices}) == 1
    assert [u for s in slices for u in s][:count] == units


@pytest.mark.parametrize("exponent", [1.0, 2.0, 2.5])
def test_loglog_slope_recovers_the_exponent(exponent):
    points = [(t, 3e-9 * t**exponent) for t in (1024, 2048, 4096, 8192)]
    assert loglog_slope(points) == pytest.approx(exponent)
    with pytest.raises(ValueError, match="two different x"):
        loglog_slope([(4, 1.0), (4, 2.0)])


def test_loglog_slope_is_not_decided_by_the_last_point():
    # One slow last point (1.5x): the last two alone would say 2 + log2(1.5) = 2.58; the fit moves
    # by (3 - 1.5) / 5 of that excess (x = 0..3 in log2 units, sum of squared deviations 5).
    slow_last = [(1, 1.0), (2, 4.0), (4, 16.0), (8, 64.0 * 1.5)]
    assert loglog_slope(slow_last) == pytest.approx(2.0 + 0.3 * math.log2(1.5))


@pytest.mark.parametrize("kernel", ["sdpa", "attnlab"])
@pytest.mark.parametrize("causal", [False, True])
def test_flop_count_includes_the_fused_cpu_attention(causal, kernel, monkeypatch):
    """FlopCounterMode alone counts the CPU SDPA kernel and attnlab's attention kernel as 0 FLOPs.
    Counted here as model FLOPs: Q K^T and P V forward (2 B H T_q T_k (d_k + d_v)), twice that
    backward, as the explicit path."""
    b, h, t, d = 2, 3, 16, 8
    q, k, v = (torch.randn(b, h, t, d, requires_grad=True) for _ in range(3))
    if kernel == "attnlab" and not native.available():
        pytest.skip(f"no C++ kernels: {native.unavailable_reason()}")
    monkeypatch.setattr(attention_backends, "OVERRIDE", {"sdpa": "sdpa", "attnlab": "short"}[kernel])
    calls = []
    spied = {"sdpa": (F, "scaled_dot_product_attention"), "attnlab": (kernels, "short_attention")}[kernel]
    real = getattr(*spied)
    monkeypatch.setattr(*spied, lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs))

    def fused() -> None:
        attention(q, k, v, causal=causal).sum().backward()

    def explicit() -> None:  # matmuls and softmax, which FlopCounterMode knows
        scores = q @ k.transpose(-2, -1)
        if causal:
            scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
        (torch.softmax(scores, -1) @ v).sum().backward()

    assert count_step_flops(fused) == count_step_flops(explicit) == 3 * 2 * b * h * t * t * (d + d)
    assert calls  # the kernel named ran


@pytest.mark.parametrize("kernel", ["aten", "onednn"])
def test_flop_count_of_a_training_step_is_the_same_on_either_linear_kernel(kernel, monkeypatch):
    """FlopCounterMode alone counts oneDNN's linear op as 0 FLOPs; taught it, a training step of the
    quick model counts what it counts on aten's addmm/mm, and both are the model's FLOPs."""

    import torch.nn.functional as F

    from attnlab.bench.models import QUICK, attnlab_model, random_batch
    from attnlab.nn import EncoderDecoder

    if kernel == "onednn" and not onednn_available():
        pytest.skip("this PyTorch build has no oneDNN")
    batch = random_batch(QUICK)
    reference = attnlab_model(QUICK)
    models = {}
    for name in ("aten", kernel):
        monkeypatch.setenv("ATTNLAB_LINEAR", name)
        models[name] = EncoderDecoder(reference.config)

    def step(model):  # noqa: ANN001, ANN202
        return lambda: F.cross_entropy(model(batch.src, batch.tgt_in).flatten(0, 1), batch.tgt_out.flatten()).backward()

    counts = {name: count_step_flops(step(model)) for name, model in models.items()}
    b, t, d, d_ff, layers, vocab = QUICK.batch, QUICK.length, QUICK.d_model, QUICK.d_ff, QUICK.layers, QUICK.vocab
    # Every map runs forward, dL/dx and dL/dW (the embeddings, hence every input, require grad):
    # 3 x 2 rows d_in d_out. Encoder layer: W^QKV, W^O, FFN; decoder layer: W^QKV, W^O, cross W^Q,
    # W^KV (over the source rows), W^O, FFN; then the output layer.
    encoder = 4 * d * d + 2 * d * d_ff
    decoder = 8 * d * d + 2 * d * d_ff
    linear_maps = 3 * 2 * b * t * (layers * (encoder + decoder) + d * vocab)
    attention_calls = 3 * layers * 3 * 2 * b * t * t * (d + d)  # fused SDPA: forward, twice that backward
    assert counts[kernel] == counts["aten"] == linear_maps + attention_calls


def _random_entries_drawn(model: torch.nn.Module, batch) -> int:  # noqa: ANN001
    """Entries of random noise one training forward of a PyTorch model draws (dropout masks,
    however torch draws them)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    drawn = {"entries": 0}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            if func._overloadpacket in (
                torch.ops.aten.bernoulli_,
                torch.ops.aten.bernoulli,
                torch.ops.aten.uniform_,
                torch.ops.aten.rand,
                torch.ops.aten.native_dropout,
            ):
                drawn["entries"] += (
                    args[0].numel() if args and isinstance(args[0], torch.Tensor) else math.prod(args[0])
                )
            return func(*args, **(kwargs or {}))

    model.train()
    with Count():
        model(batch.src, batch.tgt_in)
    return drawn["entries"]


def _mask_entries_drawn(model: torch.nn.Module, batch, monkeypatch) -> int:  # noqa: ANN001
    """Entries of dropout masks one training forward of an attnlab model draws (its words come
    from NumPy on a CPU, which torch's dispatcher does not see)."""
    from attnlab.kernels import dropout_masks as dropout_module

    drawn = {"entries": 0}
    scaled_keep_mask = dropout_module.scaled_keep_mask

    def counted(x, p):  # noqa: ANN001, ANN202
        drawn["entries"] += x.numel()
        return scaled_keep_mask(x, p)

    monkeypatch.setattr(dropout_module, "scaled_keep_mask", counted)
    model.train()
    model(batch.src, batch.tgt_in)
    return drawn["entries"]


def test_the_train_systems_drop_the_same_entries(monkeypatch):
    """nn.Transformer's `dropout` also drops attention weights and FFN activations; the baseline
    switches those off so that it drops what attnlab and BART drop (sub-layer outputs, embeddings)."""
    from attnlab.bench.models import QUICK, TorchTransformerSeq2Seq, attnlab_model, random_batch

    batch = random_batch(QUICK)
    ours = _mask_entries_drawn(attnlab_model(QUICK), batch, monkeypatch)
    assert ours == (2 + 2 * QUICK.layers + 3 * QUICK.layers) * QUICK.batch * QUICK.length * QUICK.d_model
    assert _random_entries_drawn(TorchTransformerSeq2Seq(QUICK), batch) == ours
