"""Write stdlib_docstrings.txt: English sentences from the docstrings of CPython's standard library.

Run with the Python whose library to read (the committed file came from CPython 3.11):

    python data/sentences/extract.py > data/sentences/stdlib_docstrings.txt

Only the source files on this machine are read (no network). A sentence is kept when it is
prose: 8 to 35 words, starting with a capital letter, ending with a full stop, with no code
(no brackets, ``=``, ``>>>``, backquotes or underscores) and mostly alphabetic. Duplicates are
dropped, and a seeded sample of 300 is written in sorted order. The text is CPython's, under the
Python Software Foundation License (see README.md beside this file).
"""

from __future__ import annotations

import ast
import random
import re
import sys
import sysconfig
from pathlib import Path

WANTED = 300
CODE = re.compile(r"[()\[\]{}=<>`_*#|\\/@$%^~]|\.\.\.|::|\bNone\b|\bTrue\b|\bFalse\b")
SENTENCE_END = re.compile(r"(?<=[a-z]\.)\s+(?=[A-Z])")


def docstrings(path: Path) -> list[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))]
    return [doc for n in nodes if (doc := ast.get_docstring(n))]


def sentences(doc: str) -> list[str]:
    out = []
    for paragraph in doc.split("\n\n"):
        text = " ".join(paragraph.split())
        for sentence in SENTENCE_END.split(text):
            words = sentence.split()
            if not 8 <= len(words) <= 35 or not sentence[0].isupper() or not sentence.endswith("."):
                continue
            letters = sum(c.isalpha() or c.isspace() for c in sentence)
            if CODE.search(sentence) or letters < 0.9 * len(sentence) or "e.g" in sentence or "i.e" in sentence:
                continue
            out.append(sentence)
    return out


def main() -> None:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not {"test", "tests", "idlelib", "site-packages"} & set(p.parts))
    found = sorted({s for f in files for d in docstrings(f) for s in sentences(d)})
    chosen = sorted(random.Random(0).sample(found, min(WANTED, len(found))))
    sys.stdout.write("\n".join(chosen) + "\n")
    print(f"{len(found)} candidate sentences in {len(files)} files; wrote {len(chosen)}", file=sys.stderr)


if __name__ == "__main__":
    main()
