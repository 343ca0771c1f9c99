"""The fixed value sets of the training settings, in a module that imports nothing heavy: train_grpo.py builds its
settings table (and --help) from them before torch is imported. The modules that act on a setting import its values
from here."""

from __future__ import annotations

# fast_paths.py: which sampler and kernels a run takes
FAST_PATHS = {
    "DECODE_GRAPHS": ("auto", "on", "off"),
    "DECODE_EXPERTS": ("auto", "mxfp4", "grouped_mm", "transformers"),
    "TRAIN_EXPERTS": ("auto", "fused", "transformers"),
    "TRAIN_GLUE": ("auto", "eager", "compiled"),
    "DECODE_LORA": ("peft", "merged"),
    "DECODE_GLUE": ("auto", "eager", "compiled"),
}
# model_loading.py: EXPERTS, the form the MoE experts are loaded in (resolve_experts)
EXPERTS_CHOICES = ("auto", "mxfp4", "bf16")
# sampling_fidelity.py: IMPORTANCE_SAMPLING, TRL's vllm_importance_sampling_mode names
IS_MODES = ("off", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
