"""BERT WordPiece from vocab.txt and foreign tokenizer.json files, checked against Hugging Face.

The reference is transformers' own ``BertTokenizerFast`` loaded with ``from_pretrained`` from a
folder holding the same file, as a user of a BERT checkpoint would load it. Its default
(``do_lower_case=True``) is what an uncased vocabulary is used with; a cased checkpoint ships
``do_lower_case=False``. attnlab must give the same tokens and ids, choosing the casing from the
vocabulary itself (issue 23: an uncased vocabulary had turned "Hello" and "Café" into [UNK]).

The vocabularies are made here from a small varied corpus (no downloads): every character, its
``##`` form, every whole word and some prefixes and suffixes, so greedy longest-match WordPiece has
real choices to make. The uncased one also holds symbols that have no lower-case form ("ℝ", "𝐀",
as bert-base-uncased's vocab.txt does), which the old rule (any ``isupper`` character makes a
vocabulary cased) mistook for capitals.

No __init__.py here on purpose: see test_tok_kinds.py.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from tokenizers import normalizers, pre_tokenizers

from attnlab.cli import main
from attnlab.tokenizers import Tokenizer, is_uncased

transformers = pytest.importorskip("transformers")

CORPUS = [
    "Hello World! The quick brown fox jumps over the lazy dog.",
    "Isn't this project amazing? It's 3.14 times better, about 1,000,000 tokens.",
    "Café, naïve, Ærøskøbing, Ångström, São Paulo, Zürich, Dvořák, Łódź.",
    "東京タワー and 北京 are CJK; 한국어 too. Emoji: 👍🏽 and ❤️.",
    "HTML <b>bold</b> & e-mail user@example.com (see §2.1) — “quotes” … ok!",
    "Straße STRASSE İstanbul ΣΊΣΥΦΟΣ Ωμέγα München ÉCOLE Noël",
    "WordPiece splits unaffable into un ##aff ##able; BERT-base has 110M parameters.",
]
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[unused0]", "[unused1]"]
NO_LOWER_CASE = ["ℝ", "ℕ", "𝐀", "ϒ"]
"""Upper-case symbols with no lower-case form: in uncased vocabularies too."""

TEXTS = [
    "Hello World!",
    "HELLO world, hello WORLD.",
    "Café NAÏVE ærøskøbing ÅNGSTRÖM são paulo ZÜRICH dvořák ŁÓDŹ",
    "Ce\u0301dille: e + combining acute, and NFC é; NFD e\u0301.",
    "東京タワーへ行こう！北京烤鸭。한국어 문장입니다。",
    "3.14159 1,000,000 42nd 2024-05-17 12:30pm $9.99 ½ ² ①",
    "Punctuation!!! ...?? (a) [b] {c} <d> \"e\" 'f' `g` ~h~ #i @j",
    "Straße STRASSE İstanbul ΣΊΣΥΦΟΣ ωμέγα Ωμέγα",
    "tabs\tand\nnewlines\r\nand\u00a0nbsp and\u200bzero\u200dwidth and \x00 nul \x7f",
    "Emoji 👍🏽❤️👩‍💻 mixed with ℝ and 𝐀𝐁𝐂",
    "unaffable UNAFFABLE Unaffable parameters Parameters",
    "x" * 120 + " a word longer than 100 characters is unknown",
    "",
    "   ",
    "ℝ ℕ ϒ 𝐀 – symbols without a lower case",
]


# ---- the vocabularies -------------------------------------------------------------------------


def _pieces(lines: list[str]) -> list[str]:
    """Whole words, their 2-4 character prefixes and ##suffixes, and every character and ##char."""
    split = pre_tokenizers.BertPreTokenizer()
    words = Counter(word for line in lines for word, _ in split.pre_tokenize_str(line))
    pieces: set[str] = set()
    for word in words:
        pieces.add(word)
        for size in (2, 3, 4):
            if len(word) > size:
                pieces.update([word[:size], "##" + word[-size:]])
        for ch in word:
            pieces.update([ch, "##" + ch])
    return sorted(pieces)


