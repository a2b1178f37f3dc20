"""Caps and memory estimates of attnlab.resources: the formula by hand, refusals and acceptances."""

from __future__ import annotations

import pytest

from attnlab import resources
from attnlab.errors import ConfigError, ResourceError, UsageError
from attnlab.limits import MAX_LAYERS, MAX_SPLIT_EXAMPLES, MAX_TEXT_CHARS, MAX_VECTOR_DIM
from attnlab.nn import build_model
from attnlab.nn.model_configs import (
    DecoderOnlyConfig,
    EncoderClassifierConfig,
    EncoderDecoderConfig,
    EncoderOnlyConfig,
)
from attnlab.resources import (
    MemoryEstimate,
    check_batch_size,
    check_decode_length,
    check_input_text,
    check_input_tokens,
    check_memory,
    check_split_sizes,
    check_training_resources,
    check_vector_dim,
    parameter_count,
    training_memory,
    word2vec_memory,
)
from attnlab.tasks.base import Example

GiB = 2**30


@pytest.mark.parametrize(
    "config",
    [
        EncoderDecoderConfig(vocab_size=11, tgt_vocab_size=13, layers=2, d_model=16, heads=2, d_ff=32),
        EncoderDecoderConfig(
            vocab_size=11,
            layers=1,
            decoder_layers=3,
            d_model=16,
            heads=4,
            d_ff=32,
            tie_embeddings=True,
            norm_first=True,
        ),
        EncoderDecoderConfig(vocab_size=11, layers=2, d_model=16, heads=2, d_ff=32, d_k=4, d_v=6, bias=False),
        EncoderDecoderConfig(
            vocab_size=11,
            layers=2,
            d_model=16,
            heads=2,
            d_ff=32,
            positional="learned",
            positional_combine="concat",
            positional_dim=4,
            max_len=30,
        ),
        DecoderOnlyConfig(vocab_size=50, layers=2, d_model=32, heads=4, d_ff=64, positional="learned", max_len=40),
        DecoderOnlyConfig(vocab_size=50, layers=2, d_model=32, heads=4, d_ff=64, tie_embeddings=True),
        EncoderClassifierConfig(vocab_size=7, layers=3, d_model=16, heads=2, d_ff=16),
        EncoderOnlyConfig(
            vocab_size=30,
            layers=2,
            d_model=16,
            heads=2,
            d_ff=64,
            positional="learned",
            max_len=20,
            type_vocab_size=2,
            embedding_norm=True,
            scale_embeddings=False,
            activation="gelu",
        ),
    ],
    ids=lambda c: type(c).__name__,
)
def test_parameter_count_equals_the_built_model(config):
    assert parameter_count(config) == build_model(config).num_parameters()


def test_training_memory_by_hand():
    # An encoder classifier: V does not enter the activations (no per-token output layer).
    config = EncoderClassifierConfig(vocab_size=10, layers=2, d_model=8, heads=2, d_ff=16)
    # embedding 10*8; per layer: attention 4*8*8 + 4*8 = 288, FFN 2*8*16 + 16 + 8 = 280, 2 LayerNorms 32
    # -> 600; classifier 8*2 + 2 = 18.
    parameters = 80 + 2 * 600 + 18
    assert parameter_count(config) == parameters
    estimate = training_memory(config, batch_size=3, seq_len=5)
    # 4 bytes * B * T * L * (12 d + 2 d_ff + 3 H T) = 4 * 3 * 5 * 2 * (96 + 32 + 30)
    # the sinusoidal position table, a buffer of max_len x d_model floats, 4 times at its peak (float64)
    table = resources.BUFFER_BUILD_FACTOR * config.max_len * 8 * 4
    assert estimate == MemoryEstimate(parameters, 16 * parameters + table, 4 * 3 * 5 * 2 * 158)
    assert estimate.total_bytes == 16 * parameters + table + 18_960


