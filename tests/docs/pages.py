"""Reading the documentation's Markdown: fenced blocks, links, headings' anchors (as mkdocs makes them)."""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.MULTILINE)


@dataclass(frozen=True)
class Block:
    language: str
    text: str


def blocks(page: Path) -> list[Block]:
    """The page's fenced code blocks, in order (fences at the start of a line)."""
    return [Block(m.group(1), m.group(2)) for m in _FENCE.finditer(page.read_text())]


def prose(page: Path) -> str:
    """The page without its fenced blocks (links inside code are not links)."""
    return _FENCE.sub("", page.read_text())


def links(page: Path) -> list[str]:
    """Every Markdown link target of the page's prose, as written."""
    return _LINK.findall(prose(page))


def slug(heading: str) -> str:
    """The anchor mkdocs (Python-Markdown's toc) gives a heading: a link's text kept, punctuation (code
    and emphasis marks included) removed, lower case, spaces and hyphens joined into one hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = unicodedata.normalize("NFKD", text)
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    return {slug(h) for h in _HEADING.findall(prose(page))}
