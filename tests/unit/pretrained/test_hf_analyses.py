"""Every analysis on every Hugging Face family attnlab opens (the tiny models of tiny_hf.py, float64):
the head mask xi on the fused path, one-pass importance against finite differences, ablation,
physical pruning against the masked model, patching, named sites cached and edited, the attention
pictures, the viewer, sampled and chat generation, and eval --texts through the CLI."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from attnlab.analysis.heads import ablate, importance
from attnlab.analysis.lm_probe import NextTokenProbe
from attnlab.analysis.patching import patch
from attnlab.analysis.pruning import prune_model
from attnlab.errors import UsageError
from attnlab.head_ids import HeadId, mask_without
from attnlab.nn import masking_heads, trace
from attnlab.pretrained.sources import open_model
from tests.unit.pretrained.tiny_hf import LAYERS, SIZES, TEXTS, build

pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=sorted(SIZES))
def family(request, tmp_path_factory) -> tuple[Path, Any, Path]:  # noqa: ANN001
    """(the family's folder, attnlab's model opened in float64, a file of two texts)."""
    folder = tmp_path_factory.mktemp(request.param)
    build(request.param, folder)
    texts = folder / "texts.txt"
    texts.write_text("\n".join(TEXTS[:2]) + "\n", encoding="utf-8")
    return folder, open_model(folder, dtype="float64"), texts


def _cli(capsys, *args: str) -> str:  # noqa: ANN001
    """``attnlab ARGS`` in this process (the model's files are read again, as a user's shell would);
    its stdout, after checking it exited 0."""
    from attnlab.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    captured = capsys.readouterr()
    assert exit_info.value.code == 0, captured.err
    return captured.out


def _tokens(loaded) -> torch.Tensor:  # noqa: ANN001
    return torch.tensor([loaded.task.encode(TEXTS[0])])


def test_masking_a_query_head_equals_zeroing_its_columns_of_w_o(family) -> None:  # noqa: ANN001
    _, loaded, _ = family
    model, layer, head = loaded.model, LAYERS - 1, 1
    attention = model.attention_sites()[layer].module
    d_v = attention.d_v
    zeroed = copy.deepcopy(model)
    with torch.no_grad():
        zeroed.attention_sites()[layer].module.out_proj.weight[:, head * d_v : (head + 1) * d_v] = 0.0
        with masking_heads(model, mask_without(model, [HeadId("self", layer, head)])):
            masked = model(_tokens(loaded))
        torch.testing.assert_close(masked, zeroed(_tokens(loaded)))
        assert not torch.allclose(masked, model(_tokens(loaded)))


def test_importance_equals_finite_differences_of_the_loss(family, tmp_path) -> None:  # noqa: ANN001
    _, loaded, _ = family
    one = tmp_path / "one.txt"
    one.write_text(TEXTS[0] + "\n", encoding="utf-8")
    probe = NextTokenProbe(loaded, one, batch_size=4)
    rows = {(r.layer, r.head): r.importance for r in importance(probe)}
    shape = loaded.model.head_mask_shapes()["self"]
    assert set(rows) == {(i, h) for i in range(shape[0]) for h in range(shape[1])}
    step = 1e-5
    for layer, head in [(0, 0), (LAYERS - 1, shape[1] - 1)]:
        losses = []
        for value in (1 + step, 1 - step):
            xi = torch.ones(shape, dtype=torch.float64)
            xi[layer, head] = value
            losses.append(probe.evaluate({"self": xi}).loss)
        assert rows[(layer, head)] == pytest.approx(abs(losses[0] - losses[1]) / (2 * step), rel=1e-4, abs=1e-9)


def test_ablating_a_head_is_evaluating_the_model_without_it(family) -> None:  # noqa: ANN001
    _, loaded, texts = family
    probe = NextTokenProbe(loaded, texts, batch_size=4)
    result = ablate(probe)
    row = next(r for r in result.single if (r.layer, r.head) == (0, 1))
    expected = probe.evaluate(mask_without(loaded.model, [HeadId("self", 0, 1)])).loss
    assert row.loss == pytest.approx(expected, rel=1e-12)


def test_the_physically_pruned_model_computes_the_masked_one(family) -> None:  # noqa: ANN001
    _, loaded, texts = family
    model = loaded.model
    heads = model.head_mask_shapes()["self"][1]
    gone = [HeadId("self", 0, h) for h in range(heads // 2)] + [HeadId("self", LAYERS - 1, heads - 1)]
    if model.config.qk_norm == "full":  # OLMo 2: one norm over all heads' queries: pruning is refused
        with pytest.raises(UsageError, match="qk_norm 'full'"):
            prune_model(model, gone)
        return
    smaller = prune_model(model, gone)
    assert sum(p.numel() for p in smaller.parameters()) < sum(p.numel() for p in model.parameters())
    probe = NextTokenProbe(loaded, texts, batch_size=4)
    batch = next(probe.batches())
    with torch.no_grad():
        masked = probe.outputs(model, batch, mask_without(model, gone))
        pruned = probe.outputs(smaller, batch, None)
    torch.testing.assert_close(pruned, masked)


def test_patching_the_last_residual_restores_everything(family) -> None:  # noqa: ANN001
    _, loaded, _ = family
    clean, corrupt = _two_inputs(loaded)
    result = patch(loaded, clean, corrupt, metric="loss")
    assert len(result.groups["heads"]) == LAYERS * loaded.model.head_mask_shapes()["self"][1]
    residual = result.groups["residual"]
    last = [r for r in residual if r.point == "resid_post" and r.position == len(result.clean_tokens) - 1]
    assert last and last[0].restored == pytest.approx(1.0, abs=1e-9)


def test_every_named_site_is_cached_and_an_edit_of_z_is_the_head_mask(family) -> None:  # noqa: ANN001
    _, loaded, _ = family
    model = loaded.model
    with torch.no_grad(), trace(model, "*") as traced:
        model(_tokens(loaded))
    assert set(traced.cache) == set(traced.sites)
    d_v = model.attention_sites()[0].module.d_v

    def off(z: torch.Tensor) -> torch.Tensor:  # (B, H, T, d_v): head 2 of layer 0 off
        z = z.clone()
        z[:, 2] = 0.0
        return z

    with torch.no_grad():
        with trace(model) as edited:
            edited.edit("decoder.0.attn.z", off)
            by_edit = model(_tokens(loaded))
        with masking_heads(model, mask_without(model, [HeadId("self", 0, 2)])):
            by_mask = model(_tokens(loaded))
    assert d_v > 0
    torch.testing.assert_close(by_edit, by_mask)


def test_the_attention_pictures_and_the_viewer_cover_every_head(family, tmp_path, capsys) -> None:  # noqa: ANN001
    from starlette.testclient import TestClient

    from attnlab.viewer import create_app

    folder, loaded, _ = family
    _cli(capsys, "attention", str(folder), TEXTS[0], "--out", str(tmp_path / "maps"), "--layers", "1", "--json")
    assert len(list((tmp_path / "maps").glob("*.png"))) == loaded.model.head_mask_shapes()["self"][1] + 1
    client = TestClient(create_app(loaded))
    answer = client.post("/api/run", json={"text": TEXTS[0], "layers": [LAYERS - 1]})
    assert answer.status_code == 200, answer.text
    heads = loaded.model.head_mask_shapes()["self"][1]
    assert len(answer.json()["attention"][0]["weights"]) == heads


def test_generate_samples_and_chats_and_eval_scores_a_text_file(family, capsys) -> None:  # noqa: ANN001
    folder, loaded, texts = family
    args = ("generate", str(folder), TEXTS[1], "--max-new-tokens", "5", "--json")
    sampled = [json.loads(_cli(capsys, *args, "--temperature", "1", "--seed", "3")) for _ in range(2)]
    assert sampled[0] == sampled[1] and sampled[0]["tokens"] >= 1
    chat = json.loads(_cli(capsys, *args, "--chat"))
    assert chat["input"] == TEXTS[1]
    evaluated = json.loads(_cli(capsys, "eval", str(folder), "--texts", str(texts), "--json"))
    probe = NextTokenProbe(loaded, texts, batch_size=4)
    assert evaluated["loss"] == pytest.approx(probe.evaluate(None).loss, rel=1e-5)


def test_the_sites_before_rotary_positions_inside_norms_and_ffns_recompute_from_the_weights(family) -> None:  # noqa: ANN001
    _, loaded, _ = family
    model = loaded.model
    with torch.no_grad(), trace(model, "*") as traced:
        model(_tokens(loaded))
    cache, stack = traced.cache, model.decoder
    for index, layer in enumerate(stack.layers):
        attention, prefix = layer.self_attn, f"decoder.{index}"
        q_pre, k_pre = cache[f"{prefix}.attn.q_pre"], cache[f"{prefix}.attn.k_pre"]
        q, k = attention.rotary(q_pre, k_pre, torch.arange(q_pre.shape[2])) if attention.rotary else (q_pre, k_pre)
        torch.testing.assert_close(q, cache[f"{prefix}.attn.q"])
        torch.testing.assert_close(k, cache[f"{prefix}.attn.k"])
        norm = layer.attn_norm  # Norm(x) feeds attention (pre-norm, sandwich), or Norm(Attn(x)) (OLMo 2's output)
        normed = norm.norm_kind.gain(norm.norm, cache[f"{prefix}.attn_norm.normalized"], torch.float64)
        norm_input = cache[f"{prefix}.resid_pre" if norm.placement != "output" else f"{prefix}.attn.out"]
        torch.testing.assert_close(normed, norm.norm_kind.apply(norm.norm, norm_input))
        ffn = layer.feed_forward
        if "gate" in ffn.site_points:
            hidden = ffn._gate(cache[f"{prefix}.ffn.gate"]) * cache[f"{prefix}.ffn.up"]
        else:
            hidden = ffn.activation(cache[f"{prefix}.ffn.pre"])
        torch.testing.assert_close(hidden, cache[f"{prefix}.ffn.hidden"])
    final = stack.final_norm_kind.gain(stack.final_norm, cache["decoder.final_norm.normalized"], torch.float64)
    torch.testing.assert_close(final, cache["decoder.final_norm"])
    with torch.no_grad(), trace(model) as edited:  # the final norm's input halved: the output layer reads that
        edited.scale("decoder.final_norm.normalized", 0.5)
        halved = model(_tokens(loaded))
        by_hand = stack.final_norm_kind.gain(
            stack.final_norm, cache["decoder.final_norm.normalized"] / 2, torch.float64
        )
        torch.testing.assert_close(halved, model._cap(model.lm_head(by_hand)))


def _two_inputs(loaded) -> tuple[str, str]:  # noqa: ANN001
    """A clean and a corrupt text of as many tokens that the model's loss tells apart (a tiny
    random model may not: GPT-Neo's unscaled scores make its attention nearly one-hot)."""
    clean = "the quick fox"
    for corrupt in ("the brown fox", "the quick box", "the quack fox", "the quick fog", "the quick fix", "a quick fox"):
        if len(loaded.task.encode(corrupt)) != len(loaded.task.encode(clean)):
            continue
        try:
            patch(loaded, clean, corrupt, metric="loss", sites=["decoder.0.resid_pre"])
        except UsageError:  # measured alike: nothing for a patch to restore
            continue
        return clean, corrupt
    raise AssertionError("no corrupt text the model tells apart from the clean one")


