"""A site replaced by a module (attnlab.nn.replacement): a small SAE trained here on a tiny model's
residual stream, saved with safetensors and loaded as if trained elsewhere, runs inside the model.

The replaced model equals the model with the site edited by decode(encode(x)); with the error kept
it equals the model as it was; features, reconstruction and error are cached (sparse features, an
error below mean ablation's); zeroing a feature moves the output by exactly its decoder term; any
module works (Identity, a Linear transcoder reading another site); bad requests are one UsageError.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

import attnlab
from attnlab.errors import UsageError
from attnlab.nn import DecoderOnlyConfig, build_model, trace
from tests.unit.pretrained.tiny_hf import build

ROOT = Path(__file__).resolve().parents[3]
V, D, F = 31, 16, 64
SITE = "decoder.0.resid_post"


class SAE(nn.Module):
    """f = ReLU(W_enc (x - b_dec) + b_enc), x_hat = W_dec f + b_dec (Bricken et al. 2023), in
    SAELens' names."""

    def __init__(self, d: int = D, n: int = F) -> None:
        super().__init__()
        self.W_enc = nn.Parameter(torch.randn(d, n, dtype=torch.float64) / d**0.5)
        self.b_enc = nn.Parameter(torch.zeros(n, dtype=torch.float64))
        self.W_dec = nn.Parameter(torch.randn(n, d, dtype=torch.float64) / n**0.5)
        self.b_dec = nn.Parameter(torch.zeros(d, dtype=torch.float64))

    def encode(self, x: Tensor) -> Tensor:
        return torch.relu((x - self.b_dec) @ self.W_enc + self.b_enc)

    def decode(self, f: Tensor) -> Tensor:
        return f @ self.W_dec + self.b_dec


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[nn.Module, Tensor, Tensor, SAE]:
    """The tiny model (float64), its tokens, their clean logits, and the SAE trained on its
    ``decoder.0.resid_post`` (200 Adam steps, L1 penalty), as loaded back from a safetensors file."""
    torch.manual_seed(0)
    config = DecoderOnlyConfig(vocab_size=V, layers=2, d_model=D, heads=4, d_ff=32, dropout=0.0)
    model = build_model(config).double().eval()
    tokens = torch.randint(0, V, (32, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), trace(model, cache=SITE) as t:
        clean = model(tokens)
    x = t.cache[SITE].flatten(0, 1)
    sae = SAE()
    optimizer = torch.optim.Adam(sae.parameters(), lr=1e-2)
    for _ in range(200):
        f = sae.encode(x)
        loss = (sae.decode(f) - x).pow(2).sum(-1).mean() + 1e-2 * f.abs().sum(-1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    path = tmp_path_factory.mktemp("sae") / "sae.safetensors"
    save_file({k: v.detach() for k, v in sae.state_dict().items()}, str(path))
    loaded = SAE()
    loaded.load_state_dict(load_file(str(path)))
    return model, tokens, clean, loaded.requires_grad_(False)


def test_the_replaced_model_is_the_model_run_on_the_reconstruction(setup) -> None:  # noqa: ANN001
    model, tokens, clean, sae = setup
    with torch.no_grad():
        with trace(model, replace={SITE: sae}) as t:
            replaced = model(tokens)
        with trace(model) as t:
            t.edit(SITE, lambda x: sae.decode(sae.encode(x)))
            edited = model(tokens)
    assert torch.equal(replaced, edited)
    assert not torch.allclose(replaced, clean, atol=1e-3)  # the reconstruction is not exact
    assert all(not m.hooks for m in model.modules() if hasattr(m, "hooks"))  # nothing left installed


def test_keeping_the_error_leaves_the_output_as_it_was(setup) -> None:  # noqa: ANN001
    model, tokens, clean, sae = setup
    with torch.no_grad(), trace(model, replace={SITE: sae}, keep_error=True):
        kept = model(tokens)
    torch.testing.assert_close(kept, clean, atol=1e-10, rtol=0)


def test_features_reconstruction_and_error_are_cached(setup) -> None:  # noqa: ANN001
    model, tokens, clean, sae = setup
    with torch.no_grad(), trace(model, cache=f"{SITE}*", replace={SITE: sae}) as t:
        model(tokens)
    assert list(t.cache) == [SITE, f"{SITE}.features", f"{SITE}.reconstruction", f"{SITE}.error"]
    x, f = t.cache[SITE], t.cache[f"{SITE}.features"]
    reconstruction, error = t.cache[f"{SITE}.reconstruction"], t.cache[f"{SITE}.error"]
    assert f.shape == (*x.shape[:-1], F) and reconstruction.shape == x.shape
    assert torch.equal(reconstruction, sae.decode(f))
    assert torch.equal(error, x - reconstruction)
    assert float((f == 0).double().mean()) >= 0.4  # sparse
    mean_ablation = (x - x.flatten(0, 1).mean(0)).pow(2).sum(-1).mean()
    assert float(error.pow(2).sum(-1).mean()) < 0.1 * float(mean_ablation)
    with torch.no_grad(), trace(model, cache=SITE) as plain:
        model(tokens)
    assert torch.equal(x, plain.cache[SITE])  # the site is cached as computed: the SAE's input


def test_zeroing_a_feature_moves_the_output_by_its_decoder_term(setup) -> None:  # noqa: ANN001
    model, tokens, clean, sae = setup
    with torch.no_grad(), trace(model, cache=f"{SITE}.features", replace={SITE: sae}, keep_error=True) as t:
        model(tokens)
    f = t.cache[f"{SITE}.features"]
    j = int(f.flatten(0, 1).mean(0).argmax())
    keep = torch.ones(F, dtype=torch.float64)
    keep[j] = 0.0
    with torch.no_grad():
        with trace(model, replace={SITE: sae}, keep_error=True) as t:
            t.scale(f"{SITE}.features", keep)
            ablated = model(tokens)
        with trace(model) as t:
            t.add(SITE, -f[..., j : j + 1] * sae.W_dec[j])  # decode is affine: the term f_j W_dec[j]
            expected = model(tokens)
    torch.testing.assert_close(ablated, expected, atol=1e-10, rtol=0)
    assert not torch.allclose(ablated, clean, atol=1e-3)
    with torch.no_grad(), trace(model, replace={SITE: sae}, keep_error=True) as t:
        t.scale(f"{SITE}.features", keep, positions=[0])  # a sub-site keeps the site's axes
        first = model(tokens)
    assert torch.equal(first[:, :1], ablated[:, :1]) and not torch.equal(first[:, 1:], ablated[:, 1:])


def test_with_the_error_kept_gradients_reach_the_features_through_decode_alone(setup) -> None:  # noqa: ANN001
    model, tokens, _, sae = setup
    embed = "decoder.embed"

    def gradients(**replacing: object) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        with trace(model, detach=False, **replacing) as t:
            t.record([embed, SITE, *([f"{SITE}.features"] if replacing else [])])
            logits = model(tokens)
        cached = dict(t.cache)
        for tensor in cached.values():
            tensor.retain_grad()
        logits[:, -1, 3].sum().backward()
        return cached, {name: tensor.grad for name, tensor in cached.items()}

    _, plain = gradients()
    cached, spliced = gradients(replace={SITE: sae}, keep_error=True)
    # the error is a node of its own (Marks et al. 2024): d/df = d/dy W_dec^T, d/dy unchanged
    torch.testing.assert_close(spliced[f"{SITE}.features"], plain[SITE] @ sae.W_dec.T, atol=1e-10, rtol=0)
    torch.testing.assert_close(spliced[embed], plain[embed], atol=1e-10, rtol=0)
    assert cached[f"{SITE}.features"].requires_grad


def test_a_module_without_encode_and_decode_replaces_the_site(setup) -> None:  # noqa: ANN001
    model, tokens, clean, _ = setup
    with torch.no_grad(), trace(model, cache=f"{SITE}.*", replace={SITE: nn.Identity()}) as t:
        same = model(tokens)
    assert torch.equal(same, clean) and list(t.cache) == [f"{SITE}.reconstruction", f"{SITE}.error"]
    assert not t.cache[f"{SITE}.error"].any()

    torch.manual_seed(2)
    transcoder = nn.Linear(D, D).double().requires_grad_(False)  # an MLP's input -> its output
    mlp_in, mlp_out = "decoder.0.resid_mid", "decoder.0.ffn.out"
    with torch.no_grad():
        with trace(model) as t:
            t.replace_with(mlp_out, transcoder, reads=mlp_in)
            t.record(f"{mlp_out}.error")  # a sub-site exists once its site is replaced
            replaced = model(tokens)
        error = t.cache[f"{mlp_out}.error"]
        with trace(model, cache=[mlp_in, mlp_out]) as manual:  # resid_mid is cached before ffn.out runs
            manual.edit(mlp_out, lambda y: transcoder(manual.cache[mlp_in]))
            edited = model(tokens)
        with trace(model, cache=mlp_out) as truth:
            model(tokens)
        with trace(model) as t:
            t.replace_with(mlp_out, transcoder, reads=mlp_in, keep_error=True)
            kept = model(tokens)
    assert torch.equal(replaced, edited) and not torch.allclose(replaced, clean, atol=1e-3)
    torch.testing.assert_close(error, truth.cache[mlp_out] - transcoder(manual.cache[mlp_in]), atol=0, rtol=0)
    torch.testing.assert_close(kept, clean, atol=1e-10, rtol=0)


def test_a_head_site_replaced_keeps_its_head_axis(setup) -> None:  # noqa: ANN001
    model, tokens, _, _ = setup
    z = "decoder.1.attn.z"
    with torch.no_grad():
        with trace(model, replace={z: nn.Identity()}) as t:
            t.scale(f"{z}.reconstruction", 0.0, heads=[1])
            replaced = model(tokens)
        with trace(model) as t:
            t.scale(z, 0.0, heads=[1])
            scaled = model(tokens)
    assert torch.equal(replaced, scaled)


class _Tuple(nn.Module):
    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x, x


@pytest.mark.parametrize(
    ("replace", "reads", "message"),
    [
        ({"decoder.0.resid_pots": nn.Identity()}, None, r"'decoder.0.resid_pots': no such site.*resid_post"),
        ({"decoder.*.resid_post": nn.Identity()}, None, r"'decoder.\*.resid_post': one site name"),
        ({SITE: lambda x: x}, None, rf"'{SITE}': a torch.nn.Module is needed, got function"),
        ({SITE: nn.Linear(D, 8).double()}, None, rf"'{SITE}': the module of Linear gives shape \(32, 12, 8\)"),
        ({SITE: nn.Linear(8, D).double()}, None, rf"'{SITE}': the module of Linear fails on a tensor of shape"),
        ({SITE: _Tuple()}, None, rf"'{SITE}': the module's output is a tuple, not a tensor"),
        ({"decoder.0.resid_mid": nn.Identity()}, SITE, r"reads 'decoder.0.resid_post', which a forward pass computes"),
        ({SITE: nn.Identity()}, "decoder.0.resid_pots", r"reads 'decoder.0.resid_pots': no such site"),
    ],
)
def test_a_bad_replacement_is_one_usage_error_naming_the_site(setup, replace, reads, message) -> None:  # noqa: ANN001
    model, tokens, _, _ = setup
    [(site, module)] = replace.items()
    with pytest.raises(UsageError, match=message), torch.no_grad(), trace(model) as t:
        t.replace_with(site, module, reads=reads)
        model(tokens)
    assert all(not m.hooks for m in model.modules() if hasattr(m, "hooks"))


def test_a_site_replaced_twice_and_keep_error_alone_are_usage_errors(setup) -> None:  # noqa: ANN001
    model, _, _, sae = setup
    with pytest.raises(UsageError, match="already replaced"), trace(model, replace={SITE: sae}) as t:
        t.replace_with(SITE, nn.Identity())
    with pytest.raises(UsageError, match="keep_error=True applies to the modules of replace="):
        with trace(model, keep_error=True):
            pass


def test_the_documented_sae_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    page = (ROOT / "docs" / "intervening.md").read_text(encoding="utf-8")
    section = page.split("## Sparse autoencoders and transcoders", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "docs_example"}
    exec(compile(code, "docs/intervening.md", "exec"), namespace)  # noqa: S102 - the page's own example
    assert (tmp_path / "sae.safetensors").exists()
    assert float((namespace["features"] == 0).float().mean()) >= 0.3  # type: ignore[operator]
    assert not torch.equal(namespace["ablated"], namespace["clean"])  # type: ignore[arg-type]


@pytest.mark.slow
def test_a_bridged_model_takes_a_module_at_a_site(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    build("llama", tmp_path)
    lm = attnlab.load(tmp_path, dtype="float64", bridge=True)
    model, site = lm.model, "decoder.1.resid_post"
    assert model.bridged
    tokens = torch.randint(3, 300, (2, 7), generator=torch.Generator().manual_seed(0))
    width = model.config.d_model
    torch.manual_seed(0)
    sae = SAE(width, 4 * width).requires_grad_(False)
    with torch.no_grad():
        clean = model(tokens)
        with trace(model, cache=f"{site}.*", replace={site: sae}) as t:
            replaced = model(tokens)
        with trace(model) as manual:
            manual.edit(site, lambda x: sae.decode(sae.encode(x)))
            edited = model(tokens)
        with trace(model, replace={site: sae}, keep_error=True):
            kept = model(tokens)
    assert torch.equal(replaced, edited) and not torch.allclose(replaced, clean, atol=1e-3)
    assert list(t.cache) == [f"{site}.features", f"{site}.reconstruction", f"{site}.error"]
    torch.testing.assert_close(kept, clean, atol=1e-10, rtol=0)
