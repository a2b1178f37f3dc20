"""Small parallel corpora the tests generate themselves (nothing is downloaded)."""

from __future__ import annotations

import random
from pathlib import Path

DIGIT_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def write_number_words(path: Path, lines: int, *, seed: int, max_digits: int) -> None:
    """``lines`` translation pairs "three one<TAB>3 1" of 1..``max_digits`` random digits, one per line."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(lines):
        digits = [rng.randrange(10) for _ in range(rng.randint(1, max_digits))]
        pairs.append(" ".join(DIGIT_WORDS[d] for d in digits) + "\t" + " ".join(str(d) for d in digits))
    path.write_text("\n".join(pairs) + "\n")
