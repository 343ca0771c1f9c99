"""The README and docs/ stay readable and connected: every relative link resolves, the README stays short, and
no page cites issue numbers (BENCHMARKS.md's sections are cited by their headings)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PAGES = [README, REPO / "BENCHMARKS.md", *sorted((REPO / "docs").glob("*.md"))]
README_MAX_LINES = 300

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")  # [text](target); images are not used
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
ISSUE = re.compile(r"\bissues?\s+#?\d+|\(#\d+\)|\bissue\s+\d+", re.I)


def prose(path: Path) -> str:
    """The page without its fenced blocks (commands and program output are not links)."""
    return FENCE.sub("", path.read_text(encoding="utf-8"))


def anchors(path: Path) -> set[str]:
    """GitHub's anchors for the page's headings: lower case, punctuation dropped, spaces as hyphens."""
    found = set()
    for line in prose(path).splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


def test_the_docs_pages_exist():
    assert len(PAGES) > 2, "docs/*.md is missing"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in LINK.findall(prose(page)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        linked = (page.parent / file_part).resolve() if file_part else page
        if not linked.exists():
            broken.append(f"{target} (no {linked.relative_to(REPO) if linked.is_relative_to(REPO) else linked})")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target} (no heading with anchor #{anchor} in {linked.name})")
    assert not broken, f"{page.name}: broken links: " + "; ".join(broken)


def test_readme_reads_in_one_sitting():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail to docs/ (at most {README_MAX_LINES})"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_issue_numbers(page):
    found = [match.group(0) for match in ISSUE.finditer(page.read_text(encoding="utf-8"))]
    assert not found, f"{page.name} cites issue numbers {found}; name the BENCHMARKS.md section instead"


def listed_names(docstring: str) -> list[str]:
    return sorted(set(re.findall(r"^- (\w+):", docstring, flags=re.MULTILINE)))


def test_the_package_docstring_lists_every_sub_package():
    import tes_grpo

    packages = sorted(p.parent.name for p in (REPO / "tes_grpo").glob("*/__init__.py"))
    modules = sorted(p.stem for p in (REPO / "tes_grpo").glob("*.py") if p.stem != "__init__")
    assert listed_names(tes_grpo.__doc__) == sorted(packages + modules)


@pytest.mark.parametrize("package", sorted(p.parent.name for p in (REPO / "tes_grpo").glob("*/__init__.py")))
def test_each_sub_package_docstring_lists_its_modules(package):
    import importlib

    docstring = importlib.import_module(f"tes_grpo.{package}").__doc__
    modules = sorted(p.stem for p in (REPO / "tes_grpo" / package).glob("*.py") if p.stem != "__init__")
    assert listed_names(docstring) == modules
