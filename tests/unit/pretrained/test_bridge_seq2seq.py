"""The bridge for encoder-decoders (attnlab.pretrained.bridge_seq2seq): tiny random T5, BART, Marian,
mBART and Pegasus models equal transformers in float64 (logits, every pattern of the three attention
kinds, masking a head of each kind, KV-cached greedy decoding); head importance splits by kind and
equals transformers' gradients; the CLI and the viewer run on them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from starlette.testclient import TestClient

import attnlab
from attnlab.analysis.heads import TaskProbe, head_importance, scoring_pairs
from attnlab.errors import DataError, UsageError
from attnlab.generate.search import DecodeOptions, decode
from attnlab.nn import model_sites
from attnlab.viewer import create_app
from tests.cli import attnlab as run_cli
from tests.unit.pretrained.tiny_any import (
    STUDIED_SEQ2SEQ,
    _plain_greedy,
    build_seq2seq,
    check_bridged_seq2seq,
)

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))
from bridge_coverage import bridged_types  # noqa: E402

SEQ2SEQ_TABLE = bridged_types(seq2seq=True)

PAIRS = "the cat sat\tle chat\nhello world\tbonjour le monde\na b c\tx y z\n"


@pytest.fixture(scope="module", params=STUDIED_SEQ2SEQ)
def opened(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    reference = build_seq2seq(request.param, folder)
    return folder, reference, attnlab.load(folder).to(torch.float64)


def test_each_studied_encoder_decoder_equals_transformers(opened):
    _, reference, lm = opened
    check_bridged_seq2seq(reference, lm)


def test_sites_are_the_native_encoder_decoders_three_kinds(opened):
    _, reference, lm = opened
    sites = model_sites(lm.model)
    layers, decoder_layers = reference.config.encoder_layers, reference.config.decoder_layers
    for layer in range(layers):
        assert sites[f"encoder.{layer}.attn.pattern"].kind == "encoder_self"
    for layer in range(decoder_layers):
        assert sites[f"decoder.{layer}.attn.pattern"].kind == "decoder_self"
        assert sites[f"decoder.{layer}.cross.z"].kind == "cross"
    assert {"encoder.embed", "decoder.embed", "encoder.final_norm", "decoder.final_norm", "logits"} <= set(sites)
    assert lm.head_mask_shapes == {
        "encoder_self": (layers, 4),
        "decoder_self": (decoder_layers, 4),
        "cross": (decoder_layers, 4),
    }
    assert lm.loaded.experiment.model_kind == "encoder_decoder"


def test_the_encoders_output_site_is_the_memory_every_cross_attention_reads(opened):
    _, reference, lm = opened
    src = torch.tensor([[5, 6, 7, 8, 9]])
    tgt = torch.tensor([[reference.config.decoder_start_token_id, 11, 12]])
    with torch.no_grad(), lm.trace(["encoder.final_norm", "decoder.0.cross.k"]) as traced:
        lm.model(src, tgt)
        memory = reference.get_encoder()(input_ids=src).last_hidden_state
    torch.testing.assert_close(traced.cache["encoder.final_norm"], memory, rtol=0, atol=1e-12)
    with torch.no_grad(), lm.trace() as edited:
        edited.edit("encoder.final_norm", torch.zeros_like)
        zeroed = lm.model(src, tgt)
    with torch.no_grad():
        wanted = reference(encoder_outputs=(torch.zeros_like(memory),), decoder_input_ids=tgt).logits
    torch.testing.assert_close(zeroed, wanted, rtol=0, atol=1e-10)


def test_importance_of_pairs_splits_by_kind_and_equals_transformers_gradients(opened, tmp_path):
    """I_h = E_x |dL(x)/dxi_h| (Michel §2.3) on source<TAB>target pairs, each kind's xi a scale of
    its heads' slice of W^O's input in transformers' model, L(x) the mean target cross-entropy."""
    _, reference, lm = opened
    pairs = tmp_path / "pairs.tsv"
    pairs.write_text(PAIRS)
    scored = scoring_pairs(lm.loaded, pairs)
    probe = TaskProbe(scored, "valid", batch_size=2)
    scores = head_importance(probe)
    assert set(scores) == {"encoder_self", "decoder_self", "cross"}
    names = {module: name for name, module in lm.model.hf.named_modules()}
    modules = dict(reference.named_modules())
    parts = {
        "encoder_self": [(layer.self_attn, i) for i, layer in enumerate(lm.model.encoder.layers)],
        "decoder_self": [(layer.self_attn, i) for i, layer in enumerate(lm.model.decoder.layers)],
        "cross": [(layer.cross_attn, i) for i, layer in enumerate(lm.model.decoder.layers)],
    }
    expected = {kind: torch.zeros(len(p), 4, dtype=torch.float64) for kind, p in parts.items()}
    task = scored.task
    for example in task.valid():
        xi = {kind: torch.ones(len(p), 4, dtype=torch.float64, requires_grad=True) for kind, p in parts.items()}
        handles = []
        for kind, found in parts.items():
            for attention, layer in found:

                def scale(module, args, gate=xi[kind][layer], width=attention.d_v):  # noqa: ANN001, ANN202
                    x = args[0].unflatten(-1, (4, width)) * gate.reshape(4, 1)
                    return (x.flatten(-2), *args[1:])

                handles.append(modules[names[attention.output]].register_forward_pre_hook(scale))
        src = torch.tensor([example.source])
        tgt_in = torch.tensor([[task.bos_id, *example.target]])
        tgt_out = torch.tensor([[*example.target, task.eos_id]])
        try:
            logits = reference(input_ids=src, decoder_input_ids=tgt_in).logits
        finally:
            for handle in handles:
                handle.remove()
        loss = torch.nn.functional.cross_entropy(logits[0], tgt_out[0])
        grads = torch.autograd.grad(loss, list(xi.values()))
        for kind, grad in zip(xi, grads):
            expected[kind] += grad.abs() / len(task.valid())
    for kind in parts:
        torch.testing.assert_close(scores[kind], expected[kind], rtol=1e-6, atol=1e-12)
        assert float(scores[kind].sum()) > 0


