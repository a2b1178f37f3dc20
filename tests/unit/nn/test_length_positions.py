"""Randomized positions (Ruoss et al. 2023), the record of trained learned positions, and a tiny model
of each kind training with each encoding used for length generalisation."""

from __future__ import annotations

import itertools
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from attnlab.errors import AttnlabWarning, ConfigError
from attnlab.nn import (
    DecoderOnly,
    DecoderOnlyConfig,
    EncoderClassifier,
    EncoderClassifierConfig,
    EncoderDecoder,
    EncoderDecoderConfig,
    build_model_to_load,
    sinusoidal_table,
)
from attnlab.nn import token_positions as positions_module
from attnlab.nn.positional import AddPositions, LearnedTable, SinusoidalTable, randomized_positions
from attnlab.resources import check_training_resources
from attnlab.run.weights import load_tensors_into

TINY = {"vocab_size": 13, "layers": 2, "d_model": 16, "heads": 4, "d_ff": 32, "dropout": 0.0, "relative_clip": 4}
RANDOMIZABLE = ["sinusoidal", "learned", "rope", "alibi", "relative"]


# ---- randomized positions ------------------------------------------------------------------------


def test_sampled_positions_are_sorted_distinct_and_below_m() -> None:
    torch.manual_seed(0)
    positions = randomized_positions(torch.ones(200, 9, dtype=torch.bool), 20)
    assert positions.shape == (200, 9) and positions.dtype == torch.int64
    assert bool((positions[:, 1:] > positions[:, :-1]).all())  # strictly increasing: sorted and distinct
    assert int(positions.min()) >= 0 and int(positions.max()) < 20
    assert len({tuple(row) for row in positions.tolist()}) > 150  # not one fixed subset


def test_sampled_subsets_are_uniform() -> None:
    """Each of the C(6, 2) = 15 subsets of [0, 6) is equally likely (sampling without replacement)."""
    torch.manual_seed(1)
    draws = randomized_positions(torch.ones(30000, 2, dtype=torch.bool), 6).tolist()
    counts = {pair: 0 for pair in itertools.combinations(range(6), 2)}
    for row in draws:
        counts[tuple(row)] += 1
    assert all(abs(count / 30000 - 1 / 15) < 0.008 for count in counts.values()), counts  # ~4 sd


def test_sampling_is_seeded_by_the_training_rng() -> None:
    is_token = torch.ones(4, 7, dtype=torch.bool)
    torch.manual_seed(5)
    first = randomized_positions(is_token, 64)
    torch.manual_seed(5)
    assert torch.equal(randomized_positions(is_token, 64), first)
    assert not torch.equal(randomized_positions(is_token, 64), first)  # the RNG moved on
    generator = torch.Generator().manual_seed(5)
    assert torch.equal(randomized_positions(is_token, 64, generator=generator), first)


def test_padding_takes_the_previous_tokens_position() -> None:
    torch.manual_seed(2)
    is_token = torch.tensor([[True] * 3 + [False] * 3, [False] * 2 + [True] * 4])
    positions = randomized_positions(is_token, 10)
    right, left = positions[0], positions[1]
    assert bool((right[1:3] > right[:2]).all()) and bool((right[3:] == right[2]).all())
    assert bool((left[3:] > left[2:5]).all()) and bool((left[:2] == left[2]).all())


def test_a_sequence_longer_than_m_is_an_error() -> None:
    with pytest.raises(ValueError, match="randomized_positions: M=4 is smaller than a training sequence of 6"):
        randomized_positions(torch.ones(1, 6, dtype=torch.bool), 4)


def test_table_rows_at_explicit_positions_follow_the_formula_past_max_len() -> None:
    encoding = AddPositions(SinusoidalTable(8, max_len=16), 8).double()
    positions = torch.tensor([[0, 5, 40], [3, 17, 99]])
    x = torch.zeros(2, 3, 8, dtype=torch.float64)
    expected = sinusoidal_table(100, 8, dtype=torch.float64)[positions]
    torch.testing.assert_close(encoding(x, 0, positions), expected, rtol=0, atol=1e-15)


def _pair(cls, config_cls, positional: str, **extra):
    """The same weights with randomized positions on (M = 40) and off."""
    torch.manual_seed(3)
    on = cls(config_cls(**TINY, positional=positional, randomized_positions=40, max_len=48, **extra)).double()
    off = cls(config_cls(**TINY, positional=positional, max_len=48, **extra)).double()
    off.load_state_dict(on.state_dict())
    return on, off


