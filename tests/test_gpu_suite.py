"""tests/gpu_suite.sh as far as a CPU can check it: its cpu part in two halves runs every test file once."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def half(number: int) -> list[str]:
    script = f'source <(sed -n "/^cpu_half()/,/^}}/p" tests/gpu_suite.sh) && cpu_half {number}'
    done = subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True, check=True)
    return done.stdout.split()


def test_the_cpu_halves_share_out_every_test_file_once():
    first, second = half(1), half(2)
    every = sorted(str(p.relative_to(REPO)) for pattern in ("test_*.py", "*_test.py")
                   for p in (REPO / "tests").glob(pattern))
    assert first and second and not set(first) & set(second)
    assert sorted(first + second) == every
    # balanced by the script's weight (1 + 10 per slow mark): the halves differ by at most the heaviest file
    weight = {name: 1 + 10 * (REPO / name).read_text(encoding="utf-8").count("mark.slow") for name in every}
    assert abs(sum(map(weight.get, first)) - sum(map(weight.get, second))) <= max(weight.values())
