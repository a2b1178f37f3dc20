"""The three models: causality, padding invariance, EOS readout, caches, head masks and learning."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnlab.nn import (
    DecoderOnly,
    DecoderOnlyConfig,
    EncoderClassifier,
    EncoderClassifierConfig,
    EncoderDecoder,
    EncoderDecoderConfig,
    build_model,
    full_head_mask,
    masking_heads,
)

VOCAB = 13
SMALL = {"vocab_size": VOCAB, "layers": 2, "d_model": 32, "heads": 4, "d_ff": 64, "dropout": 0.0}
VARIANTS = [
    {},
    {"attention": "hard"},
    {"score": "additive"},
    {"score": "bilinear", "norm_first": True},
    {"positional": "learned", "positional_combine": "concat", "positional_dim": 8},
    {"positional": "gehring_sum", "activation": "gelu"},
]


def _tokens(b, t, seed=0):
    return torch.randint(1, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_decoder_only_is_causal(variant):
    model = DecoderOnly(DecoderOnlyConfig(**SMALL, **variant)).eval()
    tokens = _tokens(2, 9)
    changed = tokens.clone()
    changed[:, 5:] = _tokens(2, 4, seed=1)
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :5], b[:, :5], atol=1e-6, rtol=0)
    assert not torch.allclose(a[:, 5:], b[:, 5:])


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_encoder_decoder_decoder_is_causal(variant):
    model = EncoderDecoder(EncoderDecoderConfig(**SMALL, **variant)).eval()
    src, tgt = _tokens(2, 7), _tokens(2, 8, seed=2)
    changed = tgt.clone()
    changed[:, 4:] = _tokens(2, 4, seed=3)
    torch.testing.assert_close(model(src, tgt)[:, :4], model(src, changed)[:, :4], atol=1e-6, rtol=0)


def test_encoder_without_positions_is_permutation_equivariant():
    model = EncoderDecoder(EncoderDecoderConfig(**SMALL, positional="none")).double().eval()
    src = _tokens(2, 7)
    perm = torch.randperm(7)
    memory = model.encode(src).states
    torch.testing.assert_close(model.encode(src[:, perm]).states, memory[:, perm], atol=1e-10, rtol=0)
    # ... and the decoder's output does not depend on the source order at all
    tgt = _tokens(2, 5, seed=4)
    torch.testing.assert_close(model(src[:, perm], tgt), model(src, tgt), atol=1e-10, rtol=0)


@pytest.mark.parametrize("pooling", ["eos", "first", "mean"])
@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_classifier_ignores_padding(pooling, attention):
    model = EncoderClassifier(EncoderClassifierConfig(**SMALL, pooling=pooling, attention=attention)).eval()
    tokens = _tokens(3, 6)
    padded = F.pad(tokens, (0, 4), value=0)  # pad_id = 0
    torch.testing.assert_close(model(padded), model(tokens), atol=1e-5, rtol=1e-5)


def test_classifier_reads_the_last_real_position():
    """Hahn §3: the label comes from y_n^(L), the end-of-sequence position."""
    model = EncoderClassifier(EncoderClassifierConfig(**SMALL)).eval()
    tokens = torch.tensor([[3, 4, 5, 2, 0, 0], [3, 4, 5, 6, 7, 2]])
    logits = model(tokens)
    hidden = model.encoder(tokens)
    expected = model.classifier(torch.stack([hidden[0, 3], hidden[1, 5]]))
    torch.testing.assert_close(logits, expected)


def test_padding_in_a_batch_equals_each_alone():
    model = EncoderDecoder(EncoderDecoderConfig(**SMALL)).eval()
    long_src, short_src = _tokens(1, 8), _tokens(1, 5, seed=5)
    tgt = _tokens(2, 4, seed=6)
    batch = torch.cat([long_src, F.pad(short_src, (0, 3))])
    together = model(batch, tgt)
    torch.testing.assert_close(together[0:1], model(long_src, tgt[0:1]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(together[1:2], model(short_src, tgt[1:2]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_encoder_decoder_cache_equals_full(attention):
    model = EncoderDecoder(EncoderDecoderConfig(**SMALL, attention=attention)).eval()
    src, tgt = _tokens(2, 7), _tokens(2, 6, seed=7)
    full = model(src, tgt)
    memory, state = model.encode(src), model.new_state()
    steps = [model.decode(tgt[:, t : t + 1], memory, state=state) for t in range(6)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


def test_cache_keeps_padding_masked_at_later_steps():
    """A PAD fed at step t stays masked as a key at every later step, as in the full pass."""
    model = DecoderOnly(DecoderOnlyConfig(**SMALL)).eval()
    tokens = torch.tensor([[3, 0, 5, 6, 0, 7], [4, 5, 0, 0, 8, 9]])
    full = model(tokens)
    state = model.new_state()
    steps = torch.cat([model(tokens[:, t : t + 1], state=state) for t in range(6)], 1)
    real = tokens != 0  # outputs at PAD queries are unused; compare real positions
    torch.testing.assert_close(steps[real], full[real], atol=1e-5, rtol=1e-5)


def test_decoder_only_cache_equals_full():
    model = DecoderOnly(DecoderOnlyConfig(**SMALL)).eval()
    tokens = _tokens(2, 7)
    full = model(tokens)
    state = model.new_state()
    steps = [model(tokens[:, t : t + 1], state=state) for t in range(7)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["encoder_decoder", "encoder_classifier", "decoder_only"])
def test_head_mask_shapes_and_all_ones(kind):
    config_cls = {
        "encoder_decoder": EncoderDecoderConfig,
        "encoder_classifier": EncoderClassifierConfig,
        "decoder_only": DecoderOnlyConfig,
    }[kind]
    model = build_model(config_cls(**SMALL)).eval()
    expected_kinds = {"encoder_decoder": {"encoder_self", "decoder_self", "cross"}}.get(kind, {"self"})
    shapes = model.head_mask_shapes()
    assert set(shapes) == expected_kinds and all(s == (2, 4) for s in shapes.values())
    args = (_tokens(2, 5), _tokens(2, 4)) if kind == "encoder_decoder" else (_tokens(2, 5),)
    plain = model(*args)
    assert torch.equal(_masked(model, *args, head_mask=full_head_mask(shapes)), plain)
    assert torch.equal(_masked(model, *args, head_mask=full_head_mask(shapes, batch=2)), plain)
    zeros = full_head_mask(shapes, 0.0)
    assert not torch.allclose(_masked(model, *args, head_mask=zeros), plain)
    assert all(not m.hooks for m in model.modules() if hasattr(m, "hooks"))  # nothing left installed


def _masked(model, *args, head_mask):  # noqa: ANN001, ANN002, ANN202
    with masking_heads(model, head_mask):
        return model(*args)


@pytest.mark.parametrize("bad", [VOCAB, VOCAB + 100, -1])
def test_ids_outside_the_vocabulary_are_named(bad):
    src, tgt = _tokens(2, 3), _tokens(2, 3)
    for tokens in (src, tgt):
        tokens[1, 2] = bad
        with pytest.raises(ValueError, match=rf"tokens: id {bad} is outside the vocabulary \[0, {VOCAB}\)"):
            EncoderDecoder(EncoderDecoderConfig(**SMALL))(src, tgt)
        tokens[1, 2] = 1
    with pytest.raises(ValueError, match="outside the vocabulary"):
        DecoderOnly(DecoderOnlyConfig(**SMALL))(torch.tensor([[1, bad]]))


def test_head_mask_errors_name_the_kind():
    model = EncoderDecoder(EncoderDecoderConfig(**SMALL))
    src, tgt = _tokens(1, 3), _tokens(1, 3)
    with pytest.raises(ValueError, match="no 'self' attention"):
        _masked(model, src, tgt, head_mask={"self": torch.ones(2, 4)})
    with pytest.raises(ValueError, match=r"head_mask\['cross'\] has shape \(3, 4\)"):
        _masked(model, src, tgt, head_mask={"cross": torch.ones(3, 4)})


def test_all_heads_of_a_layer_masked_is_fine():
    model = EncoderDecoder(EncoderDecoderConfig(**SMALL)).eval()
    mask = full_head_mask(model.head_mask_shapes())
    mask["cross"][1] = 0.0
    out = _masked(model, _tokens(2, 5), _tokens(2, 4), head_mask=mask)
    assert torch.isfinite(out).all()


def _train_steps(model, batch_fn, loss_fn, steps=40, lr=3e-3):
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = loss_fn(model, *batch_fn())
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(
    "variant", [{}, {"attention": "hard", "straight_through": True}, {"score": "additive"}], ids=str
)
def test_encoder_decoder_learns_to_copy(variant):
    model = EncoderDecoder(EncoderDecoderConfig(**SMALL, **variant))
    src = _tokens(16, 6)
    tgt_in = F.pad(src, (1, 0), value=1)[:, :-1]  # BOS=1, then the target shifted right

    def loss_fn(m, s, ti, to):
        return F.cross_entropy(m(s, ti).flatten(0, 1), to.flatten())

    losses = _train_steps(model, lambda: (src, tgt_in, src), loss_fn)
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize("variant", [{}, {"attention": "hard", "straight_through": True}], ids=str)
def test_encoder_classifier_learns(variant):
    model = EncoderClassifier(EncoderClassifierConfig(**SMALL, **variant))
    tokens = _tokens(32, 6)
    labels = (tokens[:, 0] > VOCAB // 2).long()  # the label sits in the first token

    def loss_fn(m, x, y):
        return F.cross_entropy(m(x), y)

    losses = _train_steps(model, lambda: (tokens, labels), loss_fn)
    assert losses[-1] < 0.5 * losses[0]


def test_decoder_only_learns():
    model = DecoderOnly(DecoderOnlyConfig(**SMALL))
    tokens = torch.arange(1, 9).repeat(8, 1) % (VOCAB - 1) + 1  # a fixed counting sequence

    def loss_fn(m, x):
        return F.cross_entropy(m(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())

    losses = _train_steps(model, lambda: (tokens,), loss_fn)
    assert losses[-1] < 0.5 * losses[0]


def test_tied_embeddings_share_storage():
    model = DecoderOnly(DecoderOnlyConfig(**SMALL, tie_embeddings=True))
    assert model.lm_head.weight is model.decoder.embedding.token.weight


LLAMA_LIKE = {"positional": "rope", "kv_heads": 2, "norm": "rms", "activation": "swiglu", "norm_first": True,
              "bias": False, "tie_embeddings": True}  # fmt: skip
TO_LOAD = [
    (DecoderOnlyConfig, LLAMA_LIKE),
    (
        DecoderOnlyConfig,
        {**LLAMA_LIKE, "d_k": 8, "heads_per_layer": {"self": [3, 4]}, "kv_groups": {"self": [[0, 0, 1], [0, 1, 1, 1]]}},
    ),
    (DecoderOnlyConfig, {"positional": "sinusoidal"}),
    (EncoderDecoderConfig, {"tgt_vocab_size": VOCAB + 2}),
    (EncoderClassifierConfig, {"num_classes": 2, "positional": "learned"}),
]


@pytest.mark.parametrize(
    ("config_cls", "options"), TO_LOAD, ids=["llama", "pruned-gqa", "sinusoidal", "enc-dec", "classifier"]
)
def test_a_model_built_to_load_takes_saved_weights_and_equals_the_original(config_cls, options, tmp_path):
    """build_model_to_load skips the random initialisation, and after loading by assignment is the
    saved model: same outputs, buffers and tied parameters."""
    from attnlab.nn import build_model_to_load
    from attnlab.run.weights import load_tensors_into, weights_to_tensors

    torch.manual_seed(0)
    config = config_cls(**{**SMALL, **options})
    original = build_model(config).eval()
    torch.manual_seed(0)
    empty = build_model_to_load(config)
    torch.manual_seed(0)
    initialised = dict(build_model(config).named_parameters())  # the same seed: what init would give
    assert any(not torch.equal(p, initialised[name]) for name, p in empty.named_parameters() if p.numel() > 64)
    tensors, metadata = weights_to_tensors(original)
    load_tensors_into(empty, {name: t.clone() for name, t in tensors.items()}, metadata, path=tmp_path, assign=True)
    empty.eval()
    assert [name for name, _ in empty.named_parameters()] == [name for name, _ in original.named_parameters()]
    for (name, mine), (_, theirs) in zip(empty.named_buffers(), original.named_buffers(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0, msg=name)
    if options.get("tie_embeddings"):
        assert empty.lm_head.weight is empty.decoder.embedding.token.weight
    src, tgt = _tokens(2, 7), _tokens(2, 5, seed=1)
    with torch.no_grad():
        if config_cls is EncoderDecoderConfig:
            pair = empty(src, tgt), original(src, tgt)
        else:
            pair = empty(src), original(src)
    torch.testing.assert_close(*pair, rtol=0, atol=0)
