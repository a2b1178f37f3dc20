"""Physical pruning of grouped-query attention: a query head takes its rows of W_Q and columns of
W^O with it; a key/value head's rows of W_K and W_V go only with the last query head of its group.
The pruned model computes what the masked one computes (Michel §2.3, xi_h = 0)."""

from __future__ import annotations

import pytest
import torch

from attnlab.analysis.pruning import prune_model
from attnlab.errors import UsageError
from attnlab.head_ids import HeadId, mask_without
from attnlab.nn import build_model, masking_heads
from attnlab.nn.head_subsets import head_subset_state
from attnlab.nn.model_configs import DecoderOnlyConfig
from attnlab.nn.multi_head import MultiHeadAttention, _share_key_values


def tiny_llama(**overrides) -> DecoderOnlyConfig:  # noqa: ANN003
    """A Llama-style decoder: rotary positions, 6 query heads sharing 2 key/value heads, RMSNorm,
    SwiGLU, pre-norm, no biases."""
    options = dict(
        vocab_size=40,
        layers=2,
        d_model=24,
        heads=6,
        kv_heads=2,
        d_ff=32,
        positional="rope",
        norm="rms",
        activation="swiglu",
        norm_first=True,
        bias=False,
        dropout=0.0,
        pad_id=0,
    )
    return DecoderOnlyConfig(**{**options, **overrides})


# layer 0 loses all of group 0 (heads 0-2) and head 4; layer 1 loses head 5 only
PRUNED = [HeadId("self", 0, 0), HeadId("self", 0, 1), HeadId("self", 0, 2), HeadId("self", 0, 4), HeadId("self", 1, 5)]


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    model = build_model(tiny_llama()).eval()
    return model, prune_model(model, PRUNED)


def test_key_value_heads_go_only_with_their_whole_group(models) -> None:
    model, pruned = models
    assert pruned.config.heads_per_layer == {"self": [2, 5]}
    assert pruned.config.kv_groups == {"self": [[0, 0], [0, 0, 0, 1, 1]]}
    first, second = (site.module for site in pruned.attention_sites())
    d = 4  # d_k = d_v = 24 / 6
    assert (first.kv_heads, second.kv_heads) == (1, 2)
    assert first.in_proj_weight.shape == ((2 + 1 + 1) * d, 24)
    assert second.in_proj_weight.shape == ((5 + 2 + 2) * d, 24)
    assert first.out_proj.weight.shape == (24, 2 * d) and second.out_proj.weight.shape == (24, 5 * d)
    original = model.attention_sites()[0].module.in_proj_weight
    w_k = original[6 * d : 8 * d]  # K heads 0, 1
    assert torch.equal(first.in_proj_weight[2 * d : 3 * d], w_k[d:])  # only K head 1 is left
    assert torch.equal(first.in_proj_weight[: 2 * d], torch.cat([original[3 * d : 4 * d], original[5 * d : 6 * d]]))
    w_v = original[8 * d : 10 * d]  # V heads 0, 1
    assert torch.equal(first.in_proj_weight[3 * d :], w_v[d:])


def test_an_equal_grouping_keeps_the_fast_path_and_an_irregular_one_gathers(models) -> None:
    _, pruned = models
    first, second = (site.module for site in pruned.attention_sites())
    assert first._share is _share_key_values  # two query heads on one K/V head: equal groups
    assert second._share == second._gather_key_values  # 3 + 2: irregular
    assert MultiHeadAttention(24, 6, kv_index=[0, 0, 0, 1, 1, 1])._share is _share_key_values


def test_the_pruned_model_computes_the_masked_one_on_a_padded_batch(models) -> None:
    model, pruned = models
    tokens = torch.randint(1, 40, (3, 9))
    is_token = torch.ones(3, 9, dtype=torch.bool)
    is_token[1, :3] = False  # left padding
    is_token[2, 6:] = False  # right padding
    with torch.no_grad():
        with masking_heads(model, mask_without(model, PRUNED)):
            masked = model(tokens, is_token=is_token)
        smaller = pruned(tokens, is_token=is_token)
    assert (masked - smaller)[is_token].abs().max() < 1e-5


