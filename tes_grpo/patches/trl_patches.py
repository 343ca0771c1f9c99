"""Patches of TRL's behaviour, each with the versions it was checked on and why."""

from __future__ import annotations

import logging

import trl.trainer.utils as trl_utils

from tes_grpo.run.processes import say as _say


class CompletionPositionsOnly:
    """TRL's _use_triton, but True on CPU devices too (score_only_completion_tokens_on_cpu)."""

    def __init__(self, original):
        self.wraps_original = original

    def __call__(self, device) -> bool:
        return device.type == "cpu" or self.wraps_original(device)


def score_only_completion_tokens_on_cpu(say=_say) -> bool:
    """TRL 1.16: makes its fused LM head score only completion positions on CPU too, as it does on CUDA.

    TRL picks "compact" scoring (log-probs only where labels are set, i.e. the completion tokens) only when Triton
    runs on the device; on CPU it pushes every prompt position through the 201,088-token head, forward and
    backward, which makes a CPU step minutes long for ~870-token prompts. The result is the same either way (prompt
    positions are masked out afterwards). Patches the private `trl.trainer.utils._use_triton` for CPU devices only;
    the kernels keep TRL's own CPU fallback. Returns False (and says so) if this TRL lacks the hook.
    """
    current = getattr(trl_utils, "_use_triton", None)
    if current is None:
        say("note: this TRL has no trl.trainer.utils._use_triton; CPU steps score every prompt position")
        return False
    if not isinstance(current, CompletionPositionsOnly):
        trl_utils._use_triton = CompletionPositionsOnly(current)
        say("CPU: TRL's fused LM head set to score completion positions only (as on CUDA)")
    return True


class AllRewardsNoneFilter:
    """Logging filter for quiet_all_rewards_none_warning."""

    def filter(self, record) -> bool:
        message = record.getMessage()
        if "All reward functions returned None" in message:
            return False
        # TensorBoard's complaint about a None reward metric (other None metrics still warn)
        return not ('log a value of "None"' in message and "reward" in message)


def quiet_all_rewards_none_warning() -> None:
    """TRL 1.16 / transformers 5.17-5.24: drops the warnings a step with no scorable completion causes, every step.

    With INVALID_REWARD=nan a step can have no scorable completion: TRL's "All reward functions returned None"
    then prints a whole ~870-token prompt, and TensorBoard's "attempting to log a value of None" fires for each
    reward metric TRL logs as None. The share of such completions is logged as action/valid_fraction instead.
    """
    logging.getLogger("trl.trainer.grpo_trainer").addFilter(AllRewardsNoneFilter())
    logging.getLogger("transformers.integrations.integration_utils").addFilter(AllRewardsNoneFilter())
