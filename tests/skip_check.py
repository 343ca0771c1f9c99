"""CI's check on what the suite skipped and how many tests it collected; tests/conftest.py takes its hooks.

    pytest --only-cuda-skips                                # fail if anything skips for a reason but no CUDA
    pytest --collected-floor=tests/collected_floor.txt      # fail if fewer tests are collected than the file says

.ci/run sets both through PYTEST_ADDOPTS, so the README's test command stays what CI runs. Why: a skip for a library
version (test_distributed.py below transformers 5.24, the fused experts' CPU compile test below torch 2.13) or a
missing package (`pytest.importorskip("triton")` takes eight files) would leave CI green on far fewer tests than it
seems to run. On CI's machine the only skips must be the tests that need a GPU: a skip counts as one when its reason
begins "CUDA only", "no CUDA device" or "needs CUDA" and torch sees no CUDA device. Every other skip, of a test or of
a whole module at collection (xfail is not a skip), fails the session with one line per rule broken, then one line
per module and reason. With --only-cuda-skips the summary also says what was skipped for want of CUDA.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from pathlib import Path

import pytest

CUDA_REASON = re.compile(r"(CUDA only|no CUDA device|needs CUDA)\b")  # at the start of a skip's reason


def pytest_addoption(parser):
    group = parser.getgroup("ci", "CI's checks on skips and counts (tests/skip_check.py)")
    group.addoption("--only-cuda-skips", action="store_true",
                    help="fail the session if a test or a test module is skipped for a reason other than needing "
                         "CUDA (a reason beginning 'CUDA only', 'no CUDA device' or 'needs CUDA', with no CUDA device)")
    group.addoption("--collected-floor", metavar="FILE",
                    help="fail the session if it collects fewer tests than the number in FILE")


def read_floor(path: str) -> int:
    """The number in FILE: its first line that is not blank or a # comment."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise pytest.UsageError(f"--collected-floor={path}: cannot read it ({err.strerror})") from None
    words = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    if not words or not words[0].isdigit():
        raise pytest.UsageError(f"--collected-floor={path}: its first line that is not a # comment must be a whole "
                                f"number of tests, got {repr(words[0]) if words else 'nothing'}")
    return int(words[0])


def pytest_configure(config):
    if config.getoption("only_cuda_skips") or config.getoption("collected_floor"):
        floor_file = config.getoption("collected_floor")
        floor = read_floor(floor_file) if floor_file else None
        config.pluginmanager.register(SkipCheck(config.getoption("only_cuda_skips"), floor_file, floor), "skip_check")


def skip_reason(report) -> str:
    """The reason a skipped report gives (its longrepr is (path, line, "Skipped: reason"))."""
    text = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    return text.removeprefix("Skipped: ")


def cuda_visible() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


class SkipCheck:
    """Gathers the session's skips and its item count; fails the session at its end where a rule is broken."""

    def __init__(self, only_cuda: bool, floor_file: str | None, floor: int | None):
        self.only_cuda, self.floor_file, self.floor = only_cuda, floor_file, floor
        self.skips: dict[tuple[str, str], list[str]] = defaultdict(list)  # (module, reason) -> node ids
        self.whole: set[str] = set()  # modules skipped at collection
        self.per_module: Counter = Counter()  # items collected per module
        self.deselected = 0
        self.lines: list[str] = []

    def pytest_collectreport(self, report):
        if report.skipped and report.nodeid:
            module = report.nodeid.split("::")[0]
            if module == report.nodeid:
                self.whole.add(module)
            self.skips[(module, skip_reason(report))].append(report.nodeid)

    def pytest_deselected(self, items):
        self.deselected += len(items)

    def pytest_collection_finish(self, session):
        self.per_module.update(item.nodeid.split("::")[0] for item in session.items)

    def pytest_runtest_logreport(self, report):
        if report.skipped and not hasattr(report, "wasxfail"):
            self.skips[(report.nodeid.split("::")[0], skip_reason(report))].append(report.nodeid)

    def describe(self, module: str, count: int) -> str:
        if module in self.whole:
            return f"{module} (the whole module, at collection)"
        total = self.per_module[module]
        tests = f"{total} test" + ("s" if total != 1 else "")
        return f"{module} (the whole module, {tests})" if count >= total else f"{module} ({count} of {total})"

    def pytest_sessionfinish(self, session):
        cuda = any(CUDA_REASON.match(reason) for _, reason in self.skips) and cuda_visible()
        allowed = {key: ids for key, ids in self.skips.items() if CUDA_REASON.match(key[1]) and not cuda}
        other = {key: ids for key, ids in self.skips.items() if key not in allowed}
        failed = []
        if self.only_cuda and other:
            failed.append(f"error: --only-cuda-skips: {sum(map(len, other.values()))} skip(s) for a reason other than "
                          "needing CUDA, where CI must run every test a CPU can (install what they need, or give the "
                          "skip a CUDA reason only if it is one):")
            failed += [f"  {self.describe(module, len(ids))}: {reason}"
                       for (module, reason), ids in sorted(other.items())]
        collected = session.testscollected
        if self.floor is not None and collected < self.floor:
            failed.append(f"error: --collected-floor: {collected} tests collected ({self.deselected} deselected), "
                          f"fewer than the floor of {self.floor} in {self.floor_file}: a module that no longer "
                          "collects, or a narrowed run (lower the floor only with tests removed on purpose)")
        if self.only_cuda and allowed:
            self.lines.append(f"skipped for want of CUDA: {sum(map(len, allowed.values()))} test(s): " + "; ".join(
                self.describe(module, len(ids)) for (module, _), ids in sorted(allowed.items())))
        if self.floor is not None and collected >= self.floor:
            self.lines.append(f"collected {collected} tests, at or above the floor of {self.floor} ({self.floor_file})")
        self.lines += failed
        if failed and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter):
        for line in self.lines:
            terminalreporter.write_line(line, red=line.startswith(("error", "  ")), bold=line.startswith("error"))
