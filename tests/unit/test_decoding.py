"""Decoding: cache invariance, batched-with-padding invariance, greedy = beam 1, beam = brute force."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from attnlab.decoding import (
    DecodeOptions,
    DecoderOnlyStepper,
    EncoderDecoderStepper,
    decode,
    generate_continuations,
    greedy_search,
)
from attnlab.nn import DecoderOnly, DecoderOnlyConfig, EncoderDecoder, EncoderDecoderConfig

PAD, BOS, EOS = 0, 1, 2
CFG = {"vocab_size": 9, "layers": 2, "d_model": 32, "heads": 4, "d_ff": 64, "dropout": 0.0}


@pytest.fixture(params=[{}, {"attention": "hard"}, {"score": "additive", "norm_first": True}], ids=str)
def seq2seq(request):
    torch.manual_seed(1)
    return EncoderDecoder(EncoderDecoderConfig(**CFG, **request.param)).eval()


def _src(batch=3, length=6, seed=0):
    return torch.randint(3, 9, (batch, length), generator=torch.Generator().manual_seed(seed))


def _logit_trace(stepper, prefix, steps):
    logits = []
    for _ in range(steps):
        step = stepper.next_logits(prefix)
        logits.append(step)
        prefix = torch.cat([prefix, step.argmax(-1, keepdim=True)], 1)
    return torch.stack(logits, 1), prefix


def test_cached_and_uncached_logits_agree(seq2seq):
    src = _src()
    start = torch.full((3, 1), BOS)
    cached, tokens_c = _logit_trace(EncoderDecoderStepper(seq2seq, src, use_cache=True), start, 8)
    plain, tokens_p = _logit_trace(EncoderDecoderStepper(seq2seq, src, use_cache=False), start, 8)
    assert torch.equal(tokens_c, tokens_p)
    torch.testing.assert_close(cached, plain, atol=1e-5, rtol=0)


@pytest.mark.parametrize("beam_size", [1, 3])
def test_cache_does_not_change_tokens(seq2seq, beam_size):
    src = _src()
    runs = [
        decode(
            seq2seq,
            src,
            bos_id=BOS,
            eos_id=EOS,
            pad_id=PAD,
            options=DecodeOptions(max_length=10, beam_size=beam_size, use_cache=use_cache),
        )
        for use_cache in (True, False)
    ]
    assert [h.tokens for h in runs[0]] == [h.tokens for h in runs[1]]
    for a, b in zip(*runs):
        assert a.log_prob == pytest.approx(b.log_prob, abs=1e-4)


@pytest.mark.parametrize("beam_size", [1, 4])
def test_batched_with_padding_equals_alone(seq2seq, beam_size):
    sources = [_src(1, 6, seed=1)[0], _src(1, 3, seed=2)[0], _src(1, 5, seed=3)[0]]
    padded = torch.stack([F.pad(s, (0, 6 - len(s)), value=PAD) for s in sources])
    options = DecodeOptions(max_length=9, beam_size=beam_size)
    together = decode(seq2seq, padded, bos_id=BOS, eos_id=EOS, pad_id=PAD, options=options)
    for source, hypothesis in zip(sources, together):
        alone = decode(seq2seq, source[None], bos_id=BOS, eos_id=EOS, pad_id=PAD, options=options)[0]
        assert alone.tokens == hypothesis.tokens
        assert alone.log_prob == pytest.approx(hypothesis.log_prob, abs=1e-4)


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.0])
@pytest.mark.parametrize("seed", range(16))
def test_rows_that_stop_early_are_frozen_so_batch_equals_alone(seed, length_penalty):
    """A row whose search has stopped must not keep collecting hypotheses while other rows run
    (with alpha > 0 a later, longer one could outscore what the row alone returns)."""
    torch.manual_seed(seed)
    model = EncoderDecoder(
        EncoderDecoderConfig(**{**CFG, "vocab_size": 12, "d_model": 16, "heads": 2, "d_ff": 32})
    ).eval()
    generator = torch.Generator().manual_seed(seed)
    sources = [torch.cat([torch.randint(3, 12, (n,), generator=generator), torch.tensor([EOS])]) for n in (3, 7, 5)]
    padded = torch.stack([F.pad(s, (0, 8 - len(s)), value=PAD) for s in sources])
    options = DecodeOptions(max_length=12, beam_size=2, length_penalty=length_penalty)
    together = decode(model, padded, bos_id=BOS, eos_id=EOS, pad_id=PAD, options=options)
    for source, hypothesis in zip(sources, together):
        alone = decode(model, source[None], bos_id=BOS, eos_id=EOS, pad_id=PAD, options=options)[0]
        assert (alone.tokens, alone.finished) == (hypothesis.tokens, hypothesis.finished)
        assert alone.log_prob == pytest.approx(hypothesis.log_prob, abs=1e-4)


def test_beam_of_one_is_greedy(seq2seq):
    src = _src()
    greedy = decode(seq2seq, src, bos_id=BOS, eos_id=EOS, pad_id=PAD, options=DecodeOptions(max_length=8))
    stepper = EncoderDecoderStepper(seq2seq, src, use_cache=True)
    direct = greedy_search(stepper, torch.full((3, 1), BOS), eos_id=EOS, banned=(PAD, BOS), max_length=8)
    assert [h.tokens for h in greedy] == [h.tokens for h in direct]


@torch.no_grad()
def _sequence_log_prob(model, src, tokens):
    tgt_in = torch.tensor([[BOS, *tokens[:-1]]])
    log_probs = torch.log_softmax(model(src, tgt_in)[0].double(), -1)
    log_probs[:, [PAD, BOS]] = -math.inf
    log_probs = torch.log_softmax(log_probs, -1)
    return float(sum(log_probs[i, t] for i, t in enumerate(tokens)))


def test_wide_beam_finds_the_best_sequence_by_brute_force():
    """With a beam wider than every prefix, beam search is exhaustive (alpha = 0)."""
    torch.manual_seed(3)
    model = EncoderDecoder(EncoderDecoderConfig(**{**CFG, "vocab_size": 5})).eval()
    src = torch.tensor([[3, 4, 3]])
    symbols, max_length = (3, 4), 3
    best = max(
        (seq + (EOS,) for n in range(max_length) for seq in itertools.product(symbols, repeat=n)),
        key=lambda seq: _sequence_log_prob(model, src, list(seq)),
    )
    found = decode(
        model,
        src,
        bos_id=BOS,
        eos_id=EOS,
        pad_id=PAD,
        options=DecodeOptions(max_length=max_length, beam_size=8, length_penalty=0.0),
    )[0]
    assert found.finished and tuple(found.tokens) + (EOS,) == best
    assert found.log_prob == pytest.approx(_sequence_log_prob(model, src, list(best)), abs=1e-5)


def test_decoding_leaves_the_training_mode_alone(seq2seq):
    seq2seq.train()
    decode(seq2seq, _src(), bos_id=BOS, eos_id=EOS, pad_id=PAD, options=DecodeOptions(max_length=3))
    assert seq2seq.training


@pytest.mark.parametrize("beam_size", [1, 3])
def test_decoder_only_cache_and_mixed_prompt_lengths(beam_size):
    model = DecoderOnly(DecoderOnlyConfig(**CFG)).eval()
    prompts = [[BOS, 3, 4, 5], [BOS, 6], [BOS, 7, 8, 3], [BOS]]
    options = DecodeOptions(max_length=6, beam_size=beam_size)
    together = generate_continuations(model, prompts, eos_id=EOS, banned=(PAD, BOS), options=options)
    plain = generate_continuations(
        model,
        prompts,
        eos_id=EOS,
        banned=(PAD, BOS),
        options=DecodeOptions(max_length=6, beam_size=beam_size, use_cache=False),
    )
    assert [h.tokens for h in together] == [h.tokens for h in plain]
    for prompt, hypothesis in zip(prompts, together):
        alone = generate_continuations(model, [prompt], eos_id=EOS, banned=(PAD, BOS), options=options)[0]
        assert alone.tokens == hypothesis.tokens


def test_decoder_only_cached_logits_agree():
    model = DecoderOnly(DecoderOnlyConfig(**CFG)).eval()
    prefix = torch.tensor([[BOS, 3, 4], [BOS, 5, 6]])
    cached, _ = _logit_trace(DecoderOnlyStepper(model, use_cache=True), prefix, 6)
    plain, _ = _logit_trace(DecoderOnlyStepper(model, use_cache=False), prefix, 6)
    torch.testing.assert_close(cached, plain, atol=1e-5, rtol=0)


def test_options_are_validated():
    with pytest.raises(ValueError, match="beam_size"):
        DecodeOptions(beam_size=0)
    with pytest.raises(ValueError, match="max_length"):
        DecodeOptions(max_length=0)
