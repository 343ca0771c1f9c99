#!/usr/bin/env bash
# The test suite on the GPU machine, in parts that each finish within 10 minutes (TESTING.md):
#   bash tests/gpu_suite.sh PART [TOKENIZER_DIR]
# PART: one-gpu (cuda, cpu-1 and cpu-2 at once, a log each under LOG_DIR) | cuda | cpu | cpu-1 | cpu-2 | two-gpu (ddp
# and fsdp2 at once, a log each under LOG_DIR) | ddp | fsdp2 | list.
# cuda: the tests that use a GPU where one is visible; cpu: the whole suite (CI's tests) with the GPUs hidden, on the
# GPU machine's own versions; cpu-1, cpu-2: the same in two halves (its test files shared out), so that one-gpu runs the
# suite in three processes and ends within its 10 minutes (cpu alone beside cuda reached 96 % in 580 s on an H200);
# where one-gpu still runs out of time, run cuda, cpu-1 and cpu-2 as three calls; ddp, fsdp2: tests/test_distributed.py
# on 2 GPUs.
# Each part's log begins with benchmarks/log_header.py's header (command, commit, GPU, versions): for the
# commit on a copy without .git, run `python benchmarks/log_header.py --WRITE_RECORD=1` here first and carry
# .tree-record.json.
# TOKENIZER_DIR: gpt-oss's tokenizer folder (default: $GPT_OSS_TOKENIZER, else .tok, else ../shared/gpt-oss-tokenizer);
# the GPU machine has no ../shared, so copy it into the project (e.g. .tok) and carry it there.
# Packages the GPU machine lacks come from wheels: begin the command with the pip line of ../shared/device/wheels.sh.
set -uo pipefail
self="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$0")/.."
part=${1:-list}
tok=${2:-${GPT_OSS_TOKENIZER:-}}
if [ -z "$tok" ]; then
  for candidate in .tok ../shared/gpt-oss-tokenizer; do [ -d "$candidate" ] && tok=$candidate && break; done
fi
if [ "$part" != list ]; then
  [ -n "$tok" ] && [ -f "$tok/tokenizer.json" ] || { echo "error: no tokenizer folder with tokenizer.json (${tok:-none given}); pass it as the second argument" >&2; exit 2; }
  export GPT_OSS_TOKENIZER=$(cd "$tok" && pwd)
fi
export NCCL_NVLS_ENABLE=0  # NVLink multicast off, as the launches of tests/test_distributed.py set it
export PYTHONUNBUFFERED=1  # a part stopped by its timeout still leaves every line it printed in its log
# cuda: the files whose tests run on CUDA when a GPU is visible: the CUDA-only tests, the resident experts' training
# step bit for bit, the compiled fused experts, the tiny end-to-end run with its resume, out of memory, sampler fidelity
CUDA="tests/gpu_cuda_test.py tests/test_mxfp4_experts.py tests/test_fused_experts.py tests/test_train_grpo.py tests/test_oom.py tests/test_sampling_fidelity.py"
run_pytest() {  # a part's log header (benchmarks/log_header.py), then its pytest, stopped 590 s after the start
  local start=$SECONDS
  local pytest=(python3 -m pytest -q -p no:cacheprovider -rfEs --durations=15 "$@")
  python3 benchmarks/log_header.py --COMMAND="bash tests/gpu_suite.sh $part: ${GRPO_TEST_ACCELERATE_CONFIG:+GRPO_TEST_ACCELERATE_CONFIG=$GRPO_TEST_ACCELERATE_CONFIG }${pytest[*]}" \
    || echo "part $part: the log header failed (exit $?)"
  timeout $((590 - (SECONDS - start))) "${pytest[@]}"
  local code=$?
  echo "part $part: exit $code after $((SECONDS - start)) s"
  return $code
}
cpu_half() {  # half (1 or 2) of the cpu part's test files, balanced by a rough weight: 1 + 10 per slow mark
  for file in tests/test_*.py tests/*_test.py; do echo "$(( 1 + 10 * $(grep -c 'mark\.slow' "$file") )) $file"; done |
    sort -k1,1nr -k2 | awk -v half="$1" '{ side = (load[1] <= load[2]) ? 1 : 2; load[side] += $1 }
                                          side == half { print $2 }'
}
at_once() {  # the given parts side by side, a log each under LOG_DIR, after building the tiny model once
  local logs=${LOG_DIR:-runs/gpu-suite} pids=() code=0 each pid
  local threads=${THREADS_PER_PART:-$(( $(nproc) / $# > 0 ? $(nproc) / $# : 1 ))}  # the cores shared out
  mkdir -p "$logs"
  python3 -m tes_grpo.model.tiny_model > "$logs/tiny-model.log" 2>&1 || { echo "error: building the tiny model failed (see $logs/tiny-model.log)" >&2; exit 1; }
  for each in "$@"; do
    OMP_NUM_THREADS=$threads bash "$self" "$each" "$tok" > "$logs/$each.log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || code=1; done
  for each in "$@"; do echo "$each: $(tail -n 2 "$logs/$each.log" | head -n 1)"; done
  exit $code
}
case "$part" in
  cuda) run_pytest $CUDA ;;
  cpu) CUDA_VISIBLE_DEVICES= run_pytest tests ;;
  cpu-1|cpu-2) CUDA_VISIBLE_DEVICES= run_pytest $(cpu_half "${part#cpu-}") ;;
  one-gpu) at_once cuda cpu-1 cpu-2 ;;
  two-gpu) at_once ddp fsdp2 ;;
  ddp) GRPO_TEST_ACCELERATE_CONFIG=ddp.yaml run_pytest tests/test_distributed.py ;;
  fsdp2) GRPO_TEST_ACCELERATE_CONFIG=fsdp2.yaml run_pytest tests/test_distributed.py -k "not two-hosts" ;;
  list) echo "parts: one-gpu (cuda, cpu-1 and cpu-2 at once), cuda ($CUDA), cpu (tests/, GPUs hidden), cpu-1 ($(cpu_half 1 | tr '\n' ' ')), cpu-2 (the other test files), two-gpu (ddp and fsdp2 at once), ddp, fsdp2 (tests/test_distributed.py on 2 GPUs)" ;;
  *) echo "error: unknown part '$part' (one-gpu, cuda, cpu, cpu-1, cpu-2, two-gpu, ddp, fsdp2, list)" >&2; exit 2 ;;
esac
