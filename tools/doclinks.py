"""Check that every relative link and anchor in README.md and docs/*.md resolves.

Inputs: README.md and docs/*.md (links ``[text](target)``, images ``![alt](target)``, outside
code). Outputs: one line per broken link on stdout; exit status 1 when there is one.
Command: ``python -m tools.doclinks``; ``tests/unit/test_docs.py`` runs the same check.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[1]

FENCE = re.compile(r"^(```|~~~).*?^\1\s*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.DOTALL)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.MULTILINE)
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")


def documents(root: Path = ROOT) -> list[Path]:
    """The pages whose links are checked: README.md and every docs/*.md."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text, lower case, punctuation dropped
    (letters, digits, ``_`` and ``-`` stay), each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link shows its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """Anchors a page defines: heading slugs (repeats get -1, -2, ... as on GitHub) and
    ``<a name|id="...">``."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for heading in HEADING.findall(FENCE.sub("", markdown)):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found | set(HTML_ANCHOR.findall(markdown))


def links(markdown: str) -> list[str]:
    """Link targets outside fenced code and code spans."""
    return LINK.findall(CODE_SPAN.sub("", FENCE.sub("", markdown)))


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """``"page: target (why)"`` for every relative link of ``page`` that does not resolve."""
    problems = []
    text = page.read_text(encoding="utf-8")
    name = page.relative_to(root).as_posix()
    for target in links(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
            continue  # https:, mailto: ...: not ours to check offline
        path_part, _, anchor = target.partition("#")
        file = (page.parent / unquote(path_part)).resolve() if path_part else page
        if not file.exists():
            problems.append(f"{name}: {target} ({os.path.relpath(file, root)} is missing)")
        elif (
            anchor
            and file.suffix == ".md"
            and unquote(anchor) not in anchors(file.read_text(encoding="utf-8"))
        ):
            problems.append(f"{name}: {target} (no heading #{anchor} in {file.name})")
    return problems


def main() -> None:
    problems = [p for page in documents() for p in broken_links(page)]
    print("\n".join(problems) if problems else "all links resolve")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
