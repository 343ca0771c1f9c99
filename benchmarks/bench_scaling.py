"""GRPO steps of the gpt-oss-20b-shaped model on one GPU, on several with DDP, and with FSDP2: time, memory, scaling.

Run on a machine with several GPUs (the tokenizer folder must be reachable: GPT_OSS_TOKENIZER=<folder>):

    NCCL_NVLS_ENABLE=0 python benchmarks/bench_scaling.py --PROCESSES=2 --STEPS=2 --MAX_COMPLETION_LEN=128
    python benchmarks/bench_scaling.py --RUNS=fsdp2          # just one of them (results are appended to RESULTS)
    python benchmarks/bench_scaling.py --SUMMARY_ONLY=1      # the table again, from RESULTS

Each run is bench_grpo.py (real GRPO steps through train_grpo's wiring, random weights, every completion at
MAX_COMPLETION_LEN) in a fresh process: `python benchmarks/bench_grpo.py` for one GPU, `accelerate launch` with
configs/accelerate/ddp.yaml or fsdp2.yaml for PROCESSES GPUs. The batch settings are per process, so N GPUs train
N times the completions of one GPU per optimizer step; the table compares completions per second of the last
step, and scaling efficiency = (completions/s on N GPUs) / (N x completions/s on one GPU).
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

# Run as `python benchmarks/<name>.py` from the repo root: Python puts benchmarks/ on sys.path, not the root
# that holds train_grpo.py and the tes_grpo package.
_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))

import json
import os
import subprocess
import sys
from pathlib import Path

from tes_grpo.run.script_config import resolve

RUNS = "single,ddp,fsdp2"  # which runs, in order: single (python, 1 GPU), ddp, fsdp2 (accelerate launch)
PROCESSES = 2  # GPUs for the ddp and fsdp2 runs
STEPS = 2  # optimizer steps per run (the first includes compilation and warm-up; the last is compared)
MAX_COMPLETION_LEN = 128  # tokens per completion (random weights always reach it)
EXPERTS = "mxfp4"  # bench_grpo's EXPERTS: mxfp4 (resident, train_grpo's default) or bf16 (as loaded with EXPERTS=bf16)
RESULTS = "runs/bench-scaling/results.jsonl"  # every step of every run is appended here (bench_grpo's rows)
TIMEOUT_S = 900  # a run that takes longer is stopped (and reported) so the others still run
SUMMARY_ONLY = False  # print the table from RESULTS without running anything

_REPO = Path(__file__).resolve().parents[1]
_CONFIGS = {"ddp": "configs/accelerate/ddp.yaml", "fsdp2": "configs/accelerate/fsdp2.yaml"}


def run_command(name: str, s) -> list[str]:
    bench = [str(_REPO / "benchmarks" / "bench_grpo.py"), f"--STEPS={s.STEPS}",
             f"--MAX_COMPLETION_LEN={s.MAX_COMPLETION_LEN}", f"--EXPERTS={s.EXPERTS}", f"--RESULTS={s.RESULTS}",
             f"--OUT_DIR=runs/bench-scaling/{name}"]
    if name == "single":
        return [sys.executable, *bench]
    if name not in _CONFIGS:
        raise SystemExit(f"error: RUNS: unknown run {name!r}; valid: single, {', '.join(_CONFIGS)}")
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(_REPO / _CONFIGS[name]),
            "--num_processes", str(s.PROCESSES), *bench]


def summary(rows: list[dict]) -> str:
    """The last step of each run against the one-GPU run's last step."""
    last = {}
    for row in rows:
        key = (row.get("sharding", "none"), row.get("processes", 1), row["max_completion_len"],
               row.get("experts", "bf16"))
        last[key] = row
    lines = [f"{'run':>6}{'GPUs':>5}{'len':>5}{'experts':>8}{'compl/step':>11}{'step s':>8}{'gen s':>7}{'train s':>8}"
             f"{'compl/s':>8}{'scaling':>8}  peak GiB per GPU"]
    for (sharding, processes, length, experts), row in sorted(last.items(),
                                                              key=lambda item: (item[0][3], item[0][2], item[0][1])):
        base = last.get(("none", 1, length, experts))
        efficiency = (f"{100 * row['completions_per_s'] / (processes * base['completions_per_s']):>7.0f}%"
                      if base else f"{'-':>8}")
        lines.append(f"{sharding if processes > 1 else 'single':>6}{processes:>5}{length:>5}{experts:>8}"
                     f"{row['completions_per_step']:>11}{row['step_s']:>8.1f}{row['generation_s']:>7.1f}"
                     f"{row['training_s']:>8.1f}{row['completions_per_s']:>8.2f}{efficiency}  "
                     + " / ".join(f"{m:.1f}" for m in row["peak_gib_per_gpu"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    s = resolve(globals(), argv)
    from benchmarks.log_header import header

    print(header(), flush=True)
    results = Path(s.RESULTS)
    failed = []
    if not s.SUMMARY_ONLY:
        results.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "NCCL_NVLS_ENABLE": "0"}  # NVLink multicast stays off on the shared machines
        for name in [n.strip() for n in s.RUNS.split(",") if n.strip()]:
            command = run_command(name, s)
            # one process seeing several GPUs would make the Trainer use nn.DataParallel, which TRL refuses
            run_env = {**env, "CUDA_VISIBLE_DEVICES": env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]} \
                if name == "single" else env
            print(f"\n=== {name}: {' '.join(command)}", flush=True)
            try:
                code = subprocess.run(command, cwd=_REPO, env=run_env, timeout=s.TIMEOUT_S).returncode
            except subprocess.TimeoutExpired:
                code = f"timeout after {s.TIMEOUT_S} s"
            if code != 0:
                failed.append(f"{name} ({code})")
                print(f"=== {name} failed: {code}", flush=True)
    if not results.is_file():
        print(f"error: {results}: no results (run the benchmark first)", file=sys.stderr)
        return 1
    rows = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    print("\n" + summary(rows))
    if failed:
        print("failed: " + ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
