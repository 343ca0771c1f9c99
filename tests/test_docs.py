"""The README and docs/ stay readable and connected: every relative link resolves, the README stays short, no page
cites issue numbers (BENCHMARKS.md's sections are cited by their headings, and every heading cited exists), and no
page or module dates work by "session", which a reader cannot look up (a date and a commit, or the change itself)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PAGES = [README, REPO / "BENCHMARKS.md", REPO / "TESTING.md", *sorted((REPO / "docs").glob("*.md"))]
README_MAX_LINES = 300

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")  # [text](target); images are not used
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
ISSUE = re.compile(r"\bissues?\s+#?\d+|\(#\d+\)|\bissue\s+\d+", re.I)
# work dated by a session: an ordinal or "this", "next", "a later" before the word; pytest's session objects are not
SESSION = re.compile(r"\b(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth"
                     r"|fourteenth|fifteenth|\d+(st|nd|rd|th)|this|that|next|last|previous|earlier|later)"
                     r"(\s+\w+)?\s+sessions?\b", re.I)
SESSION_ALLOWED = re.compile(r"""scope=["']session["']""")  # pytest's fixture scope, not a date
CITED_SECTION = re.compile(r'BENCHMARKS\.md,?\s*\(?"([^"]+)"')  # BENCHMARKS.md, "Heading" or BENCHMARKS.md ("Heading")


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


def tracked(*patterns: str) -> list[Path]:
    """The repository's tracked files matching the git pathspecs (every matching file outside runs/ and hidden
    folders where git is not available)."""
    try:
        names = subprocess.run(["git", "ls-files", "-z", "--", *patterns], cwd=REPO, capture_output=True,
                               check=True).stdout.decode().split("\0")
        return [REPO / name for name in names if name and (REPO / name).is_file()]
    except (OSError, subprocess.CalledProcessError):
        return [p for pattern in patterns for p in REPO.rglob(pattern)
                if not any(part.startswith(".") or part == "runs" for part in p.relative_to(REPO).parts)]


def test_nothing_is_dated_by_session():
    """A session named by its number names nothing a reader can find; a date and a commit, or the change, do."""
    found = []
    for path in tracked("*.md", "*.py"):
        if path == Path(__file__).resolve():
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if SESSION.search(SESSION_ALLOWED.sub("", line)):
                found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()[:100]}")
    assert not found, "dated by session (name the date and commit instead):\n" + "\n".join(found)


def plain(text: str) -> str:
    """A heading or a cited name with code marks, line breaks and comment markers taken out."""
    return " ".join(re.sub(r"\n\s*#?", " ", text).replace("`", "").split())


def test_every_cited_benchmarks_section_exists():
    """A page or module that names a BENCHMARKS.md section by its heading names one that exists (a prefix of it)."""
    headings = [plain(line.lstrip("#")) for line in prose(REPO / "BENCHMARKS.md").splitlines() if line.startswith("#")]
    missing = []
    for path in tracked("*.md", "*.py"):
        if path == Path(__file__).resolve():
            continue
        for cited in CITED_SECTION.findall(path.read_text(encoding="utf-8")):
            if not any(heading.startswith(plain(cited)) for heading in headings):
                missing.append(f"{path.relative_to(REPO)}: {plain(cited)!r}")
    assert not missing, "BENCHMARKS.md has no such heading: " + "; ".join(missing)
