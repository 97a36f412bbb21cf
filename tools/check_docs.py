#!/usr/bin/env python
"""Check the user guide's links: README.md and every page under docs/.

The README is a short front page and the user guide is split over docs/*.md pages that link to
one another, to sections of one another (``api.md#errors-and-limits``) and to files of the
repository (``../benchmarks/RESULTS.md``, images). A page that moves or a heading that is renamed
breaks such links silently on GitHub; this script finds them:

* every relative link and image target (outside code) must name a file or folder that exists,
  resolved from the page that holds it;
* every ``#anchor`` must be the GitHub anchor of a heading of the page it points into (lower
  case, punctuation dropped, spaces to hyphens, ``-1``, ``-2`` ... for repeated headings);
* README.md must stay within ``--max-readme-lines`` lines (300: issue 39's bound).

Prints one line per problem and exits 1 if there is any. Usage::

    python tools/check_docs.py            # from the repository root
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def strip_code(text: str) -> str:
    """The text without fenced blocks and inline code, where brackets are not links."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`]*`", "", text)


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for the headings of a markdown page (outside fenced code)."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    in_fence = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
            continue
        match = None if in_fence else HEADING.match(line)
        if match is None:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(2).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def check_page(page: Path, root: Path) -> list[str]:
    """One message per broken link of ``page``."""
    problems = []
    for match in LINK.finditer(strip_code(page.read_text(encoding="utf-8"))):
        target = match.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        where = page.relative_to(root)
        if not dest.exists():
            problems.append(f"{where}: {target}: no such file")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            problems.append(f"{where}: {target}: no heading with that anchor")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT)
    parser.add_argument("--max-readme-lines", type=int, default=300)
    args = parser.parse_args(argv)
    readme = args.root / "README.md"
    pages = [readme, *sorted((args.root / "docs").glob("*.md"))]
    problems = [p for page in pages for p in check_page(page, args.root)]
    lines = len(readme.read_text(encoding="utf-8").splitlines())
    if lines > args.max_readme_lines:
        problems.append(f"README.md: {lines} lines, more than {args.max_readme_lines}")
    for problem in problems:
        print(problem)
    print(f"{len(pages)} pages checked, {len(problems)} problems", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
