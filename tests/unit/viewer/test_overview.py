"""The overview's thumbnails: maps pooled to at most 16 x 16 blocks, quantised to bytes, and a
bounded size for a model of SmolLM2's 30 x 9 heads on a 300-token input."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch

from attnlab.analysis.maps import AttentionMap, AttentionView
from attnlab.head_ids import HeadId
from attnlab.viewer.overview import THUMBNAIL, overview_json, pool_map, thumbnail_bytes


def reference_pool(weights: np.ndarray, size: int) -> np.ndarray:
    """The module's formula, one block at a time."""
    heads, t_q, t_k = weights.shape
    m, n = min(t_q, size), min(t_k, size)
    out = np.zeros((heads, m, n))
    for i in range(m):
        queries = range(i * t_q // m, (i + 1) * t_q // m)
        for j in range(n):
            keys = range(j * t_k // n, (j + 1) * t_k // n)
            out[:, i, j] = weights[:, queries][:, :, keys].sum(axis=2).mean(axis=1)
    return out


def random_maps(heads: int, t_q: int, t_k: int, seed: int = 0) -> np.ndarray:
    generator = torch.Generator().manual_seed(seed)
    return torch.softmax(3 * torch.randn(heads, t_q, t_k, generator=generator, dtype=torch.float64), -1).numpy()


@pytest.mark.parametrize(("t_q", "t_k"), [(23, 23), (40, 7), (16, 16), (300, 300), (1, 5)])
def test_pooling_is_the_mean_over_query_blocks_of_the_sum_over_key_blocks(t_q, t_k):
    weights = random_maps(3, t_q, t_k)
    pooled = pool_map(weights)
    assert pooled.shape == (3, min(t_q, THUMBNAIL), min(t_k, THUMBNAIL))
    np.testing.assert_allclose(pooled, reference_pool(weights, THUMBNAIL), rtol=0, atol=1e-12)
    np.testing.assert_allclose(pooled.sum(-1), 1.0, atol=1e-12)  # still an attention distribution per row


def test_a_small_map_is_its_own_thumbnail_and_a_diagonal_stays_a_diagonal():
    small = random_maps(2, 9, 12)
    np.testing.assert_array_equal(pool_map(small), small)
    diagonal = np.eye(64)[None]  # a head attending to its own position, on a 64-token input
    np.testing.assert_allclose(pool_map(diagonal)[0], np.eye(16))


def test_thumbnail_bytes_are_the_weights_times_255_rounded_row_major():
    pooled = pool_map(random_maps(1, 23, 19))[0]
    decoded = np.frombuffer(base64.b64decode(thumbnail_bytes(pooled)), dtype=np.uint8).reshape(pooled.shape)
    np.testing.assert_array_equal(decoded, np.rint(pooled * 255))
    assert np.abs(decoded / 255 - pooled).max() <= 0.5 / 255 + 1e-12


def test_a_30_by_9_model_on_300_tokens_has_an_overview_of_under_100_kb():
    tokens, layers, heads = 300, 30, 9
    records = [
        AttentionMap("self", layer, torch.softmax(torch.randn(1, heads, tokens, tokens), -1)) for layer in range(layers)
    ]
    view = AttentionView(records, {"self": (["t"] * tokens, ["t"] * tokens)}, "")
    overview = overview_json(view, {HeadId("self", 4, 2), HeadId("self", 4, 7), HeadId("self", 29, 0)})
    size = len(json.dumps(overview, separators=(",", ":")))
    assert size < 100_000  # the full maps of one layer alone are 810,000 weights
    assert [(m["layer"], len(m["heads"]), m["rows"], m["columns"]) for m in overview["maps"]] == [
        (layer, heads, THUMBNAIL, THUMBNAIL) for layer in range(layers)
    ]
    assert [(m["layer"], m["off"]) for m in overview["maps"] if m["off"]] == [(4, [2, 7]), (29, [0])]