def test_lm_importance_ranks_the_three_kinds_as_the_probe_scores_them(opened, tmp_path):
    _, _, lm = opened
    pairs = tmp_path / "pairs.tsv"
    pairs.write_text(PAIRS)
    found = lm.importance(pairs, batch_size=2, progress=False)
    scores = head_importance(TaskProbe(scoring_pairs(lm.loaded, pairs), "valid", batch_size=2))
    assert set(found) == set(scores) and len(found.rows()) == sum(s.numel() for s in scores.values())
    ranked = [value for _, value in found.top(len(found.rows()))]
    assert ranked == sorted(ranked, reverse=True)
    for kind, values in scores.items():
        torch.testing.assert_close(found[kind], values.double().cpu(), rtol=1e-9, atol=1e-15)


def test_lm_generate_writes_what_decode_writes_and_a_call_on_text_is_one_error(opened):
    _, _, lm = opened
    task = lm.task
    source = torch.tensor([task.frame(lm.loaded.tokenizer.encode("the cat")) + [task.eos_id]])
    options = DecodeOptions(max_length=5)
    written = decode(
        lm.model, source, bos_id=task.bos_id, eos_id=task.eos_id, pad_id=task.pad_id, options=options, banned=()
    )
    assert lm.generate("the cat", max_new_tokens=5) == lm.decode(written[0].tokens)
    with pytest.raises(UsageError, match="lm.model\\(src, tgt_in\\)"):
        lm("the cat")


def test_a_bad_pairs_line_is_one_error_naming_it(opened, tmp_path):
    _, _, lm = opened
    bad = tmp_path / "bad.tsv"
    bad.write_text("a\tb\nno tab here\n")
    with pytest.raises(DataError, match=r"bad.tsv:2: missing tab"):
        scoring_pairs(lm.loaded, bad)


@pytest.fixture(scope="module")
def bart(tmp_path_factory):
    """One encoder-decoder for the CLI's commands (each a fresh process: one type keeps it quick)."""
    folder = tmp_path_factory.mktemp("bart-cli")
    reference = build_seq2seq("bart", folder)
    return folder, reference, attnlab.load(folder)


