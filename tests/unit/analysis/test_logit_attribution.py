"""Direct logit attribution and the logit lens (attnlab.analysis.logit_attribution) on attnlab's own
tiny language models in float64, one per norm and placement (LayerNorm's centring and biases, the
branch norms of sandwich and output placements, parallel residuals, learned positions, an
unembedding bias): the terms sum to the logit exactly, and the frozen norm is the norm at its input."""

from __future__ import annotations

import pytest
import torch

from attnlab.analysis.logit_attribution import FROZEN_NORMS, MeasuredNorm, direct_logit_attribution, logit_lens
from attnlab.errors import UsageError
from attnlab.nn.normalization import make_norm
from attnlab.run.loaded import open_run
from tests.unit.analysis.tiny_lm import tiny_lm_run

MODELS = {
    "layer-pre-learned-bias": {"norm": "layer", "positional": "learned", "bias": True, "activation": "gelu"},
    "layer-sandwich": {"norm": "layer", "norm_placement": "sandwich", "bias": True, "activation": "gelu"},
    "rms-output": {"norm_placement": "output"},
    "layer-parallel": {"norm": "layer", "parallel_residual": True, "bias": True, "tie_embeddings": False},
    "one-plus-sandwich-capped": {"norm": "rms_one_plus", "norm_placement": "sandwich", "final_softcap": 2.0},
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def loaded(request, tmp_path_factory):  # noqa: ANN001
    run, _ = tiny_lm_run(tmp_path_factory.mktemp(request.param), model=MODELS[request.param])
    loaded = open_run(run)
    loaded.model.double()
    return loaded


def _logits(loaded, text: str) -> torch.Tensor:  # noqa: ANN001
    ids = torch.tensor([loaded.task.generation_prompt(text)])
    with torch.no_grad():
        return loaded.model(ids, is_token=torch.ones_like(ids, dtype=torch.bool))[0, -1]


def test_the_terms_sum_to_the_logit(loaded) -> None:  # noqa: ANN001
    cap = loaded.model.config.final_softcap
    logits = _logits(loaded, "the cat sat")
    good, bad = ord("a"), ord("o")  # the byte tokenizer's ids are the bytes' values
    for wrong, expected in ((None, logits[good]), ("o", logits[good] - logits[bad])):
        attribution = direct_logit_attribution(loaded, "the cat sat", "a", wrong)
        assert attribution.value == pytest.approx(float(expected), abs=1e-10)
        if cap is None:
            assert attribution.total == pytest.approx(attribution.value, abs=1e-5)
        elif wrong is None:
            assert cap * torch.tanh(torch.tensor(attribution.total / cap)) == pytest.approx(attribution.value, abs=1e-5)
    names = [term.term for term in attribution.terms]
    assert names[0] == "embed" and names[-2:] == ["final_norm.bias", "unembed.bias"]
    assert ("pos_embed" in names) == (loaded.model.config.positional == "learned")
    assert len(attribution.heads) == 2 * 6
    for layer in attribution.layers:
        heads = sum(h.contribution for h in attribution.heads if h.layer == layer.layer)
        bias = next(t.contribution for t in attribution.terms if t.term == f"{layer.layer}.attn.bias")
        assert layer.attention == pytest.approx(heads + bias, abs=1e-12)


@pytest.mark.parametrize("norm", sorted(set(FROZEN_NORMS) - {"measured"}))
def test_a_frozen_norm_is_the_norm_at_its_input_and_affine(norm) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    module = make_norm(norm, 8, 1e-5).double()
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.normal_()
    x, u, t = torch.randn(3, 8, dtype=torch.float64)
    with torch.no_grad():
        v, c = FROZEN_NORMS[norm].direction(module, x, u)
        assert float(x @ v + c) == pytest.approx(float(module(x) @ u), abs=1e-12)  # N(x) . u at x itself
        v2, _ = FROZEN_NORMS[norm].direction(module, x, 2.0 * u)
        assert float(t @ v2) == pytest.approx(2.0 * float(t @ v), abs=1e-12)


@pytest.mark.parametrize("width", [8, 7])
@pytest.mark.parametrize("norm", ["layer", "rms", "rms_one_plus"])
def test_a_measured_norm_equals_the_frozen_form_it_was_not_told(norm: str, width: int) -> None:
    """MeasuredNorm reads g, centring and beta from what the module computes (a bridged model's
    transformers norms): the same direction as the frozen form of the norm's known kind."""
    torch.manual_seed(1)
    module = make_norm(norm, width, 1e-5).double()
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.normal_()
    x, u = torch.randn(2, width, dtype=torch.float64)
    with torch.no_grad():
        v, c = FROZEN_NORMS[norm].direction(module, x, u)
        measured_v, measured_c = MeasuredNorm().direction(module, x, u)
    torch.testing.assert_close(measured_v, v, atol=1e-10, rtol=1e-8)
    assert float(measured_c) == pytest.approx(float(c), abs=1e-10)


@pytest.mark.parametrize("name", ["LlamaRMSNorm", "GemmaRMSNorm"])
def test_a_measured_transformers_norm_is_the_norm_at_its_input_and_affine(name: str) -> None:
    transformers = pytest.importorskip("transformers")
    module = {
        "LlamaRMSNorm": lambda: transformers.models.llama.modeling_llama.LlamaRMSNorm(8, eps=1e-6),
        "GemmaRMSNorm": lambda: transformers.models.gemma.modeling_gemma.GemmaRMSNorm(8, eps=1e-6),
    }[name]().double()
    torch.manual_seed(2)
    with torch.no_grad():
        module.weight.normal_()
    x, u, t = torch.randn(3, 8, dtype=torch.float64)
    with torch.no_grad():
        v, c = MeasuredNorm().direction(module, x, u)
        assert float(x @ v + c) == pytest.approx(float(module(x) @ u), abs=1e-6)  # they normalise in float32
        v2, _ = MeasuredNorm().direction(module, x, 2.0 * u)
    assert float(t @ v2) == pytest.approx(2.0 * float(t @ v), abs=1e-10)


def test_the_lens_reads_every_residual_stream(loaded) -> None:  # noqa: ANN001
    lens = logit_lens(loaded, "the cat sat", answer="a", top_k=4)
    assert [(row.layer, row.site) for row in lens.rows] == [(0, "resid_pre"), (1, "resid_pre"), (2, "resid_post")]
    assert lens.rows[-1].answer_logit == pytest.approx(float(_logits(loaded, "the cat sat")[ord("a")]), abs=1e-9)
    assert all(row.top.count("|") == 3 for row in lens.rows)
    assert lens.answer_probabilities.shape == lens.top_probabilities.shape == (3, len(lens.tokens))
    assert bool((lens.answer_probabilities <= lens.top_probabilities + 1e-12).all())


def test_an_answer_of_two_tokens_is_an_error_naming_the_flag(loaded) -> None:  # noqa: ANN001
    with pytest.raises(UsageError, match=r"--answer: 'ab' is 2 tokens"):
        direct_logit_attribution(loaded, "the cat", "ab")
    with pytest.raises(UsageError, match=r"--wrong: 'xy' is 2 tokens"):
        direct_logit_attribution(loaded, "the cat", "a", "xy")
