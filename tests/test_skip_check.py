"""tests/skip_check.py, CI's check on skips and the collected count, on tiny suites in a temporary folder (pytest in
a subprocess), and .ci/run passing it to the README's test command on a fake repo."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent

CUDA_ONLY = ('import pytest\npytestmark = pytest.mark.skipif(True, reason="CUDA only: needs a GPU")\n'
             'def test_a(): pass\n')
NO_CUDA_PARAM = ('import pytest\n@pytest.mark.parametrize("d", ["cuda", "cpu"])\ndef test_d(d):\n'
                 '    if d == "cuda": pytest.skip("no CUDA device: the cpu case runs")\n')
MISSING_PACKAGE = ('import pytest\npytest.importorskip("no_such_package_here", reason="requirements-test.txt installs '
                   'it")\ndef test_a(): pass\n')
OLD_LIBRARY_FIXTURE = ('import pytest\n@pytest.fixture(scope="module")\ndef run():\n'
                       '    pytest.skip("transformers 5.17 (fixed by 5.24) cannot resume here")\n'
                       'def test_a(run): pass\ndef test_b(run): pass\n')
ONE_OLD = ('import pytest\ndef test_a(): pass\ndef test_b(): pass\n'
           'def test_c(): pytest.skip("torch 2.11 rounds differently")\n')
XFAIL = 'import pytest\n@pytest.mark.xfail(reason="known")\ndef test_a(): assert False\n'
PASSING = "def test_one(): pass\ndef test_two(): pass\n"
FAILING = "def test_bad(): assert False\n"
CUDA_CLAIMED = "skip_check.cuda_visible = lambda: True\n"  # conftest: as if a GPU were visible


def suite(root: Path, files: dict[str, str], conftest_extra: str = "") -> Path:
    """A folder with a pytest.ini of its own (so it is the rootdir), a conftest taking skip_check's hooks, `files`.
    Its skip_check sees no GPU unless conftest_extra says otherwise (no torch to import: quicker)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "pytest.ini").write_text("[pytest]\n")
    (root / "conftest.py").write_text(f"import sys\nsys.path.insert(0, {str(TESTS)!r})\nimport skip_check\n"
                                      "from skip_check import pytest_addoption, pytest_configure  # noqa\n"
                                      "skip_check.cuda_visible = lambda: False\n" + conftest_extra)
    for name, text in files.items():
        (root / name).write_text(text)
    return root


def clean_env() -> dict:
    # the outer run's options (CI sets PYTEST_ADDOPTS) must not reach the inner one; installed plugins are not needed
    # there and take most of a tiny run's time to load
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS")}
    return {**env, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}


def test_cuda_visible_is_torchs_answer():
    import skip_check
    import torch

    assert skip_check.cuda_visible() == torch.cuda.is_available()


def pytest_in(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=root,
                          capture_output=True, text=True, env=clean_env(), timeout=300)


# (files, conftest extra, options, exit code, lines the output must hold)
CASES = [
    ({"test_gpu.py": CUDA_ONLY, "test_ok.py": PASSING}, "", ["--only-cuda-skips"], 0,
     ["skipped for want of CUDA: 1 test(s): test_gpu.py (the whole module, 1 test)"]),
    ({"test_d.py": NO_CUDA_PARAM}, "", ["--only-cuda-skips"], 0,
     ["skipped for want of CUDA: 1 test(s): test_d.py (1 of 2)"]),
    ({"test_pkg.py": MISSING_PACKAGE, "test_ok.py": PASSING}, "", ["--only-cuda-skips"], 1,
     ["error: --only-cuda-skips: 1 skip(s) for a reason other than needing CUDA",
      "  test_pkg.py (the whole module, at collection): requirements-test.txt installs it"]),
    ({"test_dist.py": OLD_LIBRARY_FIXTURE}, "", ["--only-cuda-skips"], 1,
     ["error: --only-cuda-skips: 2 skip(s)",
      "  test_dist.py (the whole module, 2 tests): transformers 5.17 (fixed by 5.24) cannot resume here"]),
    ({"test_one.py": ONE_OLD}, "", ["--only-cuda-skips"], 1,
     ["  test_one.py (1 of 3): torch 2.11 rounds differently"]),
    ({"test_dist.py": OLD_LIBRARY_FIXTURE, "test_bad.py": FAILING}, "", ["--only-cuda-skips"], 1,
     ["1 failed", "error: --only-cuda-skips: 2 skip(s)"]),  # a failure stays one
    ({"test_x.py": XFAIL, "test_gpu.py": CUDA_ONLY}, "", ["--only-cuda-skips"], 0, ["1 xfailed"]),
    ({"test_one.py": ONE_OLD}, "", [], 0, ["1 skipped"]),  # without the option nothing is checked
    ({"test_d.py": NO_CUDA_PARAM}, CUDA_CLAIMED, ["--only-cuda-skips"], 1,  # "no CUDA device" with one visible
     ["  test_d.py (1 of 2): no CUDA device: the cpu case runs"]),
    ({"test_ok.py": PASSING}, "", ["--collected-floor=floor.txt"], 0,
     ["collected 2 tests, at or above the floor of 2 (floor.txt)"]),
    ({"test_ok.py": PASSING}, "", ["--collected-floor=floor.txt", "-k", "one"], 1,
     ["error: --collected-floor: 1 tests collected (1 deselected), fewer than the floor of 2 in floor.txt"]),
    ({"test_pkg.py": MISSING_PACKAGE, "test_ok.py": PASSING}, "", ["--collected-floor=floor.txt"], 0,
     ["collected 2 tests"]),  # the floor alone does not judge skips
]


