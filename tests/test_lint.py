"""The repo is clean under its ruff configuration (ruff.toml): pyflakes, pycodestyle, bugbear, import order; the
package's import graph has no circle and never reaches up to a script; scripts import no torch before main()."""

from __future__ import annotations

import ast
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
    upward = {str(p.relative_to(REPO)): sorted(_imported_modules(p) & scripts)
              for p in sorted((REPO / "tes_grpo").rglob("*.py"))}
    upward = {name: found for name, found in upward.items() if found}
    assert not upward, f"tes_grpo modules import top-level scripts: {upward}"


def package_modules() -> dict[str, Path]:
    """Dotted name -> file of every module of the package (packages by their __init__.py)."""
    found = {}
    for path in (REPO / "tes_grpo").rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def package_imports(path: Path, modules) -> set[str]:
    """The package modules a file imports, at any depth (imports inside functions and TYPE_CHECKING included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in names if name in modules}


def import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of the graph as [a, b, ..., a], or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


# (graph, has a circle?)
CYCLES = [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, False),  # a chain
    ({"a": {"b"}, "b": {"a"}}, True),  # two modules importing each other
    ({"a": {"b", "c"}, "b": {"c"}, "c": {"a"}}, True),  # through a third
]


def test_import_cycle_finds_circles():
    for graph, circle in CYCLES:
        assert (import_cycle(graph) is not None) is circle, graph


def test_the_package_has_no_import_circle():
    """No package module imports, directly or through others, a module that imports it (a package's __init__ counts
    as a module; `from tes_grpo.x import y` imports x, and y too where y is a module)."""
    modules = package_modules()
    graph = {name: package_imports(path, modules) - {name} for name, path in modules.items()}
    graph = {name: {m for m in deps if not name.startswith(m + ".")} for name, deps in graph.items()}  # a parent
    assert import_cycle(graph) is None, f"import circle: {' -> '.join(import_cycle(graph))}"


# the package's parts from the bottom up (tes_grpo/__init__.py's docstring): each imports only parts before it
PARTS = ["triton_support", "run", "patches", "task", "experts", "layers", "model", "sampling", "training"]


def part_of(module: str) -> str:
    return module.split(".")[1] if module.count(".") else module


def test_each_part_of_the_package_imports_only_the_parts_below_it():
    """No import runs back up: a module in tes_grpo/<part>/ imports modules of its own part and of those listed
    before it in PARTS, at any depth (inside functions too), so the drawing of the tree has one direction."""
    modules = package_modules()
    assert {part_of(m) for m in modules if m != "tes_grpo"} == set(PARTS), "PARTS lists every sub-package"
    upward = []
    for name, path in sorted(modules.items()):
        if name == "tes_grpo":
            continue
        level = PARTS.index(part_of(name))
        for imported in sorted(package_imports(path, modules)):
            if imported != "tes_grpo" and PARTS.index(part_of(imported)) > level:
                upward.append(f"{name} imports {imported}")
    assert not upward, "imports that run back up: " + "; ".join(upward)


def test_the_training_script_imports_no_torch_before_main():
    """--help and the settings table must not wait seconds for torch: train_grpo.py imports it inside its functions."""
    done = subprocess.run([sys.executable, "-c", "import sys, train_grpo; print(sorted(m for m in ('torch', "
                           "'transformers', 'trl') if m in sys.modules))"], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


def test_code_cites_no_issue_numbers():
    """Comments and docstrings cite BENCHMARKS.md sections, never issue numbers nobody reading the repo can look up."""
    from test_docs import ISSUE

    files = [*REPO.glob("*.py"), *(REPO / "tes_grpo").rglob("*.py"), *(REPO / "benchmarks").glob("*.py"),
             *(REPO / "tests").glob("*.py")]
    found = {str(p.relative_to(REPO)): ISSUE.findall(p.read_text(encoding="utf-8")) for p in files}
    found = {name: hits for name, hits in found.items() if hits}
    assert not found, f"issue numbers cited: {found}"
