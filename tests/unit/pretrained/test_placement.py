"""Placing a model over devices (attnlab.pretrained.placement): a native Llama-family folder and bridged
ones split over the CPU and the disk equal the model in memory; placements are planned and refused
before any weight is read; a ~300 MB model opened with a 120 MiB budget stays within it in anonymous
memory; the CLI prints the plan and says one error line for bad options. GPU placements: where a GPU is."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attnlab
import attnlab.pretrained.hf_model as hf_model
from attnlab.errors import ResourceError, UsageError
from attnlab.nn import masking_heads
from tests.cli import attnlab as run_cli
from tests.unit.pretrained.tiny_hf import build

pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parents[3]
IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("placed") / "llama"
    build("llama", folder)
    return folder, attnlab.load(folder)


def _weights(lm) -> int:  # noqa: ANN001
    return sum(p.numel() * p.element_size() for p in lm.model.parameters())


@pytest.mark.parametrize(
    "device_map, budget",
    [("auto", 0.5), ("sequential", 0.3), ({"decoder.layers.1": "disk", "": "cpu"}, None), ({"": "disk"}, None)],
)
def test_a_model_over_the_cpu_and_the_disk_equals_the_model_in_memory(llama, tmp_path, device_map, budget) -> None:
    folder, whole = llama
    memory = None if budget is None else {"cpu": int(_weights(whole) * budget)}
    placed = attnlab.load(folder, device_map=device_map, max_memory=memory, offload_folder=tmp_path / "offload")
    assert "disk" in placed.placement.sizes
    written = sorted(path.name for path in (tmp_path / "offload").iterdir())
    assert written and all(name.endswith(".safetensors") for name in written)
    with torch.no_grad(), whole.trace("decoder.1.attn.pattern") as a, placed.trace("decoder.1.attn.pattern") as b:
        torch.testing.assert_close(placed(IDS), whole(IDS), rtol=0, atol=1e-5)
    torch.testing.assert_close(b.cache["decoder.1.attn.pattern"], a.cache["decoder.1.attn.pattern"], rtol=0, atol=1e-5)
    xi = whole.head_mask()
    xi["self"][1, 0] = 0.0
    with torch.no_grad(), masking_heads(whole.model, xi):
        wanted = whole(IDS)
    with torch.no_grad(), masking_heads(placed.model, xi):
        torch.testing.assert_close(placed(IDS), wanted, rtol=0, atol=1e-5)
    assert placed.generate("the cat", max_new_tokens=5) == whole.generate("the cat", max_new_tokens=5)


def test_importance_through_the_backward_pass_equals_on_a_placed_model(llama, tmp_path) -> None:
    folder, whole = llama
    placed = attnlab.load(folder, device_map={"decoder.layers.0": "disk", "": "cpu"}, offload_folder=tmp_path)
    torch.testing.assert_close(
        placed.importance(IDS, progress=False).tensor,
        whole.importance(IDS, progress=False).tensor,
        rtol=1e-6,
        atol=1e-9,
    )


def test_a_plan_that_needs_the_disk_without_a_folder_is_refused_before_any_weight_is_read(llama, monkeypatch) -> None:
    folder, whole = llama

    def never(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("a weight was read")

    monkeypatch.setattr(hf_model, "fill_state", never)
    with pytest.raises(ResourceError, match="offload_folder"):
        attnlab.load(folder, device_map="auto", max_memory={"cpu": _weights(whole) // 4})


@pytest.mark.parametrize(
    "options, message",
    [
        ({"device_map": "everywhere"}, "device_map: unknown 'everywhere'"),
        ({"device_map": {"decoder.nothing": "cpu"}}, "'decoder.nothing' is no module of this model"),
        ({"device_map": {"": "tpu"}}, "unknown device 'tpu'"),
        ({"device_map": {"": "cuda:7"}}, "cuda:7 is not here"),
        ({"device_map": "auto", "max_memory": {"cpu": "lots"}}, r"max_memory\['cpu'\]: 'lots' is no size"),
        ({"max_memory": {"cpu": "1GiB"}}, "only with device_map"),
        ({"device_map": "auto", "device": "cuda"}, "give --device or --device-map, not both"),
    ],
)
def test_bad_placements_are_one_usage_error_naming_the_field(llama, options, message) -> None:
    folder, _ = llama
    with pytest.raises(UsageError, match=message):
        attnlab.load(folder, **options)


def test_a_run_or_a_gguf_file_is_not_placed(tmp_path) -> None:
    from tests.unit.analysis.tiny_lm import tiny_lm_run

    run, _ = tiny_lm_run(tmp_path, texts=["a b c"], layers=1)
    with pytest.raises(UsageError, match="over several devices"):
        attnlab.load(run, device_map="auto")


@pytest.mark.parametrize("kind", ["olmo", "t5"])
def test_a_bridged_model_is_placed_by_transformers_dispatch_on_attnlabs_plan(kind, tmp_path) -> None:
    from tests.unit.pretrained.tiny_any import build_any, build_seq2seq

    (build_seq2seq if kind == "t5" else build_any)(kind, tmp_path / kind)
    whole = attnlab.load(tmp_path / kind)
    placed = attnlab.load(tmp_path / kind, device_map={"": "disk"}, offload_folder=tmp_path / "offload")
    assert placed.placement.devices == {"": "disk"}
    inputs = (IDS, torch.tensor([[2, 9, 10]])) if kind == "t5" else (IDS,)
    with torch.no_grad():
        torch.testing.assert_close(placed.model(*inputs), whole.model(*inputs), rtol=0, atol=1e-5)


def test_the_cli_prints_the_plan_and_generates_what_the_model_in_memory_does(llama, tmp_path) -> None:
    folder, whole = llama
    plain = run_cli("generate", str(folder), "the cat", "--max-new-tokens", "5", "--json")
    placed = run_cli(
        "generate", str(folder), "the cat", "--max-new-tokens", "5", "--json",
        "--device-map", '{"decoder.layers.1": "disk", "": "cpu"}', "--offload-folder", str(tmp_path),
    )  # fmt: skip
    assert plain.returncode == 0 and placed.returncode == 0, placed.stderr
    assert json.loads(placed.stdout) == json.loads(plain.stdout)
    assert "placement:" in placed.stderr and "disk:" in placed.stderr and "decoder.layers.1" in placed.stderr
    refused = run_cli("sites", str(folder), "--device-map", "auto", "--max-memory", "cpu=1KiB")
    lines = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert refused.returncode == 4 and len(lines) == 1 and "--offload-folder" in lines[0], refused.stderr
    bad = run_cli("sites", str(folder), "--device-map", "auto", "--max-memory", "cpu")
    assert bad.returncode == 2 and "error: --max-memory: 'cpu' is not DEVICE=SIZE" in bad.stderr


MEMORY_SCRIPT = """
import sys, tempfile, threading, time, torch
import attnlab

