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
# evaluation.py: BEST_METRIC, the evaluation quantities a best checkpoint can be chosen by (TRL's eval_ naming of the
# metrics data_reward.reward_fn logs), each with whether greater is better
BEST_METRICS = {
    "eval_action/mean_reward": True,  # invalid answers count as reward 0 (test_lora_adapter.py's mean_reward)
    "eval_action/optimal_fraction": True,  # completions whose action is the row's optimal action
    "eval_action/valid_fraction": True,  # completions with a valid, uncut answer
}
