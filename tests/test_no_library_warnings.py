"""The project's inference scripts print no library warning (transformers 5.24's deprecation that PEFT's wrap
triggers, its MXFP4 quantizer's "pip install kernels" fallbacks): test_lora_adapter.py, its quantized twin,
evaluate_policy.py, the export with its check, and run_exported_model.py, each as a user runs it, on the tiny gpt-oss
with a random LoRA adapter (CPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# what a library warning looks like on stderr: Python's warnings, transformers' logger, an install it invites
SIGNS = ("Warning:", "warnings.warn", "[transformers]", "pip install")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> Path:
    from test_adapter_eval import make_lora_adapter

    from tes_grpo.model.tiny_model import ensure_tiny_checkpoint

    return make_lora_adapter(ensure_tiny_checkpoint(), tmp_path_factory.mktemp("adapter") / "lora", b_std=0.2)


def run(script: str, *args) -> str:
    done = subprocess.run([sys.executable, script, *map(str, args)], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_the_inference_scripts_and_the_export_print_no_library_warning(adapter, tmp_path):
    short = ["--MAX_COMPLETION_LEN=4", "--TEMPERATURE=1"]
    window = sorted((REPO / "data" / "series").glob("*.csv"))[0]
    export = tmp_path / "export"
    said = {
        "test_lora_adapter.py": run("test_lora_adapter.py", f"--ADAPTER_PATH={adapter}", "--MAX_PROMPTS=1",
                                    "--SAMPLES_PER_PROMPT=1", *short, f"--OUT_DIR={tmp_path / 'a'}", "--PROGRESS=0"),
        "test_lora_adapter_quantized.py": run("test_lora_adapter_quantized.py", f"--ADAPTER_PATH={adapter}",
                                              "--MAX_PROMPTS=1", "--SAMPLES_PER_PROMPT=1", *short,
                                              f"--OUT_DIR={tmp_path / 'q'}", "--PROGRESS=0"),
        "evaluate_policy.py": run("evaluate_policy.py", window, f"--ADAPTER_PATH={adapter}", *short,
                                  "--POLICIES=optimal", "--PLOTS=0", f"--OUT_DIR={tmp_path / 'e'}", "--PROGRESS=0"),
        "export_quantized_model.py": run("export_quantized_model.py", f"--ADAPTER_PATH={adapter}",
                                         f"--OUT_DIR={export}", "--CHECK=1"),
        "run_exported_model.py": run("run_exported_model.py", f"--MODEL_ID={export}", "--MAX_ROWS=1", *short),
    }
    warned = {script: [line for line in err.splitlines() if any(sign in line for sign in SIGNS)]
              for script, err in said.items()}
    assert not any(warned.values()), warned
