"""The public API is small and documented: every name of ``attnlab.__all__``, ``attnlab.nn.__all__``
and the entry points of ``attnlab.run``, ``attnlab.generate`` and ``attnlab.sweep`` imports, and has
a docstring of its own (a class's or function's, or the string under a constant), which the API
reference shows."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
from pathlib import Path

import pytest

import attnlab
import attnlab.nn


def _own_docstring(obj: object) -> str | None:
    """The docstring written for ``obj`` itself: not inherited, not a dataclass's generated signature."""
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else getattr(obj, "__doc__", None)
    if inspect.isclass(obj) and dataclasses.is_dataclass(obj) and doc and doc.startswith(f"{obj.__name__}("):
        return None
    return doc


def _defining_module(package: str, name: str) -> str:
    """The module ``package``'s ``__init__`` imports ``name`` from."""
    tree = ast.parse(Path(importlib.import_module(package).__file__).read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and any(alias.name == name for alias in node.names):
            return node.module or package
    return package


def _constant_docstring(module: str, name: str) -> str | None:
    """The string right under ``name = ...`` in ``module``'s source (how a constant is documented)."""
    body = ast.parse(Path(importlib.import_module(module).__file__).read_text(encoding="utf-8")).body
    for statement, following in zip(body, body[1:]):
        targets = statement.targets if isinstance(statement, ast.Assign) else [getattr(statement, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            if isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant):
                return following.value.value
    return None


def _public(module: str) -> list[tuple[str, str]]:
    return [(module, name) for name in importlib.import_module(module).__all__ if name != "__version__"]


PACKAGES = ("attnlab", "attnlab.nn", "attnlab.run", "attnlab.generate", "attnlab.sweep")


@pytest.mark.parametrize(("module", "name"), [pair for package in PACKAGES for pair in _public(package)], ids=str)
def test_a_public_name_imports_and_has_a_docstring(module, name):
    obj = getattr(importlib.import_module(module), name)
    if inspect.isclass(obj) or inspect.isroutine(obj):
        doc = _own_docstring(obj)
    else:  # a constant or type alias, documented by the string under its assignment
        package = "attnlab.nn" if module == "attnlab" else module
        doc = _constant_docstring(_defining_module(package, name), name)
    assert doc and doc.strip(), f"{module}.{name} has no docstring"


def test_the_public_api_is_small_and_names_no_internals():
    assert len(attnlab.nn.__all__) == len(set(attnlab.nn.__all__)) <= 40
    internals = {"optional_state_keys", "build_model_to_load", "DecoderLayerCache", "check_mask", "make_score"}
    assert not internals & set(attnlab.nn.__all__)
    elsewhere = {"__version__", "show", "show_records", "load", "LanguageModel"}
    assert set(attnlab.__all__) - elsewhere <= set(attnlab.nn.__all__)
    for name in internals:  # still importable by name for attnlab's own modules
        assert getattr(attnlab.nn, name) is not None


def test_attnlab_gives_the_same_objects_as_their_modules():
    assert attnlab.EncoderDecoder is attnlab.nn.EncoderDecoder
    assert attnlab.show is importlib.import_module("attnlab.viewer.notebook").show
    from attnlab.generate import generate_continuations
    from attnlab.run import open_run

    assert open_run is importlib.import_module("attnlab.run.loaded").open_run
    assert generate_continuations is importlib.import_module("attnlab.generate.search").generate_continuations
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        importlib.import_module("attnlab.run").nope  # noqa: B018


def test_the_packages_quick_start_runs_as_written() -> None:
    """attnlab's docstring teaches the same mechanisms as the README: trace and masking_heads."""
    import textwrap

    import attnlab

    doc = attnlab.__doc__
    block = doc[doc.index("Quick start::") + len("Quick start::") :].split("\n\n")[1]
    names: dict = {}
    exec(compile(textwrap.dedent(block), "attnlab/__init__.py", "exec"), names)  # noqa: S102 - the project's own example
    assert tuple(names["t"].cache["decoder.0.cross.pattern"].shape) == (8, 4, 10, 12)