def test_attribution_estimates_are_the_first_order_term_of_finite_differences(family) -> None:  # noqa: ANN001
    _, loaded, _ = family
    model, (clean, corrupt) = loaded.model, _two_inputs(loaded)
    sites = ["heads", "residual", "*.attn.q_pre", "decoder.1.ffn_norm.scale"]
    result = patch(loaded, clean, corrupt, metric="loss", sites=sites, method="attribution", verify_top=0)
    gap = result.metric_clean - result.metric_corrupt
    ids = [torch.tensor([loaded.task.generation_prompt(t)]) for t in (clean, corrupt)]
    with torch.no_grad(), trace(model, ["*.attn.z", "*.resid_*", "*.q_pre", "*.scale"]) as seen:
        model(ids[0])
    answer = int(model(ids[0])[0, -1].argmax())

    def metric_along(row, eps: float) -> float:  # noqa: ANN001
        """m with the unit at a_corrupt + eps (a_clean - a_corrupt)."""
        with torch.no_grad(), trace(model) as t:
            clean_value = seen.cache[row.site]
            t.edit(row.site, lambda x: x + eps * (clean_value - x), heads=row.head, positions=row.position)
            return float(torch.log_softmax(model(ids[1])[0, -1], -1)[answer])

    rows = [group[i] for group in result.groups.values() for i in (0, len(group) // 2, len(group) - 1)]
    assert {r.point for r in rows} == {"attn.z", "resid_pre", "resid_post", "attn.q_pre", "ffn_norm.scale"}
    eps = 1e-5
    for row in rows:
        slope = (metric_along(row, eps) - metric_along(row, -eps)) / (2 * eps)
        assert row.restored * gap == pytest.approx(slope, rel=1e-5, abs=1e-9), row
        assert row.exact is None  # verify_top=0


def test_attribution_equals_exact_patching_where_the_metric_is_linear_in_the_site(family) -> None:  # noqa: ANN001
    _, loaded, _ = family
    clean, corrupt = _two_inputs(loaded)
    linear = ["logits"] + (["decoder.final_norm"] if loaded.model.config.final_softcap is None else [])
    good = int(loaded.model(torch.tensor([loaded.task.generation_prompt(clean)]))[0, -1].argmax())

    def margin(logits: torch.Tensor) -> torch.Tensor:  # linear in the logits, and in the output layer's input
        return logits[:, -1, good] - logits[:, -1].mean(-1)

    kwargs = {"metric": margin, "sites": linear, "positions": "each"}
    estimated = patch(loaded, clean, corrupt, method="attribution", verify_top=10**6, **kwargs)
    exact = patch(loaded, clean, corrupt, **kwargs)
    for request in linear:
        for a, e in zip(estimated.groups[request], exact.groups[request], strict=True):
            assert a.restored == pytest.approx(e.restored, abs=1e-9) and a.exact == pytest.approx(e.restored, abs=1e-12)
    last = exact.groups["logits"][-1]  # the whole difference is at the last position, in float64 exactly
    assert last.restored == pytest.approx(1.0, abs=1e-12)
    assert all(r.restored == 0.0 for r in exact.groups["logits"][:-1])