def test_a_position_table_too_large_for_memory_is_refused_before_it_is_built():
    """``model.max_len = 10**8`` has few parameters but a 6.4 GB sinusoidal table: it once passed
    the estimate and exhausted the memory."""
    long = SMALL.replace(max_len=10**8)
    with pytest.raises(ResourceError, match="needs about"):
        check_training_resources(long, batch_size=16, examples=_examples(100, 6), max_length=512, available=GiB)


def test_training_memory_of_an_encoder_decoder_counts_cross_attention_and_the_output_layer():
    config = EncoderDecoderConfig(
        vocab_size=10, tgt_vocab_size=20, layers=1, decoder_layers=2, d_model=8, heads=2, d_ff=16
    )
    estimate = training_memory(config, batch_size=1, seq_len=4)
    layer = 12 * 8 + 2 * 16 + 3 * 2 * 4  # 152
    cross = 6 * 8 + 3 * 2 * 4  # 72
    assert estimate.activation_bytes == 4 * 1 * 4 * (layer + 2 * (layer + cross) + 3 * 20)


def test_word2vec_memory():
    assert word2vec_memory(1000, 64).total_bytes == 3 * 4 * 1000 * 64


def test_check_memory_refuses_with_the_estimate_the_memory_and_the_keys():
    estimate = MemoryEstimate(1000, 3 * GiB, GiB)
    with pytest.raises(ResourceError) as caught:
        check_memory(
            estimate, what="training this model", reduce=("model.layers", "train.batch_size"), available=2 * GiB
        )
    message = str(caught.value)
    assert "about 4.0 GiB" in message and "2.0 GiB this machine has available" in message
    assert "model.layers, train.batch_size" in message and "\n" not in message
    check_memory(estimate, what="x", reduce=("k",), available=5 * GiB)  # fits: nothing raised


def test_check_memory_reads_the_machine_by_default(monkeypatch):
    monkeypatch.setattr(resources, "available_memory", lambda: GiB)
    with pytest.raises(ResourceError, match="1.0 GiB this machine"):
        check_memory(MemoryEstimate(1, 2 * GiB, 0), what="x", reduce=("k",))


def test_available_memory_is_positive():
    assert resources.available_memory() > 0


def test_available_memory_falls_back_to_sysconf(monkeypatch):
    def no_meminfo(*args, **kwargs):
        raise OSError("no /proc")

    monkeypatch.setattr(resources, "open", no_meminfo, raising=False)  # shadows the builtin in that module
    pages = {"SC_PAGE_SIZE": 4096, "SC_AVPHYS_PAGES": 1000, "SC_PHYS_PAGES": 5000}
    monkeypatch.setattr(resources.os, "sysconf", lambda name: pages[name])
    assert resources.available_memory() == 4096 * 1000


def _examples(count: int, length: int) -> list[Example]:
    return [Example(source=tuple(range(length)), target=tuple(range(length - 1))) for _ in range(count)]


SMALL = EncoderDecoderConfig(vocab_size=12, layers=2, d_model=16, heads=2, d_ff=32)


def test_a_normal_config_is_accepted():
    estimate = check_training_resources(SMALL, batch_size=16, examples=_examples(100, 6), max_length=512, available=GiB)
    assert estimate.total_bytes < GiB


@pytest.mark.parametrize(
    "change,key",
    [({"layers": 10_000}, "model.layers"), ({"decoder_layers": MAX_LAYERS + 1}, "model.decoder_layers")],
)
def test_too_many_layers_are_refused(change, key):
    with pytest.raises(ConfigError, match=f"{key}: .* more than the cap of {MAX_LAYERS:,}"):
        check_training_resources(
            SMALL.replace(**change), batch_size=16, examples=_examples(100, 6), max_length=512, available=1000 * GiB
        )


def test_a_model_too_large_for_memory_is_refused():
    huge = SMALL.replace(d_model=1_000_000_000)
    with pytest.raises(
        ResourceError, match="needs about .* GiB of memory .* more than the 1.0 GiB .* reduce model.layers"
    ):
        check_training_resources(huge, batch_size=16, examples=_examples(100, 6), max_length=512, available=GiB)


