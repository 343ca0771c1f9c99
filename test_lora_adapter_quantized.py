"""test_lora_adapter.py's report with the base model's MXFP4 expert weights kept quantized where the machine can.

    python test_lora_adapter_quantized.py --ADAPTER_PATH=runs/grpo-gpt-oss-20b

Every setting is test_lora_adapter.py's (`--help` lists them); this script only makes QUANTIZED default to True, so
the base loads without `Mxfp4Config(dequantize=True)`, in bf16. transformers keeps the experts in MXFP4 only with a
CUDA GPU (compute capability >= 7.5), triton and the `kernels` package, which downloads its MXFP4 kernels from the
Hugging Face hub on first use. Where any of that is missing (any CPU machine, an offline GPU machine), or the adapter
has LoRA on the expert weights, the script prints `FELL BACK to dequantized bfloat16 experts: ...` with the reason,
runs the same report on the dequantized model, and records the experts' path in the summary CSV's `experts` column.
The default OUT_DIR is runs/adapter-test-<adapter>-mxfp4/.
"""

from __future__ import annotations

import sys

import test_lora_adapter

if __name__ == "__main__":
    sys.exit(test_lora_adapter.main(quantized=True))
