"""The documentation against the code: the README lists every command, and no link leaves the repository.

The site itself (mkdocs.yml, docs/) is built with ``mkdocs build --strict`` by ``make docs``, which
``make test`` runs: that build fails on a broken link or anchor inside docs/.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import typer

import attnlab
from attnlab.cli import app

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

# A Markdown link or image: [text](target) or ![alt](target "title"); the target up to a space or ")".
MARKDOWN_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _command_paths(command, prefix: str = "") -> list[str]:
    """``train``, ``heads importance``, ...: every command the CLI registers, a group's by its subcommands."""
    paths = []
    for name, sub in sorted(command.commands.items()):
        path = f"{prefix}{name}"
        if getattr(sub, "commands", None):
            paths += _command_paths(sub, prefix=f"{path} ")
        else:
            paths.append(path)
    return paths


def _readme_commands() -> set[str]:
    """The commands named in the first column of the README's command table (```attnlab X```)."""
    rows = re.findall(r"^\| `attnlab ([a-z0-9 -]+)` \|", README.read_text(encoding="utf-8"), re.MULTILINE)
    return set(rows)


def test_readme_lists_every_command_the_cli_registers() -> None:
    registered = set(_command_paths(typer.main.get_command(app)))
    assert {"train", "heads importance", "import gguf", "patch", "sites", "view", "bench"} <= registered
    listed = _readme_commands()
    assert registered - listed == set(), "commands missing from README.md's command table"
    assert listed - registered == set(), "README.md's command table names commands the CLI does not have"


def test_api_reference_names_every_public_name_of_attnlab() -> None:
    page = (ROOT / "docs" / "api" / "attnlab.md").read_text(encoding="utf-8")
    missing = [name for name in attnlab.__all__ if f"`{name}`" not in page]
    assert missing == [], "docs/api/attnlab.md does not name these entries of attnlab.__all__"


def test_every_docs_page_is_in_the_site_navigation() -> None:
    nav = set(re.findall(r":\s*(\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(encoding="utf-8"), re.MULTILINE))
    pages = {
        path.relative_to(ROOT / "docs").as_posix()
        for path in (ROOT / "docs").rglob("*.md")
        if "reproductions" not in path.parts  # sweep outputs, linked from sweeps.md
    }
    assert pages - nav == set(), "pages under docs/ that mkdocs.yml's nav leaves out"
    assert nav - pages == set(), "mkdocs.yml's nav names pages that do not exist"


def _tracked_files() -> list[Path]:
    try:
        listing = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60
        ).stdout.decode()
    except (OSError, subprocess.CalledProcessError) as error:
        pytest.skip(f"not a git checkout ({error}): the tracked files cannot be listed")
    return [ROOT / name for name in listing.split("\0") if name]


def _text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, IsADirectoryError, FileNotFoundError):
        return None


def test_no_tracked_file_points_outside_the_repository() -> None:
    outside = "/".join(["..", "shared"])  # spelled in parts so that this file does not match itself
    offenders = []
    for path in _tracked_files():
        text = _text(path)
        if text is None:
            continue
        if outside in text:
            offenders.append(f"{path.relative_to(ROOT)}: mentions {outside}")
        if path.suffix != ".md":
            continue
        for target in MARKDOWN_LINK.findall(text):
            if target.startswith("#"):
                continue
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("/"):
                offenders.append(f"{path.relative_to(ROOT)}: links outside the repository: {target}")
                continue
            resolved = (path.parent / target.split("#", 1)[0]).resolve()
            if not resolved.is_relative_to(ROOT):
                offenders.append(f"{path.relative_to(ROOT)}: links outside the repository: {target}")
            elif not resolved.exists():
                offenders.append(f"{path.relative_to(ROOT)}: links to a missing file: {target}")
    assert offenders == []
