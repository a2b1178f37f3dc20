"""A griffe extension for the API reference: the docstrings' bits of reST as Markdown.

attnlab's docstrings are Google style with a little reST: cross-reference roles (``:func:`attention```,
``:mod:`attnlab.nn.masks```), a literal block introduced by ``::`` and, in the package docstring, a
simple table. mkdocstrings reads docstrings as Markdown, where these would show as raw text (and the
table's ``===`` rule as a heading), so this extension rewrites them before a docstring is parsed:
a role becomes the code span of its target (a ``~`` prefix dropped), ``text::`` becomes ``text:``
(the indented block below it is already Markdown code), and a simple table a Markdown table.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:func|meth|mod|class|data|attr|exc|obj|const):`~?([^`]+)`")
_RULE = re.compile(r"^\s*=+(\s+=+)+\s*$")


def markdown(text: str) -> str:
    """``text`` (a docstring) with its reST roles, ``::`` markers and simple tables as Markdown."""
    text = _ROLE.sub(r"`\1`", text)
    text = re.sub(r"(?m)(\S)::$", r"\1:", text)
    return _tables(text)


def _tables(text: str) -> str:
    lines = text.split("\n")
    rules = [i for i, line in enumerate(lines) if _RULE.match(line)]
    if len(rules) < 2:
        return text
    first, last = rules[0], rules[-1]
    starts = [match.start() for match in re.finditer(r"=+", lines[first])]
    rows = []
    for line in lines[first + 1 : last]:
        if _RULE.match(line) or not line.strip():
            continue
        cells = [line[a:b].strip() for a, b in zip(starts, [*starts[1:], len(line)])]
        rows.append("| " + " | ".join(cells) + " |")
    if len(rows) > 0 and len(rules) == 2:  # no header row: Markdown needs one, so leave it empty
        rows = ["| " + " | ".join([" "] * len(starts)) + " |", *rows]
    rows.insert(1, "|" + "---|" * len(starts))
    return "\n".join([*lines[:first], *rows, *lines[last + 1 :]])


class RestRoles(griffe.Extension):
    """Rewrite every docstring of a loaded package with :func:`markdown`, then :func:`_prefer_imports`."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        _rewrite_docstrings(pkg)
        _prefer_imports(pkg)


def _rewrite_docstrings(obj: griffe.Object) -> None:
    if obj.docstring is not None:
        obj.docstring.value = markdown(obj.docstring.value)
    for member in obj.members.values():
        if not member.is_alias:
            _rewrite_docstrings(member)


def _prefer_imports(module: griffe.Module) -> None:
    """Where a package imports a name over its submodule's (``from attnlab.nn.attention import
    attention``), make the name the imported object, as it is at run time, so that ``__all__``'s
    ``attention`` is the function, not the module ``attnlab.nn.attention``."""
    for name, member in list(module.members.items()):
        if isinstance(member, griffe.Module) and not member.is_alias:
            _prefer_imports(member)
            target = module.imports.get(name)
            if target and target != member.path:
                module.set_member(name, griffe.Alias(name, target, parent=module))
