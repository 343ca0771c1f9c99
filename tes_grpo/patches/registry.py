"""Every library patch with the function it relies on, the versions it was checked on and that function's
fingerprints (see tes_grpo/patches/__init__.py); tests/test_patches.py holds the installed libraries to it.

    python -m tes_grpo.patches.registry    # each patch's fingerprint on the installed libraries
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.metadata
import inspect
import textwrap
from dataclasses import dataclass


@dataclass(frozen=True)
class Patched:
    """One patch: `target` (module:qualified.name) is the library code it relies on or replaces; `checked` the
    (version of `library`, fingerprint of `target` there) pairs it was checked on."""

    patch: str
    library: str
    target: str
    checked: tuple[tuple[str, str], ...]


PATCHED = (  # patch, library, target, ((version, fingerprint), ...)
    Patched("patches.torch_patches.saved_tensors_hooks_now", "torch",
            "torch._C._autograd:_top_saved_tensors_default_hooks",
            (("2.13.0", "111024718bb8"),)),
    Patched("patches.torch_patches.leave_process_group", "torch",
            "torch.distributed:destroy_process_group",
            (("2.13.0", "279094e17d77"),)),
    Patched("patches.transformers_patches.keep_grouped_mm_experts_for_decode", "transformers",
            "transformers.generation.utils:GenerationMixin._optimize_model_for_decode",
            (("5.24.0", "033efa024e61"),)),
    Patched("patches.transformers_patches.point_tensorboard", "transformers",
            "transformers.integrations.integration_utils:TensorBoardCallback._init_summary_writer",
            (("5.24.0", "54947037bb84"),)),
    Patched("patches.transformers_patches.flex_masks_with_padding_bounds", "transformers",
            "transformers.masking_utils:flex_attention_mask",
            (("5.24.0", "923647fd3f9a"),)),
    Patched("patches.trl_patches.score_only_completion_tokens_on_cpu", "trl",
            "trl.kernels.chunked_logprob:_use_triton",
            (("1.16.0", "24be4bb5dc29"),)),
    Patched("patches.trl_patches.quiet_all_rewards_none_warning", "trl",
            "trl.trainer.grpo_trainer:GRPOTrainer._calculate_rewards",
            (("1.16.0", "998e87670197"),)),
    Patched("patches.trl_patches.quiet_is_gradient_checkpointing_deprecation", "trl",
            "trl.models.utils:_unwrap_model_for_generation",
            (("1.16.0", "bc9972a54fe0"),)),
    Patched("patches.accelerate_patches.give_trainable_weights_storage", "accelerate",
            "accelerate.utils.fsdp_utils:fsdp2_switch_optimizer_parameters",
            (("1.15.0", "23c5c2da694d"),)),
    Patched("sampler.SyncedGenerate", "transformers",
            "transformers.generation.utils:GenerationMixin.generate",
            (("5.24.0", "dc62012b39ba"),)),
    Patched("sampler.BaseWeightsKept", "trl",
            "trl.generation.vllm_generation:VLLMGeneration.sync_weights",
            (("1.16.0", "3e327f709687"),)),
    Patched("sampling_fidelity.FidelityHook.generate_single_turn", "trl",
            "trl.trainer.grpo_trainer:GRPOTrainer._generate_single_turn",
            (("1.16.0", "90c129d19460"),)),
    Patched("sampling_fidelity.FidelityHook.compute_loss", "trl",
            "trl.trainer.grpo_trainer:GRPOTrainer._compute_loss",
            (("1.16.0", "a0773aa2fda0"),)),
    Patched("sampling_fidelity.FidelityHook.per_token_logps", "trl",
            "trl.trainer.grpo_trainer:GRPOTrainer._get_per_token_logps_and_entropies",
            (("1.16.0", "2e6159c321dd"),)),
)


def resolve(target: str):
    """The object `module:qualified.name` names (a property's getter for a property)."""
    module_name, _, qualified = target.partition(":")
    obj = importlib.import_module(module_name)
    for part in qualified.split("."):
        found = inspect.getattr_static(obj, part) if inspect.isclass(obj) else getattr(obj, part)
        obj = found.fget if isinstance(found, property) else getattr(found, "__func__", found)
    return obj


def _without_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return tree


def code_fingerprint(source: str) -> str:
    """12 hex digits that change when the code in `source` changes, not its docstrings, comments or formatting."""
    text = ast.dump(_without_docstrings(ast.parse(textwrap.dedent(source))))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def fingerprint(target: str) -> str:
    """code_fingerprint of `target`'s source; for a builtin without source, of its name and text signature."""
    obj = resolve(target)
    try:
        source = inspect.getsource(obj)
    except (OSError, TypeError):
        text = f"builtin {getattr(obj, '__qualname__', target)} {getattr(obj, '__text_signature__', None)}"
        return hashlib.sha256(text.encode()).hexdigest()[:12]
    return code_fingerprint(source)


if __name__ == "__main__":
    for entry in PATCHED:
        version = importlib.metadata.version(entry.library)
        print(f"{entry.patch}: {entry.library} {version} {entry.target} {fingerprint(entry.target)}")