def test_a_large_batch_of_long_sequences_is_refused_by_its_activations():
    with pytest.raises(ResourceError, match="batches of 100 x 512 tokens"):
        check_training_resources(
            SMALL, batch_size=100, examples=_examples(100, 2000), max_length=512, available=100 * 2**20
        )


def test_the_batch_may_not_exceed_the_training_split():
    with pytest.raises(ConfigError, match=r"train.batch_size: 1,000,000,000 is larger than the training split \(100"):
        check_training_resources(SMALL, batch_size=10**9, examples=_examples(100, 6), max_length=512, available=GiB)
    check_batch_size(100, 100)


def test_an_empty_training_split_is_refused():
    with pytest.raises(ConfigError, match="train split is empty"):
        check_training_resources(SMALL, batch_size=1, examples=[], max_length=512, available=GiB)


def test_texts():
    check_input_text("abc")
    check_input_text("x" * MAX_TEXT_CHARS)
    for empty in ("", "   ", "\n"):
        with pytest.raises(UsageError, match="TEXT: empty input"):
            check_input_text(empty)
    with pytest.raises(UsageError, match="--text: 100,000 characters, more than the cap of 20,000"):
        check_input_text("a" * 100_000, what="--text")
    check_input_tokens(512, context=512)
    with pytest.raises(UsageError, match="513 tokens, longer than the model's context of 512 \\(model.max_len\\)"):
        check_input_tokens(513, context=512)


def test_split_sizes_and_vector_width():
    check_split_sizes({"name": "reverse", "train_size": MAX_SPLIT_EXAMPLES, "vocab_size": 10**9})
    with pytest.raises(ConfigError, match="task.valid_size: .* more than the cap"):
        check_split_sizes({"valid_size": MAX_SPLIT_EXAMPLES + 1})
    check_vector_dim(MAX_VECTOR_DIM)
    with pytest.raises(ConfigError, match="--dim: must lie in"):
        check_vector_dim(10**9)


def test_word2vec_is_refused_before_gensim_allocates(monkeypatch):
    from attnlab.embeddings import train_word2vec

    monkeypatch.setattr(resources, "available_memory", lambda: 2**20)  # 1 MiB free
    sentences = [["the", "cat", "sat"], ["the", "dog"]]
    # 4 words x 60,000 dims x 4 bytes x 3 copies = 2.9 MB > 1 MiB
    needs = "word2vec with 4 words x 60,000 dims needs about .* reduce dim \\(--dim\\)"
    with pytest.raises(ResourceError, match=needs):
        train_word2vec(sentences, 60_000)
    with pytest.raises(ConfigError, match="dim: must lie in"):
        train_word2vec(sentences, 10**9)


def test_decoding_stops_at_the_last_learned_position():
    learned = DecoderOnlyConfig(vocab_size=10, layers=1, d_model=8, heads=2, d_ff=8, positional="learned", max_len=32)
    assert check_decode_length(12, 20, config=learned) == 20
    assert check_decode_length(12, 64, config=learned) == 20
    assert check_decode_length(31, 64, config=learned) == 1
    with pytest.raises(UsageError, match="32 positions leave no room to generate .*model.max_len"):
        check_decode_length(32, 64, config=learned)
    assert check_decode_length(12, 4000, config=learned.replace(positional="sinusoidal")) == 4000  # extrapolates


def test_a_task_context_caps_decoding_whatever_the_positions():
    rope = DecoderOnlyConfig(vocab_size=10, layers=1, d_model=8, heads=2, d_ff=8, positional="rope", max_len=64)
    assert check_decode_length(12, 4000, config=rope) == 4000
    assert check_decode_length(12, 4000, config=rope, context=20) == 8
    with pytest.raises(UsageError, match="20 positions leave no room .*context of 20 \\(task.max_tokens\\)"):
        check_decode_length(20, 5, config=rope, context=20)
