#!/usr/bin/env bash
# The test suite on the GPU machine, in parts that each finish within 10 minutes (TESTING.md):
#   bash tests/gpu_suite.sh PART [TOKENIZER_DIR]
# PART: kernels | train | ddp | fsdp2 | rest | list (prints the parts). TOKENIZER_DIR: gpt-oss's tokenizer folder
# (default: $GPT_OSS_TOKENIZER, else .tok, else ../shared/gpt-oss-tokenizer); the GPU machine has no ../shared,
# so copy it into the project (e.g. .tok) and carry it there. ddp and fsdp2 need 2 GPUs.
# Packages the GPU machine lacks come from wheels: begin the command with the pip line of ../shared/device/wheels.sh.
set -uo pipefail
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
# kernels: CUDA variants, the resident experts' bit-for-bit training step on CUDA, the decode kernel, fused experts
KERNELS="tests/gpu_cuda_test.py tests/test_mxfp4_experts.py tests/test_mxfp4_decode.py tests/test_fused_experts.py tests/test_graph_decode.py tests/test_lm_head.py tests/test_mxfp4.py"
# train: the tiny end-to-end run and resume on the GPU, out-of-memory handling, sampler fidelity, adapter evaluation
TRAIN="tests/test_train_grpo.py tests/test_oom.py tests/test_sampling_fidelity.py tests/test_adapter_eval.py"
run_pytest() {  # a part's pytest, stopped at 590 s so the part ends within 10 minutes
  local start=$SECONDS
  timeout 590 python3 -m pytest -q -p no:cacheprovider "$@"
  local code=$?
  echo "part $part: exit $code after $((SECONDS - start)) s"
  return $code
}
case "$part" in
  kernels) run_pytest $KERNELS ;;
  train) run_pytest $TRAIN ;;
  ddp) GRPO_TEST_ACCELERATE_CONFIG=ddp.yaml run_pytest tests/test_distributed.py ;;
  fsdp2) GRPO_TEST_ACCELERATE_CONFIG=fsdp2.yaml run_pytest tests/test_distributed.py -k "not two-hosts" ;;
  rest)
    ignore=()
    for file in $KERNELS $TRAIN tests/test_distributed.py; do ignore+=(--ignore "$file"); done
    run_pytest tests "${ignore[@]}" ;;
  list) echo "parts: kernels ($KERNELS), train ($TRAIN), ddp, fsdp2 (tests/test_distributed.py on 2 GPUs), rest" ;;
  *) echo "error: unknown part '$part' (kernels, train, ddp, fsdp2, rest, list)" >&2; exit 2 ;;
esac