@pytest.mark.parametrize("positional", RANDOMIZABLE)
@pytest.mark.parametrize("kind", ["encoder_classifier", "decoder_only"])
def test_training_draws_positions_and_evaluation_uses_0_to_t(
    kind: str, positional: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cls, config_cls = (
        (EncoderClassifier, EncoderClassifierConfig)
        if kind == "encoder_classifier"
        else (DecoderOnly, DecoderOnlyConfig)
    )
    on, off = _pair(cls, config_cls, positional)
    tokens = torch.randint(1, 13, (3, 8))
    on.eval(), off.eval()
    torch.testing.assert_close(on(tokens), off(tokens), rtol=0, atol=0)  # evaluation: 0..T-1
    drawn = []
    sample = positions_module.randomized_positions
    monkeypatch.setattr(
        positions_module, "randomized_positions", lambda *a, **k: drawn.append(sample(*a, **k)) or drawn[-1]
    )
    on.train()
    torch.manual_seed(9)
    trained = on(tokens)
    assert len(drawn) == 1 and int(drawn[0].max()) < 40 and bool((drawn[0][:, 1:] > drawn[0][:, :-1]).all())
    assert not torch.allclose(trained, off(tokens))  # other positions than 0..T-1
    torch.manual_seed(9)
    torch.testing.assert_close(on(tokens), trained, rtol=0, atol=0)  # the same seed, the same draw


@pytest.mark.parametrize("positional", RANDOMIZABLE)
def test_a_generating_decoder_at_planned_positions_equals_its_teacher_forced_pass(positional: str) -> None:
    """Randomized-position evaluation of an encoder-decoder: feeding BOS + the reference one token a
    step through the KV cache at the positions planned for it gives, at every step, the logits of
    the one-pass (teacher-forced) forward, which draws the same positions from the same tokens; and
    they are not those of 0, 1, ... Past the planned length, positions go on one by one, capped at
    M - 1."""
    torch.manual_seed(3)
    model = EncoderDecoder(EncoderDecoderConfig(**TINY, positional=positional, randomized_positions=40, max_len=48))
    model = model.double().eval()
    src, tgt_in = torch.randint(1, 13, (3, 7)), torch.randint(1, 13, (3, 9))
    tgt_in[2, 6:] = 0  # a shorter reference, padded
    with positions_module.drawing_positions(model, 5):
        planned = positions_module.planned_positions(model, tgt_in, pad_id=0)
        memory = model.encode(src)
        teacher_forced = model.decode(tgt_in, memory)  # (B, T, V)
        state = model.new_state()
        state.positions = planned
        stepped = torch.cat([model.decode(tgt_in[:, t : t + 1], memory, state=state) for t in range(9)], dim=1)
    assert positions_module.planned_positions(model, tgt_in, pad_id=0) is None  # outside the block
    real = tgt_in != 0
    torch.testing.assert_close(stepped[real], teacher_forced[real], rtol=1e-10, atol=1e-10)
    assert not torch.allclose(teacher_forced, model.decode(tgt_in, model.encode(src)))
    assert bool((planned[:, 1:6] > planned[:, :5]).all()) and int(planned.max()) < 40
    past_the_reference = [min(int(planned[2, 5]) + step, 39) for step in (1, 2, 3)]
    assert planned[2, 6:].tolist() == past_the_reference  # a shorter reference's row goes on one by one
    beyond = positions_module._extended(torch.tensor([[3, 30, 38]]), 6, 40)
    assert beyond.tolist() == [[3, 30, 38, 39, 39, 39]]


def test_m_below_the_longest_training_example_is_a_config_error() -> None:
    config = EncoderClassifierConfig(**TINY, positional="alibi", randomized_positions=5)
    examples = [SimpleNamespace(source=(1,) * 4, target=None), SimpleNamespace(source=(1,) * 7, target=None)]
    with pytest.raises(ConfigError, match=r"model.randomized_positions: M=5 is smaller than the longest training "):
        check_training_resources(config, batch_size=1, examples=examples, max_length=64, available=2**40)


# ---- learned positions past what training reached -------------------------------------------------


def test_learned_positions_record_training_and_warn_once_past_it() -> None:
    table = LearnedTable(4, max_len=32)
    assert int(table.trained_positions) == 0
    table(5), table(3, offset=2)
    assert int(table.trained_positions) == 5
    table.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        table(5)  # within what training reached: silent
    with pytest.warns(AttnlabWarning, match=r"^learned positions 6\.\.16 were never trained \(training reached 5"):
        table(16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        table(20)  # once per table
    with pytest.raises(ValueError, match="sequence of length 40 exceeds max_len=32 of the learned positions"):
        table(40)


def test_randomized_learned_positions_record_the_largest_drawn() -> None:
    torch.manual_seed(4)
    model = EncoderClassifier(
        EncoderClassifierConfig(**TINY, positional="learned", randomized_positions=30, max_len=30)
    )
    model(torch.randint(1, 13, (8, 6)))
    record = int(model.encoder.embedding.positional.table.trained_positions)
    assert 6 <= record <= 30


def test_the_record_is_saved_and_older_weights_load_without_it(tmp_path: Path) -> None:
    torch.manual_seed(6)
    config = DecoderOnlyConfig(**TINY, positional="learned", max_len=32)
    trained = DecoderOnly(config)
    trained(torch.randint(1, 13, (2, 10)))
    state = trained.state_dict()
    key = "decoder.embedding.positional.table.trained_positions"
    assert int(state[key]) == 10
    loaded = build_model_to_load(config)
    load_tensors_into(loaded, dict(state), {}, path=tmp_path / "w", assign=True)
    assert int(loaded.decoder.embedding.positional.table.trained_positions) == 10
    older = {name: tensor for name, tensor in state.items() if name != key}
    for assign in (False, True):
        fresh = build_model_to_load(config) if assign else DecoderOnly(config)
        load_tensors_into(fresh, dict(older), {}, path=tmp_path / "w", assign=assign)
        assert int(fresh.decoder.embedding.positional.table.trained_positions) == 0  # unknown: no warning
        fresh.eval()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            fresh(torch.randint(1, 13, (1, 20)))


# ---- a tiny model of each kind trains with each encoding ------------------------------------------

ENCODINGS = [
    {"positional": "sinusoidal"},
    {"positional": "learned"},
    {"positional": "rope"},
    {"positional": "alibi"},
    {"positional": "relative"},
    *({"positional": name, "randomized_positions": 24} for name in RANDOMIZABLE),
]


def _loss(model, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    if logits.dim() == 2:  # a classifier: is the first symbol the last one?
        return torch.nn.functional.cross_entropy(logits, labels)
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


@pytest.mark.parametrize("encoding", ENCODINGS, ids=lambda e: "+".join(str(v) for v in e.values()))
@pytest.mark.parametrize("kind", ["encoder_classifier", "decoder_only"])
def test_a_tiny_model_trains(kind: str, encoding: dict) -> None:
    torch.manual_seed(7)
    if kind == "encoder_classifier":
        model = EncoderClassifier(EncoderClassifierConfig(**{**TINY, "layers": 1}, max_len=24, **encoding))
        tokens = torch.randint(1, 5, (16, 6))
        labels = (tokens[:, 0] == tokens[:, -1]).long()
    else:
        model = DecoderOnly(DecoderOnlyConfig(**{**TINY, "layers": 1}, max_len=24, **encoding))
        start = torch.randint(1, 13, (16, 1))
        tokens = (start + 3 * torch.arange(6)) % 12 + 1  # x_{t+1} = x_t + 3 (mod 12)
        labels = torch.zeros(16, dtype=torch.long)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.eval()
    with torch.no_grad():
        first = float(_loss(model, tokens, labels))
    model.train()
    for _ in range(25):
        optimizer.zero_grad()
        loss = _loss(model, tokens, labels)
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        last = float(_loss(model, tokens, labels))
    assert last < 0.6 * first, (first, last)


def test_experiment_config_names_the_new_fields() -> None:
    from attnlab.experiment import ExperimentConfig

    task = {"name": "dyck1", "max_train_length": 6}
    experiment = ExperimentConfig(task=task, model={"kind": "encoder_classifier", "positional": "alibi"})
    assert experiment.to_dict()["model"]["relative_clip"] == 16  # written to config.json
    assert experiment.to_dict()["model"]["randomized_positions"] is None
    bad = ExperimentConfig(
        task=task, model={"kind": "encoder_classifier", "positional": "none", "randomized_positions": 8}
    )
    with pytest.raises(ConfigError, match=r"^model.randomized_positions: does not apply to positional='none'"):
        bad.model_config(vocab_size=8, num_classes=2, pad_id=0)
