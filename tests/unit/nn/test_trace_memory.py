"""Only what is asked is cached: the storages a trace's cache keeps alive are the cached tensors' own
bytes, with every site cached, with each site alone, and with the attention patterns only (a site
that is a view into a larger buffer, as ``v`` of the fused q|k|v projection is, is copied out)."""

from __future__ import annotations

import pytest
import torch

from attnlab.nn import trace
from attnlab.nn.hooks import model_sites
from attnlab.run.loaded import open_run
from tests.unit.analysis.tiny_lm import tiny_lm_run


@pytest.fixture(scope="module", params=[2, 6], ids=["gqa", "mha"])
def model(request, tmp_path_factory):
    """The tiny Llama-style LM, with 2 key/value heads for 6 query heads, or 6 (one per head)."""
    run, _ = tiny_lm_run(tmp_path_factory.mktemp("lm"), model={"kv_heads": request.param})
    return open_run(run).model.eval()


def _own_bytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def _held_bytes(cache: dict[str, torch.Tensor]) -> int:
    """Bytes of the distinct storages the cache keeps alive."""
    storages = {x.untyped_storage().data_ptr(): x.untyped_storage().nbytes() for x in cache.values()}
    return sum(storages.values())


def _cached(model, sites) -> dict[str, torch.Tensor]:  # noqa: ANN001
    tokens = torch.randint(0, 200, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), trace(model, sites) as traced:
        model(tokens)
    return traced.cache


def test_every_site_cached_keeps_only_the_cached_tensors_bytes(model) -> None:
    cache = _cached(model, "*")
    assert set(cache) == set(model_sites(model))
    for name, x in cache.items():
        assert x.untyped_storage().nbytes() == _own_bytes(x), name  # no cached view of a bigger buffer
    assert _held_bytes(cache) <= sum(map(_own_bytes, cache.values()))  # sites that are one tensor share it


def test_each_site_cached_alone_costs_its_own_bytes(model) -> None:
    for name in model_sites(model):
        cache = _cached(model, [name])
        assert list(cache) == [name]
        assert _held_bytes(cache) == _own_bytes(cache[name]), name


def test_caching_the_patterns_costs_the_patterns_only(model) -> None:
    cache = _cached(model, "*.attn.pattern")
    layers, heads = model.head_mask_shapes()["self"]
    assert len(cache) == layers
    assert _held_bytes(cache) == layers * 2 * heads * 10 * 10 * cache[next(iter(cache))].element_size()
