"""Searches: cache invariance, batched-with-padding invariance, greedy = beam 1, beam = brute force;
sampling draws from the warped distribution, seeded."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from attnlab.errors import UsageError
from attnlab.generate.sampling import SamplingOptions, warp_logits
from attnlab.generate.search import (
    DecodeOptions,
    DecoderOnlyStepper,
    EncoderDecoderStepper,
    decode,
    generate_continuations,
    greedy_search,
    sample_search,
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
    with pytest.raises(UsageError, match="beam_size"):
        DecodeOptions(beam_size=0)
    with pytest.raises(UsageError, match="max_length"):
        DecodeOptions(max_length=0)


# ---- sampling ------------------------------------------------------------------------------------


class _FixedLogits:
    """A stepper whose next-token logits are always the same."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits

    def next_logits(self, prefix: torch.Tensor) -> torch.Tensor:
        return self.logits.expand(prefix.shape[0], -1)

    def reorder(self, index: torch.Tensor) -> None:
        pass


def test_draws_follow_the_warped_distribution():
    """20,000 one-token draws: frequencies within 0.015 of softmax(logits / T) after top-k."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 3.0])
    options = SamplingOptions(temperature=0.8, top_k=4, seed=7)
    rows = 20_000
    drawn = sample_search(
        _FixedLogits(logits),
        torch.zeros(rows, 1, dtype=torch.long),
        eos_id=99,
        banned=(),
        max_length=1,
        sampling=options,
    )
    counts = torch.bincount(torch.tensor([h.tokens[0] for h in drawn]), minlength=6).double() / rows
    expected = warp_logits(logits[None], options).softmax(-1)[0].double()
    assert counts[3] == 0 and counts[4] == 0  # outside the top 4
    assert (counts - expected).abs().max() < 0.015


def test_banned_ids_are_never_drawn():
    drawn = sample_search(
        _FixedLogits(torch.zeros(5)),
        torch.zeros(500, 1, dtype=torch.long),
        eos_id=99,
        banned=(0, 3),
        max_length=1,
        sampling=SamplingOptions(seed=0),
    )
    assert {h.tokens[0] for h in drawn} == {1, 2, 4}


@pytest.fixture(scope="module")
def lm():
    torch.manual_seed(5)
    return DecoderOnly(DecoderOnlyConfig(**{**CFG, "vocab_size": 40})).eval()


def _continue(model, sampling, prompts=((BOS, 3, 4), (BOS, 5, 6)), steps=12):
    options = DecodeOptions(max_length=steps, sampling=sampling)
    return [h.tokens for h in generate_continuations(model, prompts, eos_id=EOS, banned=(PAD, BOS), options=options)]


def test_the_same_seed_gives_the_same_tokens_and_others_differ(lm):
    first = _continue(lm, SamplingOptions(temperature=1.5, seed=11))
    assert _continue(lm, SamplingOptions(temperature=1.5, seed=11)) == first
    others = [_continue(lm, SamplingOptions(temperature=1.5, seed=seed)) for seed in (12, 13)]
    assert any(other != first for other in others)


def test_sampling_does_not_touch_the_global_rng(lm):
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    _continue(lm, SamplingOptions(temperature=1.0, seed=1))
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingOptions(temperature=0.0),
        SamplingOptions(temperature=1.0, top_k=1, seed=3),
        SamplingOptions(temperature=2.0, top_p=1e-6, seed=4),
    ],
    ids=["temperature 0", "top_k 1", "tiny top_p"],
)
def test_degenerate_sampling_is_greedy(lm, sampling):
    assert _continue(lm, sampling) == _continue(lm, None)


def test_sampling_options_are_validated():
    for bad, field in (
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 2.0}, "top_p"),
        ({"seed": -1}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"temperature": 1e9}, "temperature"),
        ({"top_k": 10**12}, "top_k"),
    ):
        with pytest.raises(UsageError, match=field):
            SamplingOptions(**bad)
    for bad, field in (
        ({"max_length": 10**9}, "max_length"),
        ({"max_length": 0}, "max_length"),
        ({"beam_size": 10**6}, "beam_size"),
    ):
        with pytest.raises(UsageError, match=field):
            DecodeOptions(**bad)
    with pytest.raises(UsageError, match="beam_size"):
        DecodeOptions(beam_size=2, sampling=SamplingOptions(temperature=1.0))
    DecodeOptions(beam_size=2, sampling=SamplingOptions(temperature=0.0))  # greedy options: no sampling


def test_streaming_sees_every_token_as_it_is_chosen(lm):
    seen: list[list[int]] = []
    prompt = torch.tensor([[BOS, 3, 4]])
    found = greedy_search(
        DecoderOnlyStepper(lm, use_cache=True),
        prompt,
        eos_id=EOS,
        banned=(PAD, BOS),
        max_length=10,
        on_token=lambda token: seen.append(token.tolist()),
    )[0]
    flat = [row[0] for row in seen]
    assert flat[: len(found.tokens)] == found.tokens
    assert len(flat) == len(found.tokens) + (1 if found.finished else 0)


def test_a_pad_id_that_is_a_real_token_is_read_as_a_token():
    """A pretrained LM's PAD id may be a real token (SmolLM2's is its EOS): the stepper marks every
    prefix position as a token, so a prompt holding that id decodes as the model reads it."""
    torch.manual_seed(2)
    model = DecoderOnly(DecoderOnlyConfig(**CFG)).eval()
    prompt = torch.tensor([[3, PAD, 4, 5]])
    with torch.no_grad():
        expected = model(prompt, is_token=torch.ones_like(prompt, dtype=torch.bool))[:, -1]
    for use_cache in (True, False):
        got = DecoderOnlyStepper(model, use_cache=use_cache).next_logits(prompt)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_encoder_decoder_runs_sample_too(seq2seq):
    src = _src()

    def run(sampling):
        options = DecodeOptions(max_length=8, sampling=sampling)
        return [h.tokens for h in decode(seq2seq, src, bos_id=BOS, eos_id=EOS, pad_id=PAD, options=options)]

    assert run(SamplingOptions(temperature=1.0, seed=5)) == run(SamplingOptions(temperature=1.0, seed=5))
    assert run(SamplingOptions(temperature=1.0, top_k=1, seed=5)) == run(None)