def _write_vocab(folder: Path, pieces: list[str], *, cased: bool) -> Path:
    folder.mkdir()
    (folder / "vocab.txt").write_text("\n".join(SPECIALS + pieces) + "\n", encoding="utf-8")
    # What a Hugging Face checkpoint ships: do_lower_case False for a cased vocabulary.
    (folder / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": not cased}), encoding="utf-8")
    return folder / "vocab.txt"


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bert")
    uncased_text = [normalizers.BertNormalizer(lowercase=True).normalize_str(line) for line in CORPUS]
    cased_text = [normalizers.BertNormalizer(lowercase=False).normalize_str(line) for line in CORPUS]
    uncased = sorted(set(_pieces(uncased_text)) | set(NO_LOWER_CASE))
    _write_vocab(root / "uncased", uncased, cased=False)
    _write_vocab(root / "cased", _pieces(cased_text), cased=True)
    return {"uncased": root / "uncased", "cased": root / "cased"}


def _hf(folder: Path, **options):
    return transformers.BertTokenizerFast.from_pretrained(str(folder), local_files_only=True, **options)


def _hf_tokens_and_ids(hf, text: str) -> tuple[list[str], list[int]]:
    encoding = hf(text, add_special_tokens=False)
    return encoding.tokens(), encoding["input_ids"]


def _ours(tok: Tokenizer, text: str) -> tuple[list[str], list[int]]:
    return tok.tokenize(text), tok.encode(text)


# ---- casing ---------------------------------------------------------------------------------


def test_is_uncased_follows_lowercasing_not_isupper():
    assert is_uncased(["[PAD]", "[CLS]", "<s>", "[unused0]", "the", "##ing", "cafe", "ℝ", "𝐀", "ϒ", "東京"])
    assert not is_uncased(["[PAD]", "the", "The"])
    assert not is_uncased(["##É"])
    assert not is_uncased(["İ"])  # lowercases to two code points: still a change
    assert is_uncased(["[PAD]", "[UNK]"]) and is_uncased([])  # nothing to lowercase: uncased


def test_vocabularies_are_detected(folders):
    assert Tokenizer.from_vocab_txt(folders["uncased"] / "vocab.txt").hf.normalizer.lowercase
    assert not Tokenizer.from_vocab_txt(folders["cased"] / "vocab.txt").hf.normalizer.lowercase


@pytest.mark.parametrize("casing", ["uncased", "cased"])
def test_matches_hugging_face_on_varied_text(folders, casing):
    ours = Tokenizer.from_vocab_txt(folders[casing] / "vocab.txt")
    hf = _hf(folders[casing])  # its tokenizer_config.json says do_lower_case as a checkpoint would
    assert hf.backend_tokenizer.normalizer.lowercase == (casing == "uncased")
    for text in TEXTS:
        assert _ours(ours, text) == _hf_tokens_and_ids(hf, text), text


def test_uncased_capitals_and_accents_are_no_longer_unk(folders):
    tok = Tokenizer.from_vocab_txt(folders["uncased"] / "vocab.txt")
    assert tok.tokenize("Hello World, Café NAÏVE!") == ["hello", "world", ",", "cafe", "naive", "!"]
    cased = Tokenizer.from_vocab_txt(folders["cased"] / "vocab.txt")
    assert cased.tokenize("Hello Café") == ["Hello", "Café"]
    assert cased.tokenize("hello") != ["hello"]  # "hello" is not a cased word: split or UNK


@pytest.mark.parametrize(("casing", "lowercase"), [("uncased", False), ("cased", True)])
def test_explicit_lowercase_matches_hugging_face_do_lower_case(folders, casing, lowercase):
    ours = Tokenizer.from_vocab_txt(folders[casing] / "vocab.txt", lowercase=lowercase)
    hf = _hf(folders[casing], do_lower_case=lowercase)
    assert hf.backend_tokenizer.normalizer.lowercase == lowercase
    for text in TEXTS:
        assert _ours(ours, text) == _hf_tokens_and_ids(hf, text), text


# Words of the corpus with random casing and accents, joined by random separators, plus any
# Unicode text (surrogates excluded: they are rejected, see test_tok_kinds.py).
WORDS = st.sampled_from(sorted({w for line in CORPUS for w in line.split()} | set(NO_LOWER_CASE)))
CASED_WORD = st.tuples(WORDS, st.sampled_from([str.lower, str.upper, str.title, str.swapcase, lambda s: s])).map(
    lambda pair: pair[1](pair[0])
)
SEPARATOR = st.sampled_from([" ", "  ", "\t", "\n", "", "-", "\u0301", "\u00a0", ",", "東"])
MIXED = st.lists(st.tuples(CASED_WORD, SEPARATOR).map("".join), max_size=12).map("".join)
ANY = st.text(st.characters(codec="utf-8"), max_size=40)
HYPOTHESIS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def pairs(folders) -> dict[str, tuple[Tokenizer, object]]:
    return {
        casing: (Tokenizer.from_vocab_txt(folders[casing] / "vocab.txt"), _hf(folders[casing]))
        for casing in ("uncased", "cased")
    }


@pytest.mark.parametrize("casing", ["uncased", "cased"])
@HYPOTHESIS
@given(text=st.one_of(MIXED, ANY))
def test_matches_hugging_face_on_generated_text(pairs, casing, text):
    # Hugging Face matches its special tokens inside text; attnlab never does (text is text).
    assume(not any(special in text for special in SPECIALS))
    ours, hf = pairs[casing]
    assert _ours(ours, text) == _hf_tokens_and_ids(hf, text)


# ---- a tokenizer.json that pads and truncates ---------------------------------------------------


def _padded_folder(folders, tmp_path: Path, casing: str) -> Path:
    backend = _hf(folders[casing]).backend_tokenizer
    backend.enable_padding(length=128, pad_id=0, pad_token="[PAD]")
    backend.enable_truncation(max_length=128)
    folder = tmp_path / f"padded-{casing}"
    folder.mkdir()
    backend.save(str(folder / "tokenizer.json"))
    # As a checkpoint ships it: transformers rebuilds the normalizer from do_lower_case.
    config = (folders[casing] / "tokenizer_config.json").read_text(encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(config, encoding="utf-8")
    spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    assert spec["padding"]["strategy"] == {"Fixed": 128} and spec["truncation"]["max_length"] == 128
    return folder


LONG = " ".join(["Hello World, Café!"] * 60)  # about 240 tokens: past the file's truncation


@pytest.mark.parametrize("casing", ["uncased", "cased"])
def test_padding_and_truncation_of_a_tokenizer_json_are_ignored(folders, tmp_path, casing):
    folder = _padded_folder(folders, tmp_path, casing)
    ours = Tokenizer.load(folder / "tokenizer.json")
    hf = _hf(folder)  # Hugging Face, called for one text, pads and truncates nothing either
    for text in [*TEXTS, LONG]:
        tokens, ids = _ours(ours, text)
        assert "[PAD]" not in tokens and ours.pad_id not in ids
        assert (tokens, ids) == _hf_tokens_and_ids(hf, text), text
    assert len(ours.encode(LONG)) > 128
    # Its tokenizer.json is written without them: a run's copy never pads either.
    saved = json.loads(ours.to_json())
    assert saved["padding"] is None and saved["truncation"] is None


# ---- the command line -------------------------------------------------------------------------


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    out, err = capsys.readouterr()
    return exit_info.value.code or 0, out, err


@pytest.mark.parametrize("casing", ["uncased", "cased"])
def test_cli_vocab_follows_the_vocabulary_casing(capsys, folders, casing):
    hf = _hf(folders[casing])
    for text in ["Hello World, Café NAÏVE!", TEXTS[4], TEXTS[9]]:
        code, out, err = _run(
            capsys, "tokenize", "--kind", "wordpiece", "--vocab", str(folders[casing] / "vocab.txt"), text
        )
        assert code == 0 and err == ""
        assert json.loads(out) == _hf_tokens_and_ids(hf, text)[0]
        code, out, _ = _run(capsys, "tokenize", "--vocab", str(folders[casing] / "vocab.txt"), "--ids", text)
        assert code == 0 and json.loads(out) == _hf_tokens_and_ids(hf, text)[1]


def test_cli_lowercase_flags_override(capsys, folders):
    uncased = str(folders["uncased"] / "vocab.txt")
    code, out, _ = _run(capsys, "tokenize", "--vocab", uncased, "Hello hello")
    assert code == 0 and json.loads(out) == ["hello", "hello"]
    code, out, _ = _run(capsys, "tokenize", "--vocab", uncased, "--no-lowercase", "Hello hello")
    assert (
        code == 0
        and json.loads(out) == _hf_tokens_and_ids(_hf(folders["uncased"], do_lower_case=False), "Hello hello")[0]
    )
    assert json.loads(out)[-1] == "hello" and json.loads(out)[0] != "hello"
    cased = str(folders["cased"] / "vocab.txt")
    code, out, _ = _run(capsys, "tokenize", "--vocab", cased, "--lowercase", "Café")
    assert code == 0 and json.loads(out) == _hf_tokens_and_ids(_hf(folders["cased"], do_lower_case=True), "Café")[0]


def test_cli_lowercase_needs_vocab(capsys, folders, tmp_path):
    folder = _padded_folder(folders, tmp_path, "uncased")
    code, out, err = _run(capsys, "tokenize", "--tokenizer", str(folder / "tokenizer.json"), "--lowercase", "Hi")
    assert code == 2 and out == ""
    assert err.startswith("error: --lowercase: applies to --vocab only") and err.count("\n") == 1


def test_cli_help_states_the_casing_rule(capsys):
    code, out, _ = _run(capsys, "tokenize", "--help")
    text = " ".join(out.split())
    assert code == 0 and "--no-lowercase" in text
    assert "an uncased vocab.txt (lowercasing changes none of its pieces" in text
    assert "padding or truncation it configures is ignored" in text


@pytest.mark.parametrize("casing", ["uncased", "cased"])
def test_cli_tokenizer_json_with_padding_prints_no_pad(capsys, folders, tmp_path, casing):
    folder = _padded_folder(folders, tmp_path, casing)
    hf = _hf(folder)
    for text in ["Hello World, Café!", LONG]:
        code, out, err = _run(capsys, "tokenize", "--tokenizer", str(folder / "tokenizer.json"), text)
        assert code == 0 and err == ""
        assert "[PAD]" not in json.loads(out)
        assert json.loads(out) == _hf_tokens_and_ids(hf, text)[0]


def _byte_level_bpe(texts: list[str]):  # noqa: ANN202
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, trainers

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["[PAD]"])  # fmt: skip
    hf.train_from_iterator(texts, trainer)
    return Tokenizer.from_str(hf.to_str(), source="byte-level.json")


def test_token_labels_of_byte_level_bpe_are_the_text_of_their_bytes():
    """GPT-2's byte symbols ("Ġworld", "Ċ") are shown as the text they stand for (" world", "\\n"),
    a part of a UTF-8 character as escaped bytes; equal to Hugging Face's own decoding of the one token
    wherever that decoding is whole characters."""
    texts = ["Hello world, naïve café 😀\n\tdef f():", "the cat sat on the mat\n"] * 20
    tokenizer = _byte_level_bpe(texts)
    ids = tokenizer.encode(texts[0])
    labels = [tokenizer.token_label(i) for i in ids]
    for index, label in zip(ids, labels, strict=True):
        text = tokenizer.hf.decode([index], skip_special_tokens=False)
        if "\ufffd" not in text:
            assert label == text.replace("\n", "\\n").replace("\t", "\\t")
        else:  # bytes of a character split between tokens: escaped, and together they are the character
            assert "\\x" in label
    assert "\\n" in labels and all("\n" not in label and "Ġ" not in label for label in labels)
    assert "".join(label for label in labels if "\\x" in label) == " \\xf0\\x9f\\x98\\x80" or "😀" in "".join(labels)
    assert tokenizer.token_label(tokenizer.token_to_id("[PAD]")) == "[PAD]"  # a special token as it is


def test_token_labels_of_other_kinds_are_their_tokens(folders):
    tokenizer = Tokenizer.from_vocab_txt(folders["uncased"] / "vocab.txt")
    ids = tokenizer.encode(CORPUS[0])
    assert [tokenizer.token_label(i) for i in ids] == [tokenizer.id_to_token(i) for i in ids]


def test_from_bytes_is_from_str_and_names_the_file_in_errors():
    """A run's tokenizer.json is parsed from its bytes (no Python string of it); bad bytes, bad JSON
    and JSON that is not a tokenizer each get one DataError naming the file."""
    from attnlab.errors import DataError

    good = _byte_level_bpe(["héllo wörld", "the quick brown fox", "42 is 6 x 7"] * 20)
    text = good.hf.to_str()
    from_bytes = Tokenizer.from_bytes(text.encode("utf-8"), source="t.json")
    assert from_bytes.kind == good.kind == "bpe"
    assert from_bytes.tokenize("héllo, wörld 42") == good.tokenize("héllo, wörld 42")
    for data, message in [
        (b"\xff\xfe{}", r"t.json: bytes that are not UTF-8 \(offset 0\)"),
        (b'{"a": 1,\n"b": }', r"t.json:2: not valid JSON"),
        (b"[" * 100_000, "t.json: not valid JSON: nested too deeply"),
        (b'{"version": "1.0"}', "t.json: not a Hugging Face tokenizer.json"),
    ]:
        with pytest.raises(DataError, match=message):
            Tokenizer.from_bytes(data, source="t.json")