def test_the_cli_translates_ranks_heads_by_kind_and_refuses_causal_commands(bart, tmp_path):
    folder, reference, lm = bart
    pairs = tmp_path / "pairs.tsv"
    pairs.write_text(PAIRS)
    out = run_cli("generate", str(folder), "the cat sat", "--max-new-tokens", "4", "--json")
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout.strip().splitlines()[-1])
    src = torch.tensor([lm.task.frame(lm.loaded.tokenizer.encode("the cat sat")) + [lm.task.eos_id]])
    greedy = _plain_greedy(reference)  # 6 new tokens; the CLI asked for 4 and stops at EOS
    greedy.decoder_start_token_id = lm.task.bos_id
    with torch.no_grad():
        written = reference.float().generate(src, generation_config=greedy)[0, 1:].tolist()
    produced = (written[: written.index(lm.task.eos_id)] if lm.task.eos_id in written else written)[:4]
    assert answer["output"] == lm.loaded.codec.decode(produced)
    csv = tmp_path / "importance.csv"
    out = run_cli("heads", "importance", str(folder), "--texts", str(pairs), "--out", str(csv))
    assert out.returncode == 0, out.stderr
    kinds = {line.split(",")[0] for line in csv.read_text().splitlines()[1:]}
    assert kinds == {"encoder_self", "decoder_self", "cross"}
    causal = (
        ["patch", str(folder), "--clean", "a b", "--corrupt", "a c"],
        ["attribute", str(folder), "a b", "--answer", " c"],
    )
    for command in causal:  # a seq2seq folder given to a causal command: one error line, exit 2
        out = run_cli(*command)
        lines = [line for line in out.stderr.splitlines() if line.startswith("error:")]
        assert out.returncode == 2 and len(lines) == 1 and "encoder_decoder" in lines[0], out.stderr


def test_the_viewer_shows_three_panels_equal_to_transformers(opened):
    _, reference, lm = opened
    client = TestClient(create_app(lm.loaded))
    info = client.get("/api/model").json()
    assert [k["kind"] for k in info["heads"]] == ["encoder_self", "decoder_self", "cross"]
    answer = client.post("/api/run", json={"text": "the cat", "off": []}).json()
    assert {m["kind"] for m in answer["attention"]} == {"encoder_self", "decoder_self", "cross"}
    cross = next(m for m in answer["attention"] if (m["kind"], m["layer"]) == ("cross", 1))
    task = lm.task
    src = torch.tensor([task.frame(lm.loaded.tokenizer.encode("the cat")) + [task.eos_id]])
    written = decode(
        lm.model,
        src,
        bos_id=task.bos_id,
        eos_id=task.eos_id,
        pad_id=task.pad_id,
        options=DecodeOptions(max_length=len(cross["queries"]) - 1),
        banned=task.generation_banned,
    )[0].tokens
    with torch.no_grad():
        expected = reference(
            input_ids=src, decoder_input_ids=torch.tensor([[task.bos_id, *written]]), output_attentions=True
        )
    assert len(cross["keys"]) == src.shape[1] and len(cross["queries"]) == 1 + len(written)
    np.testing.assert_allclose(np.array(cross["weights"]), expected.cross_attentions[1][0].numpy(), atol=2e-3)


def test_a_native_translation_run_refuses_pairs_of_its_own(tmp_path):
    from attnlab.run.loaded import open_run
    from tests.unit.analysis.tiny_runs import tiny_run

    loaded = open_run(tiny_run(tmp_path, "encoder_decoder"))
    with pytest.raises(UsageError, match="scores its own task's splits"):
        scoring_pairs(loaded, tmp_path / "pairs.tsv")


@pytest.mark.slow
@pytest.mark.parametrize("model_type", [t for t in SEQ2SEQ_TABLE if t not in STUDIED_SEQ2SEQ])
def test_every_type_the_seq2seq_table_marks_bridged_equals_transformers(model_type, tmp_path):
    reference = build_seq2seq(model_type, tmp_path)
    check_bridged_seq2seq(reference, attnlab.load(tmp_path, dtype="float64"))


def test_the_seq2seq_table_opens_the_five_encoder_decoders_studied():
    assert set(STUDIED_SEQ2SEQ) <= set(SEQ2SEQ_TABLE)