def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024

folder, offload = sys.argv[1], sys.argv[2]
ids = torch.tensor([[5, 6, 7, 8, 9]])
peak, done = [0], [False]

def watch():
    while not done[0]:
        peak[0] = max(peak[0], anon())
        time.sleep(0.001)

start = anon()
watcher = threading.Thread(target=watch, daemon=True)
watcher.start()
placed = attnlab.load(folder, device_map="auto", max_memory={"cpu": "120MiB"}, offload_folder=offload)
with torch.no_grad():
    logits = placed(ids)
done[0] = True
watcher.join()
growth = peak[0] - start
whole = attnlab.load(folder)
xi = whole.head_mask()
xi["self"][3, 5] = 0.0
gaps = []
with torch.no_grad():
    gaps.append(float((logits - whole(ids)).abs().max()))
    for lm in (placed, whole):
        with lm.trace("decoder.3.attn.pattern") as traced, attnlab.masking_heads(lm.model, xi):
            lm.masked = lm(ids)
        lm.pattern = traced.cache["decoder.3.attn.pattern"][0, 5]
gaps.append(float((placed.pattern - whole.pattern).abs().max()))
gaps.append(float((placed.masked - whole.masked).abs().max()))
print(growth, max(gaps), sorted(placed.placement.sizes))
"""


def test_a_300_mb_model_with_a_120_mib_budget_grows_anonymous_memory_by_under_60_percent_of_it(tmp_path) -> None:
    """RssAnon (memory that cannot be reclaimed) sampled every millisecond while the model opens and
    runs once: the layers on disk are maps of the offload folder's files, paged in and out by the OS.
    Its logits, head 3:5's pattern and the logits with that head masked equal the model in memory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.unit.pretrained.tiny_hf import save_tokenizer

    folder = tmp_path / "llama-300mb"
    vocab = save_tokenizer(folder)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=6,
        num_attention_heads=16,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    weights = sum(p.numel() * 4 for p in model.parameters())
    model.save_pretrained(folder)
    del model
    assert weights > 290 * 2**20
    done = subprocess.run(
        [sys.executable, "-c", MEMORY_SCRIPT, str(folder), str(tmp_path / "offload")],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    growth, gap, devices = done.stdout.strip().splitlines()[-1].split(" ", 2)
    assert int(growth) < 0.6 * weights, f"RssAnon grew by {int(growth) / 2**20:.0f} MiB of {weights / 2**20:.0f}"
    layer = (4 * 1024 * 1024 + 3 * 1024 * 2816) * 4  # one decoder layer's float32 weights
    assert int(growth) < 120 * 2**20 + layer  # the budget, and at most one layer beyond it
    assert float(gap) <= 1e-5 and "disk" in devices


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_layers_over_a_gpu_and_the_cpu_equal_the_model_on_the_cpu(llama) -> None:
    folder, whole = llama
    placed = attnlab.load(folder, device_map={"decoder.layers.1": "cpu", "lm_head": "cpu", "": "cuda:0"})
    with torch.no_grad():
        torch.testing.assert_close(placed(IDS).cpu(), whole(IDS), rtol=0, atol=1e-5)
    assert placed.generate("the cat", max_new_tokens=5) == whole.generate("the cat", max_new_tokens=5)


def test_attribution_and_patching_on_a_placed_model_equal_the_model_in_memory(llama, tmp_path) -> None:
    from attnlab.analysis.logit_attribution import direct_logit_attribution
    from attnlab.analysis.patching import patch

    folder, whole = llama
    placed = attnlab.load(folder, device_map={"decoder.layers.0": "disk", "": "cpu"}, offload_folder=tmp_path)
    answer, wrong = " the", " world"
    a = direct_logit_attribution(whole, "hello world, the quick", answer, wrong)
    b = direct_logit_attribution(placed, "hello world, the quick", answer, wrong)
    assert [t.contribution for t in b.terms] == pytest.approx([t.contribution for t in a.terms], rel=0, abs=1e-5)
    assert b.value == pytest.approx(a.value, abs=1e-5)
    clean, corrupt = "hello world, the quick", "hello world, the brown"
    one = patch(whole.loaded, clean, corrupt, answer=answer, wrong=wrong, sites=["heads"])
    two = patch(placed.loaded, clean, corrupt, answer=answer, wrong=wrong, sites=["heads"])
    rows = [[r.metric for rows in result.groups.values() for r in rows] for result in (one, two)]
    assert len(rows[0]) == 2 * 4 and rows[1] == pytest.approx(rows[0], rel=0, abs=1e-5)
    assert two.metric_clean == pytest.approx(one.metric_clean, abs=1e-5)


def test_the_kv_cache_of_the_run_is_held_back_from_the_budgets_before_the_layers_are_placed(llama, tmp_path) -> None:
    from attnlab.pretrained.placement import PlacementRequest, kv_cache_bytes, plan

    folder, whole = llama
    config = whole.model.config
    tokens = 64
    assert (
        kv_cache_bytes(whole.model, tokens, torch.float32)
        == 2 * config.layers * config.key_value_heads * (config.d_k or config.d_model // config.heads) * tokens * 4
    )
    reserve = kv_cache_bytes(whole.model, tokens, torch.float32)
    budget = {"cpu": _weights(whole) + reserve // 2}
    roomy = plan(whole.model, PlacementRequest("auto", budget, tmp_path), dtype=torch.float32)
    held = plan(whole.model, PlacementRequest("auto", budget, tmp_path, tokens), dtype=torch.float32)
    assert roomy.sizes.get("disk", 0) < held.sizes.get("disk", 0)  # the cache pushed layers to the disk
    with pytest.raises(ResourceError, match="KV cache"):
        plan(whole.model, PlacementRequest("auto", {"cpu": reserve}, tmp_path, tokens), dtype=torch.float32)
    small = run_cli(
        "generate", str(folder), "the cat", "--max-new-tokens", "4000", "--device-map", "auto",
        "--max-memory", "cpu=256KiB", "--offload-folder", str(tmp_path / "off"),
    )  # fmt: skip
    lines = [line for line in small.stderr.splitlines() if line.startswith("error:")]
    assert small.returncode == 4 and len(lines) == 1 and "KV cache" in lines[0], small.stderr
    assert not (tmp_path / "off").exists()


def test_every_layer_and_module_of_its_own_moves_what_it_receives_where_a_gpu_is_placed(llama, monkeypatch) -> None:
    """dispatch's wiring where a GPU is among the devices, with "cuda:0" computing on the CPU here:
    every decoder layer and every module outside the layers holding tensors gets one mover, nested
    maps included, and the model's output is unchanged."""
    import attnlab.pretrained.placement as placement_module
    from attnlab.pretrained.placement import Placement, dispatch

    folder, whole = llama
    model = attnlab.load(folder).model

    def to_cpu(device: str) -> torch.device:
        return torch.device("cpu")

    monkeypatch.setattr(placement_module, "_execution_device", to_cpu)
    hooked = []
    real = torch.nn.Module.register_forward_pre_hook

    def record(self, hook, **kwargs):  # noqa: ANN001, ANN003, ANN202
        hooked.append(next(name for name, m in model.named_modules() if m is self))
        return real(self, hook, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "register_forward_pre_hook", record)
    dispatch(model, Placement({"": "cpu", "decoder.layers.0": "cuda:0"}, {}))
    monkeypatch.undo()
    layers = [f"decoder.layers.{i}" for i in range(len(model.decoder.layers))]
    assert set(layers) <= set(hooked) and "lm_head" in hooked and "decoder.embedding.token" in hooked
    assert not any(name.startswith(layer + ".") for name in hooked for layer in layers)  # one per layer
    with torch.no_grad():
        torch.testing.assert_close(model(IDS), whole(IDS), rtol=0, atol=1e-6)


def test_a_tied_tensor_split_over_two_devices_is_one_usage_error(tmp_path) -> None:
    build("gemma2", tmp_path / "gemma2")  # its unembedding is its token embedding
    with pytest.raises(UsageError, match="one tied tensor"):
        attnlab.load(tmp_path / "gemma2", device_map={"lm_head": "disk", "": "cpu"}, offload_folder=tmp_path)


def test_cached_sites_stay_where_computed_unless_a_trace_is_asked_to_move_them(llama) -> None:
    _, whole = llama
    with (
        torch.no_grad(),
        whole.trace("decoder.*.attn.z") as kept,
        whole.trace("decoder.*.attn.z", device="meta") as moved,
    ):
        whole(IDS)
    assert all(t.device.type == "cpu" for t in kept.cache.values())
    assert all(t.device.type == "meta" and t.shape == kept.cache[n].shape for n, t in moved.cache.items())


def test_the_sites_a_run_caches_are_held_back_too(llama, tmp_path) -> None:
    from attnlab.pretrained.placement import PlacementRequest, cached_bytes, plan

    folder, whole = llama
    config, tokens = whole.model.config, 16
    width = config.d_k or config.d_model // config.heads
    z = cached_bytes(whole.model, ("*.attn.z", "*.no_such_site"), tokens, torch.float32)
    assert z == config.layers * config.heads * width * tokens * 4
    pattern = cached_bytes(whole.model, ("*.attn.pattern",), tokens, torch.float32)
    assert pattern == config.layers * config.heads * tokens * tokens * 4
    with pytest.raises(ResourceError, match="KV cache and cached sites"):
        plan(whole.model, PlacementRequest("auto", {"cpu": pattern}, tmp_path, tokens, ("*.pattern",)))
    refused = run_cli(
        "attention", str(folder), "the cat " * 40, "--out", str(tmp_path / "maps"), "--device-map", "auto",
        "--max-memory", "cpu=64KiB", "--offload-folder", str(tmp_path / "off"),
    )  # fmt: skip
    assert refused.returncode == 4 and "cached sites" in refused.stderr and not (tmp_path / "maps").exists()


def test_the_viewer_of_a_placed_model_shows_the_maps_of_the_model_in_memory(llama, tmp_path) -> None:
    from starlette.testclient import TestClient

    from attnlab.viewer import create_app

    folder, whole = llama
    placed = attnlab.load(folder, device_map={"decoder.layers.1": "disk", "": "cpu"}, offload_folder=tmp_path)
    body = {"text": "hello world", "off": [{"kind": "self", "layer": 1, "head": 0}]}
    answers = [TestClient(create_app(lm.loaded)).post("/api/run", json=body).json() for lm in (whole, placed)]
    assert answers[1]["output"] == answers[0]["output"]
    for mine, theirs in zip(answers[1]["attention"], answers[0]["attention"], strict=True):
        assert mine["kind"] == theirs["kind"] and mine["layer"] == theirs["layer"]
        torch.testing.assert_close(torch.tensor(mine["weights"]), torch.tensor(theirs["weights"]), rtol=0, atol=1e-4)


def test_auto_without_budgets_takes_what_each_device_has_and_a_disk_map_needs_its_folder(llama) -> None:
    folder, whole = llama
    placed = attnlab.load(folder, device_map="auto")  # this machine's free memory holds the tiny model
    assert set(placed.placement.sizes) == {"cuda:0" if torch.cuda.is_available() else "cpu"}
    with torch.no_grad():
        torch.testing.assert_close(placed(IDS).cpu(), whole(IDS), rtol=0, atol=1e-5)
    with pytest.raises(UsageError, match="offload_folder: device_map puts"):
        attnlab.load(folder, device_map={"": "disk"})