@pytest.mark.parametrize("files, conftest_extra, options, code, words", CASES)
def test_the_check_on_a_tiny_suite(tmp_path, files, conftest_extra, options, code, words):
    root = suite(tmp_path / "suite", files, conftest_extra)
    (root / "floor.txt").write_text("# the fewest tests\n2\n")
    done = pytest_in(root, *options)
    out = done.stdout + done.stderr
    assert done.returncode == code, out
    for line in words:
        assert line in out, (line, out)


@pytest.mark.parametrize("floor, words", [
    (None, "--collected-floor=floor.txt: cannot read it"),
    ("# only a comment\n", "must be a whole number of tests, got nothing"),
    ("many\n", "must be a whole number of tests, got 'many'"),
])
def test_a_bad_floor_file_is_a_usage_error(tmp_path, floor, words):
    root = suite(tmp_path / "suite", {"test_ok.py": PASSING})
    if floor is not None:
        (root / "floor.txt").write_text(floor)
    done = pytest_in(root, "--collected-floor=floor.txt")
    assert done.returncode == pytest.ExitCode.USAGE_ERROR and words in done.stderr, done.stdout + done.stderr


def fake_repo(root: Path, files: dict[str, str], floor: int) -> Path:
    """The repo as .ci/run sees it: its README's second shell block runs pytest, tests/ takes skip_check's hooks."""
    (root / ".ci").mkdir(parents=True)
    shutil.copy(REPO / ".ci" / "run", root / ".ci" / "run")
    (root / "README.md").write_text(f"# fake\n\n```sh\necho set-up\n```\n\n```sh\n{sys.executable} -m pytest -q -p "
                                    "no:cacheprovider\n```\n")
    (root / "pytest.ini").write_text("[pytest]\ntestpaths = tests\n")
    tests = root / "tests"
    tests.mkdir()
    shutil.copy(TESTS / "skip_check.py", tests / "skip_check.py")
    (tests / "conftest.py").write_text("from skip_check import pytest_addoption, pytest_configure  # noqa\n")
    (tests / "collected_floor.txt").write_text(f"{floor}\n")
    for name, text in files.items():
        (tests / name).write_text(text)
    return root


@pytest.mark.parametrize("files, floor, code, words", [
    ({"test_ok.py": PASSING, "test_gpu.py": CUDA_ONLY}, 3, 0,
     ["skipped for want of CUDA: 1 test(s): tests/test_gpu.py", "collected 3 tests, at or above the floor of 3"]),
    ({"test_ok.py": PASSING, "test_dist.py": OLD_LIBRARY_FIXTURE}, 4, 1,
     ["  tests/test_dist.py (the whole module, 2 tests): transformers 5.17"]),
    ({"test_ok.py": PASSING}, 3, 1, ["error: --collected-floor: 2 tests collected (0 deselected), fewer than the floor "
                                     "of 3 in tests/collected_floor.txt"]),
])
def test_ci_run_passes_the_checks_to_the_readme_command(tmp_path, files, floor, code, words):
    root = fake_repo(tmp_path / "repo", files, floor)
    done = subprocess.run(["bash", str(root / ".ci" / "run")], cwd=tmp_path, capture_output=True, text=True,
                          env=clean_env(), timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == code, out
    for line in words:
        assert line in out, (line, out)
