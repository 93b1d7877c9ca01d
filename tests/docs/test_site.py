"""The documentation site holds together without building it (`make docs` builds it strictly in CI): every
page is in mkdocs.yml's nav and every nav entry is a page, every link between the pages and from the README
resolves (file and anchor), the API index lists exactly `lockstep.__all__`, and the README stays short."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path
from typing import Any

import pytest
import yaml

import lockstep
from tests.helpers import DOCS, ROOT, code_blocks

README = ROOT / "README.md"
PAGES = sorted(DOCS.rglob("*.md"))
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.MULTILINE)


def _prose(page: Path) -> str:
    """The page without its fenced blocks (a link or a `#` line inside code is not one)."""
    text = page.read_text()
    for _, block in code_blocks(page):
        text = text.replace(block, "")
    return text


def links(page: Path) -> list[str]:
    """Every Markdown link target of the page's prose, as written."""
    return _LINK.findall(_prose(page))


def slug(heading: str) -> str:
    """The anchor mkdocs (Python-Markdown's toc) gives a heading: a link's text kept, punctuation (code
    and emphasis marks included) removed, lower case, spaces and hyphens joined into one hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = unicodedata.normalize("NFKD", text)
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    return {slug(h) for h in _HEADING.findall(_prose(page))}


def _nav_pages(entries: list[Any]) -> list[str]:
    found: list[str] = []
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        found.extend(_nav_pages(value) if isinstance(value, list) else [value])
    return found


def _config() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text())


def test_every_page_is_in_the_nav_and_every_nav_entry_is_a_page() -> None:
    config = _config()
    assert config["docs_dir"] == "docs" and config["strict"] is True
    nav = _nav_pages(config["nav"])
    pages = {str(p.relative_to(DOCS)) for p in PAGES}
    assert sorted(set(nav) - pages) == [], "mkdocs.yml's nav names pages that do not exist"
    assert sorted(pages - set(nav)) == [], (
        "pages missing from mkdocs.yml's nav (mkdocs --strict fails on them)"
    )
    assert len(nav) == len(set(nav)), "a page is in the nav twice"


def _broken(page: Path) -> list[str]:
    broken = []
    for target in links(page):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading there has that anchor")
    return broken


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(page: Path) -> None:
    assert _broken(page) == []


def test_the_link_checker_sees_a_missing_file_and_anchor(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# Low-communication runs (`--sync local_sgd` or `diloco`)\n")
    (tmp_path / "b.md").write_text(
        "[ok](a.md#low-communication-runs-sync-local_sgd-or-diloco) [bad](a.md#nope) [gone](c.md)\n"
        "```\n[in code](nowhere.md)\n```\n"
    )
    assert _broken(tmp_path / "b.md") == ["a.md#nope: no heading there has that anchor", "c.md: no such file"]


def test_slug_matches_mkdocs() -> None:
    assert slug("4. Bit for bit with torch") == "4-bit-for-bit-with-torch"
    assert slug("Opt-in: sharded optimizer state (ZeRO-1)") == "opt-in-sharded-optimizer-state-zero-1"
    assert slug("5. Or let `lockstep.fit` run the loop") == "5-or-let-lockstepfit-run-the-loop"


def test_the_api_index_lists_exactly_lockstep_all() -> None:
    text = (DOCS / "api" / "index.md").read_text()
    listed = {name for name in lockstep.__all__ if f"[`{name}`]" in text or f"[`lockstep.{name}`]" in text}
    assert sorted(set(lockstep.__all__) - {"__version__"} - listed) == []


def test_readme_is_short_and_keeps_the_two_commands() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 80
    assert "## Set up: two commands (a fresh machine with Python 3.11, pip and make)" in text
    assert (
        "make train   # the main job: 2-process data-parallel training of a digit classifier on data that "
        "ships with the install\n"
    ) in text
    assert "make test    # the fast tier" in text
    assert "(docs/quickstart.md)" in text
