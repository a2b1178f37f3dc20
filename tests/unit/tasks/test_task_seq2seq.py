"""Seq2seq generators: targets recomputed independently, lengths, disjoint splits, batching."""

from __future__ import annotations

import pytest
import torch

from attnlab.errors import ConfigError, DataError
from attnlab.tasks import Example, fit_length, get_task, make_batches

SPLITS = ("train", "valid", "test", "length_generalisation")


def _text(task, ids):
    return "".join(task.vocab.tokens[i] for i in ids)


@pytest.mark.parametrize("name", ["copy", "reverse", "sort"])
def test_string_tasks(name):
    task = get_task(name, max_train_length=5, train_size=300, valid_size=50, test_size=50, seed=4)
    expected = {"copy": lambda s: s, "reverse": lambda s: s[::-1], "sort": lambda s: "".join(sorted(s))}[name]
    seen = {}
    for split in SPLITS:
        examples = task.split(split)
        for e in examples:
            source = _text(task, e.source[:-1])
            assert e.source[-1] == task.eos_id
            assert _text(task, e.target) == expected(source)
            assert len(source) == e.length
            assert (1 <= e.length <= 5) if split != "length_generalisation" else (5 < e.length <= 10)
        seen[split] = {e.source for e in examples}
    assert not seen["train"] & seen["test"] and not seen["train"] & seen["valid"]


def test_addition_is_right():
    task = get_task("addition", max_train_length=3, train_size=200, valid_size=20, test_size=20)
    for split in SPLITS:
        for e in task.split(split):
            a, b = _text(task, e.source[:-1]).split("+")
            assert int(_text(task, e.target)) == int(a) + int(b)
            assert max(len(a), len(b)) == e.length
    assert task.num_distinct(1) == 100 and task.num_distinct(2) == 10**4 - 10**2
    train = {e.source for e in task.train()}
    assert not train & {e.source for e in task.test()}


def test_batches_pad_with_masks_and_shift_the_target():
    examples = [Example(source=(5, 6, 2), target=(7, 8, 9), length=2), Example(source=(5, 2), target=(7,), length=1)]
    (batch,) = make_batches(examples, 2, pad_id=0, bos_id=1, eos_id=2, shuffle=False, bucket=False)
    assert batch.src.tolist() == [[5, 6, 2], [5, 2, 0]]
    assert batch.src_is_token.tolist() == [[True, True, True], [True, True, False]]
    assert batch.tgt_in.tolist() == [[1, 7, 8, 9], [1, 7, 0, 0]]
    assert batch.tgt_out.tolist() == [[7, 8, 9, 2], [7, 2, 0, 0]]
    assert batch.lengths.tolist() == [3, 2]
    assert batch.labels is None


def test_shuffle_is_deterministic_and_buckets_reduce_padding():
    task = get_task("copy", max_train_length=20, train_size=400)
    kw = dict(pad_id=0, bos_id=1, eos_id=2, seed=7)
    first = [b.src.tolist() for b in make_batches(task.train(), 16, **kw)]
    assert first == [b.src.tolist() for b in make_batches(task.train(), 16, **kw)]
    assert first != [b.src.tolist() for b in make_batches(task.train(), 16, **{**kw, "seed": 8})]
    padding = lambda bucket: sum(  # noqa: E731
        int((~b.src_is_token).sum()) for b in make_batches(task.train(), 16, bucket=bucket, **kw)
    )
    assert padding(True) < padding(False) / 3
    assert sum(len(b) for b in make_batches(task.train(), 16, **kw)) == 400


def test_recognition_batch_has_labels():
    task = get_task("parity", train_size=10)
    batch = next(make_batches(task.train(), 10, pad_id=0, bos_id=1, eos_id=2))
    assert batch.labels.dtype == torch.int64 and batch.tgt_in is None
    last = batch.lengths - 1
    assert (batch.src[torch.arange(10), last] == task.eos_id).all()


def test_too_long_is_rejected_or_truncated_on_request():
    long = Example(source=(5, 6, 7, 8, 2), target=(5, 6, 7, 8), length=4)
    with pytest.raises(DataError, match="example 0: the source needs 5 positions.*max_length=3"):
        fit_length([long], 3, eos_id=2)
    (cut,) = fit_length([long], 3, eos_id=2, truncate=True)
    assert cut.source == (5, 6, 2) and cut.target == (5, 6)
    with pytest.raises(ConfigError, match="never truncated"):
        fit_length([Example(source=(3, 4, 4, 2), label=1, length=3)], 3, eos_id=2, truncate=True)


def test_count_too_long_counts_what_fit_length_cuts():
    from attnlab.tasks.batching import count_too_long

    examples = [
        Example(source=(5, 2), target=(5,), length=1),  # 2 positions each
        Example(source=(5, 6, 7, 2), target=(5, 6, 7), length=3),  # source 4, target 3 + 1
        Example(source=(5, 6, 2), target=(5, 6, 7, 8), length=2),
    ]  # target 4 + 1 = 5
    assert [count_too_long(examples, n) for n in (2, 3, 4, 5)] == [2, 2, 1, 0]
    cut = fit_length(examples, 3, eos_id=2, truncate=True)
    assert sum(a != b for a, b in zip(examples, cut, strict=True)) == count_too_long(examples, 3)


@pytest.mark.parametrize(
    "name", ["copy", "reverse", "addition", "reverse_string", "duplicate_string", "binary_addition", "even_pairs"]
)
def test_every_synthetic_task_has_length_bins(name):
    """``eval_lengths`` bins are splits of their own for the seq2seq and Delétang tasks too: the
    lengths of the bin, ``length_generalisation_size`` examples, answers still right."""
    bins = [[7, 9], [12, 15]]
    task = get_task(name, max_train_length=5, train_size=40, valid_size=10, test_size=10, eval_lengths=bins, seed=2)
    assert task.split_names()[-2:] == ("length_7_9", "length_12_15")
    plain = get_task(name, max_train_length=5, train_size=40, valid_size=10, test_size=10, seed=2)
    for split, (low, high) in zip(task.split_names()[-2:], bins):
        examples = task.split(split)
        assert len(examples) == task.length_generalisation_size
        assert {e.length for e in examples} <= set(range(low, high + 1))
        assert len({e.length for e in examples}) > 1  # drawn over the bin, not one length
    # The other splits do not depend on the bins.
    for split in SPLITS:
        assert task.split(split) == plain.split(split)
    with pytest.raises(ConfigError, match="split: unknown split 'length_4_5'"):
        task.split("length_4_5")
    with pytest.raises(ConfigError, match=r"eval_lengths: bin 1 \[2, 5\] must start above 5"):
        get_task(name, max_train_length=5, eval_lengths=[[2, 5]])
