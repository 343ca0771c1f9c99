"""The repo is clean under its ruff configuration (ruff.toml): pyflakes, pycodestyle, bugbear, import order."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_ruff_is_clean():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is not installed: pip install -r requirements-test.txt"
    done = subprocess.run([ruff, "check", "--no-cache", "."], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def _imported_modules(path: Path) -> set[str]:
    """Top-level names of every module a file imports, at any depth (imports inside functions included)."""
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_the_package_never_imports_a_script():
    """tes_grpo/ sits below the scripts: a helper that imported one would tie the package to a command line."""
    scripts = {p.stem for p in REPO.glob("*.py")}
    upward = {p.name: sorted(_imported_modules(p) & scripts) for p in sorted((REPO / "tes_grpo").glob("*.py"))}
    upward = {name: found for name, found in upward.items() if found}
    assert not upward, f"tes_grpo modules import top-level scripts: {upward}"


def test_code_cites_no_issue_numbers():
    """Comments and docstrings cite BENCHMARKS.md sections, never issue numbers nobody reading the repo can look up."""
    from test_docs import ISSUE

    files = [*REPO.glob("*.py"), *(REPO / "tes_grpo").glob("*.py"), *(REPO / "benchmarks").glob("*.py"),
             *(REPO / "tests").glob("*.py")]
    found = {str(p.relative_to(REPO)): ISSUE.findall(p.read_text(encoding="utf-8")) for p in files}
    found = {name: hits for name, hits in found.items() if hits}
    assert not found, f"issue numbers cited: {found}"