def test_the_pruned_model_decodes_with_a_cache_of_its_kept_key_value_heads(models) -> None:
    _, pruned = models
    tokens = torch.randint(1, 40, (2, 7))
    with torch.no_grad():
        full = pruned(tokens)
        state = pruned.new_state()
        steps = [pruned(tokens[:, :4], state=state)] + [pruned(tokens[:, t : t + 1], state=state) for t in range(4, 7)]
    assert (torch.cat(steps, dim=1) - full).abs().max() < 1e-5
    assert [cache.key.shape[1] for cache in state.layers] == [1, 2]


def test_pruning_a_pruned_model_again_composes(models) -> None:
    model, pruned = models
    again = prune_model(pruned, [HeadId("self", 1, 0)])  # old head 1:0
    assert again.config.kv_groups == {"self": [[0, 0], [0, 0, 1, 1]]}
    tokens = torch.randint(1, 40, (2, 6))
    with torch.no_grad():
        with masking_heads(model, mask_without(model, [*PRUNED, HeadId("self", 1, 0)])):
            masked = model(tokens)
        assert (again(tokens) - masked).abs().max() < 1e-5


def test_the_config_round_trips_and_refuses_bad_groups(models) -> None:
    from attnlab.resources import parameter_count

    _, pruned = models
    config = pruned.config
    assert parameter_count(config) == pruned.num_parameters()
    assert DecoderOnlyConfig.from_dict({k: v for k, v in config.to_dict().items() if k != "kind"}) == config
    with pytest.raises(ValueError, match="needs kv_groups"):
        tiny_llama(d_k=4, heads_per_layer={"self": [2, 5]})
    with pytest.raises(ValueError, match=r"kv_groups\['self'\]\[1\]"):
        tiny_llama(d_k=4, heads_per_layer={"self": [2, 5]}, kv_groups={"self": [[0, 0], [0, 2, 2, 2, 2]]})
    with pytest.raises(ValueError, match="needs heads_per_layer"):
        tiny_llama(kv_groups={"self": [[0], [0]]})
    with pytest.raises(ValueError, match="kv_index"):
        MultiHeadAttention(24, 3, kv_index=[0, 2, 2])


def _with_q_k_norms(qk_norm: str):
    torch.manual_seed(1)
    model = build_model(tiny_llama(qk_norm=qk_norm)).eval()
    with torch.no_grad():
        for site in model.attention_sites():
            site.module.q_norm.weight.normal_(1.0, 0.3)
            site.module.k_norm.weight.normal_(1.0, 0.3)
    return model


def test_a_per_head_q_k_norm_is_kept_whole_and_the_pruned_model_computes_the_masked_one() -> None:
    model = _with_q_k_norms("head")
    pruned = prune_model(model, PRUNED)
    for before, after in zip(model.attention_sites(), pruned.attention_sites(), strict=True):
        assert torch.equal(after.module.q_norm.weight, before.module.q_norm.weight)
        assert torch.equal(after.module.k_norm.weight, before.module.k_norm.weight)
    tokens = torch.randint(1, 40, (2, 7))
    with torch.no_grad():
        with masking_heads(model, mask_without(model, PRUNED)):
            masked = model(tokens)
        assert (pruned(tokens) - masked).abs().max() < 1e-5


def test_a_whole_projection_q_k_norm_keeps_the_gains_of_the_kept_heads() -> None:
    """OLMo 2's norms over all heads: a head subset keeps the kept heads' entries of the gains
    (layer 0 keeps query heads 3 and 5 and key/value head 1; d_k = 4); physical pruning is refused,
    since the norm's statistic over all heads would change."""
    model = _with_q_k_norms("full")
    module = model.attention_sites()[0].module
    state = head_subset_state(module, [3, 5])
    assert torch.equal(state["q_norm.weight"], module.q_norm.weight.view(6, 4)[[3, 5]].flatten())
    assert torch.equal(state["k_norm.weight"], module.k_norm.weight.view(2, 4)[[1]].flatten())
    with pytest.raises(UsageError, match="qk_norm 'full'"):
        prune_model(model, PRUNED)
