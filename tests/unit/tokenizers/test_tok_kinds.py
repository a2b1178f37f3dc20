"""Tokenizers: every kind, the seed's contraction example, specials, UNK, file round trips, fuzzing.

No __init__.py here on purpose: a package named ``tokenizers`` under tests/unit would shadow
Hugging Face's ``tokenizers`` on sys.path.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnlab.errors import DataError
from attnlab.tokenizers import KINDS, SPECIAL_TOKENS, Tokenizer, infer_kind, train_tokenizer

CORPUS = [
    "Isn't this project amazing?",
    "The cat sat on the mat. The dog didn't.",
    "Tokenization splits text into tokens; it's the first step.",
    "naïve café — déjà vu, 東京 and emoji 👍",
] * 5
SEED_SENTENCE = "Isn't this project amazing?"


@pytest.fixture(scope="module")
def trained() -> dict[str, Tokenizer]:
    return {kind: train_tokenizer(kind, CORPUS, vocab_size=400) for kind in KINDS}


@pytest.mark.parametrize("kind", list(KINDS))
def test_special_tokens_come_first_with_pad_zero(trained, kind):
    tok = trained[kind]
    assert [tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id, tok.cls_id, tok.sep_id] == [0, 1, 2, 3, 4, 5]
    for role, text in SPECIAL_TOKENS.items():
        assert tok.token_to_id(text) == tok.special_ids[role]
        assert tok.id_to_token(tok.special_ids[role]) == text


@pytest.mark.parametrize("kind", list(KINDS))
def test_save_load_round_trip(trained, kind, tmp_path):
    tok = trained[kind]
    (tmp_path / "tokenizer.json").write_text(tok.to_json(), encoding="utf-8")
    back = Tokenizer.load(tmp_path / "tokenizer.json")
    assert back.kind == kind
    assert back.vocab == tok.vocab
    text = SEED_SENTENCE + " unseen-word Zyx 🦜"
    assert back.encode(text) == tok.encode(text)
    assert back.special_ids == tok.special_ids


@pytest.mark.parametrize("kind", [kind for kind in KINDS if kind != "wordpiece"])
def test_a_corpus_always_gives_the_same_ids(trained, kind):
    again = [train_tokenizer(kind, CORPUS, vocab_size=400) for _ in range(3)]
    for tok in again:
        assert tok.vocab == trained[kind].vocab
        assert tok.encode(SEED_SENTENCE) == trained[kind].encode(SEED_SENTENCE)


def test_wordpiece_numbers_its_pieces_in_a_fixed_order(trained):
    """HF's WordPiece trainer numbers the pieces it learns in hash-map order, different on every
    call (and on ties between merges may learn other pieces: tokenizers#1794, which training
    therefore leaves to rank 0 alone). The ids are the specials, then the pieces sorted."""
    for tok in [trained["wordpiece"], *(train_tokenizer("wordpiece", CORPUS, vocab_size=400) for _ in range(3))]:
        by_id = sorted(tok.vocab, key=tok.vocab.get)
        assert by_id[:6] == list(SPECIAL_TOKENS.values()) and by_id[6:] == sorted(by_id[6:])
        assert sorted(tok.vocab.values()) == list(range(len(tok.vocab)))


def test_rule_kind_splits_contractions_as_in_the_seed(trained):
    assert trained["rule"].tokenize(SEED_SENTENCE) == ["Is", "n't", "this", "project", "amazing", "?"]
    other = "I'm sure they'll see John's cat"
    assert train_tokenizer("rule", [other], 100).tokenize(other) == [
        "I",
        "'m",
        "sure",
        "they",
        "'ll",
        "see",
        "John",
        "'s",
        "cat",
    ]


def test_word_kind_splits_on_whitespace_only(trained):
    assert trained["word"].tokenize(SEED_SENTENCE) == ["Isn't", "this", "project", "amazing?"]


@pytest.mark.parametrize("kind", ["word", "rule", "wordpiece"])
def test_unknown_word_becomes_unk(trained, kind):
    tok = trained[kind]
    ids = tok.encode("cat qqqqzzzz")
    assert tok.unk_id in ids
    assert ids[0] != tok.unk_id  # a known word keeps its own id


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_unseen_characters_never_become_unk(trained, kind):
    tok = trained[kind]
    assert tok.unk_id not in tok.encode("ZQ 🦜 ∮ \x00")


def test_text_never_injects_special_ids(trained):
    for kind in ("rule", "char", "wordpiece", "bpe"):
        ids = trained[kind].encode("a [PAD] [EOS] b")
        assert trained[kind].pad_id not in ids and trained[kind].eos_id not in ids


def test_allow_special_reads_special_spellings_and_leaves_typed_text_alone(trained):
    tok = trained["bpe"]
    ids = tok.encode("a [EOS] b", allow_special=True)
    assert tok.eos_id in ids and [i for i in ids if i != tok.eos_id] == [*tok.encode("a "), *tok.encode(" b")]
    assert tok.eos_id not in tok.encode("a [EOS] b")  # the switch does not stick


def test_decode_skips_specials_but_keeps_unk(trained):
    tok = trained["char"]
    ids = [tok.bos_id, *tok.encode("cat"), tok.eos_id, tok.pad_id]
    assert tok.decode(ids) == "cat"
    assert tok.decode(ids, skip_special=False) == "[BOS]cat[EOS][PAD]"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])


@pytest.mark.parametrize("kind", list(KINDS))
def test_lone_surrogate_is_a_clean_value_error(trained, kind):
    with pytest.raises(ValueError, match="lone surrogate U\\+D800 at character 1"):
        trained[kind].encode("a\ud800b")
    with pytest.raises(DataError):
        trained[kind].tokenize("\udfff")


def test_load_a_foreign_hugging_face_file(trained, tmp_path):
    spec = json.loads(trained["bpe"].hf.to_str())
    rename = {"[PAD]": "<pad>", "[UNK]": "<unk>", "[BOS]": "<s>", "[EOS]": "</s>"}  # as RoBERTa spells them
    for added in spec["added_tokens"]:
        added["content"] = rename.get(added["content"], added["content"])
    spec["model"]["vocab"] = {rename.get(t, t): i for t, i in spec["model"]["vocab"].items()}
    spec["pre_tokenizer"] = {"type": "Whitespace"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    tok = Tokenizer.load(tmp_path / "tokenizer.json")
    assert tok.kind == "hf"
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 2, 3)
    assert tok.id_to_token(tok.bos_id) == "<s>"


def test_bert_vocab_txt(tmp_path):
    lines = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "this", "is", "not", "non", "##sense", "."]
    (tmp_path / "vocab.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    tok = Tokenizer.from_vocab_txt(tmp_path / "vocab.txt")
    # Agarwal §2.1's BertTokenizer example; the vocabulary is uncased, so input is lowercased.
    assert tok.tokenize("This is not nonsense.") == ["this", "is", "not", "non", "##sense", "."]
    assert tok.kind == "wordpiece"
    assert (tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id) == (0, 1, 2, 3)
    assert tok.bos_id >= len(lines)  # missing specials are appended, not renumbered
    assert tok.encode("zebra") == [tok.unk_id]
    (tmp_path / "tokenizer.json").write_text(tok.to_json(), encoding="utf-8")
    assert Tokenizer.load(tmp_path / "tokenizer.json").encode("this is") == tok.encode("this is")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "empty vocabulary file"),
        (b"[PAD]\n\nthis\n", ":2: empty token"),
        (b"[PAD]\nthis\nthis\n", ":3: duplicate token 'this' \\(first on line 2\\)"),
        (b"[PAD]\nok\n\xff\xfe\n", ":3: bytes that are not UTF-8"),
    ],
)
def test_bad_vocab_txt(tmp_path, content, message):
    path = tmp_path / "vocab.txt"
    path.write_bytes(content)
    with pytest.raises(DataError, match=f"vocab.txt{message}" if message.startswith(":") else message):
        Tokenizer.from_vocab_txt(path)


def test_bad_tokenizer_json(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text('{\n  "version": "1.0",\n  oops\n}', encoding="utf-8")
    with pytest.raises(DataError, match="tokenizer.json:3: not valid JSON"):
        Tokenizer.load(path)
    path.write_text('{"hello": 1}', encoding="utf-8")
    with pytest.raises(DataError, match="not a Hugging Face tokenizer.json"):
        Tokenizer.load(path)
    with pytest.raises(DataError, match="cannot read"):
        Tokenizer.load(tmp_path / "missing.json")


def test_infer_kind_of_each_builder(trained):
    assert {kind: infer_kind(tok.hf) for kind, tok in trained.items()} == {k: k for k in KINDS}


def test_unknown_kind_and_tiny_vocab():
    with pytest.raises(ValueError, match="unknown tokenizer kind 'sentencepiece'"):
        train_tokenizer("sentencepiece", CORPUS, 100)
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer("word", CORPUS, 3)


# ---- fuzzing ----------------------------------------------------------------------------------

# Arbitrary code points, surrogates included, plus the troublemakers the issue names.
TRICKY = st.sampled_from(["\u200d", "👩", "💻", "\u0301", "\u0300", "\x00", "\ud800", "\udc00", " ", "\n", "'", "n't"])
ANY_TEXT = st.lists(st.one_of(st.characters(codec=None), st.characters(codec="utf-8"), TRICKY), max_size=30).map(
    "".join
)
VALID_TEXT = st.lists(
    st.one_of(st.characters(codec="utf-8"), TRICKY.filter(lambda s: s not in ("\ud800", "\udc00"))), max_size=30
).map("".join)
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _is_valid(text: str) -> bool:
    return not any(0xD800 <= ord(ch) <= 0xDFFF for ch in text)


@pytest.mark.parametrize("kind", list(KINDS))
@FUZZ
@given(text=ANY_TEXT)
def test_fuzz_no_crash_but_the_documented_value_error(trained, kind, text):
    tok = trained[kind]
    if _is_valid(text):
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert isinstance(tok.decode(ids), str)
        assert len(tok.tokenize(text)) == len(ids)
    else:
        with pytest.raises(ValueError, match="lone surrogate"):
            tok.encode(text)


@pytest.mark.parametrize("kind", ["char", "bpe"])
@FUZZ
@given(text=VALID_TEXT)
def test_fuzz_decode_inverts_encode(trained, kind, text):
    tok = trained[kind]
    assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_vocabulary_past_the_cap_is_refused_before_training(kind):
    """10**12 once aborted the process inside the tokenizers library's allocator."""
    from attnlab.limits import MAX_VOCAB_SIZE

    with pytest.raises(ValueError, match=f"vocab_size: 1,000,000,000,000 is more than the cap of {MAX_VOCAB_SIZE:,}"):
        train_tokenizer(kind, CORPUS, 10**12)
