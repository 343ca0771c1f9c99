"""Every library patch with the function it relies on, the versions it was checked on and that function's
fingerprints (see tes_grpo/patches/__init__.py); tests/test_patches.py holds the installed libraries to it.

    python -m tes_grpo.patches.registry                 # each patch's fingerprint on the installed libraries
    python -m tes_grpo.patches.registry UNPACKED_WHEEL  # the same from another version's files
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.metadata
import inspect
import io
import sys
import textwrap
import tokenize
from dataclasses import dataclass
from pathlib import Path


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
            (("2.13.0", "111024718bb8"), ("2.11.0", "111024718bb8"))),
    Patched("patches.torch_patches.leave_process_group", "torch",
            "torch.distributed.distributed_c10d:destroy_process_group",
            (("2.13.0", "fdc2acfcea70"), ("2.11.0", "fdc2acfcea70"))),
    Patched("patches.transformers_patches.keep_grouped_mm_experts_for_decode", "transformers",
            "transformers.generation.utils:GenerationMixin._optimize_model_for_decode",
            (("5.24.0", "19ab4e651fd2"), ("5.17.0", "19ab4e651fd2"))),
    Patched("patches.transformers_patches.dequantized_experts_in_dtype", "transformers",
            "transformers.integrations.mxfp4:Mxfp4Dequantize.convert",
            (("5.24.0", "7f0c82749709"), ("5.17.0", "84b324c1894a"))),
    Patched("patches.transformers_patches.point_tensorboard", "transformers",
            "transformers.integrations.integration_utils:TensorBoardCallback._init_summary_writer",
            (("5.24.0", "8f51734bc71a"), ("5.17.0", "8f51734bc71a"))),
    Patched("patches.transformers_patches.flex_masks_with_padding_bounds", "transformers",
            "transformers.masking_utils:flex_attention_mask",
            (("5.24.0", "4f71cf65fad7"), ("5.17.0", "17c85ab8e856"))),
    Patched("patches.transformers_patches.flex_masks_with_padding_bounds", "transformers",
            "transformers.masking_utils:sliding_window_overlay",  # the window bounded_block_mask works out per block
            (("5.24.0", "6cc6cc7fc2e5"), ("5.17.0", "6cc6cc7fc2e5"))),
    Patched("patches.transformers_patches.flex_masks_with_padding_bounds", "transformers",
            "transformers.masking_utils:causal_mask_function",
            (("5.24.0", "71bbca9c4145"), ("5.17.0", "71bbca9c4145"))),
    Patched("patches.transformers_patches.flex_masks_with_padding_bounds", "torch",
            "torch.nn.attention.flex_attention:_convert_mask_to_block_mask",  # full and partial blocks, cut blocks
            (("2.13.0", "927ed8500d29"), ("2.11.0", "1bc38912edca"))),
    Patched("patches.transformers_patches.flex_masks_with_padding_bounds", "torch",
            "torch.nn.attention.flex_attention:_create_sparse_block_from_block_mask",  # called: block flags to lists
            (("2.13.0", "acc90be51062"), ("2.11.0", "59827f6d9cbc"))),
    Patched("patches.transformers_patches.rotary_embedding_in_training", "transformers",
            "transformers.models.gpt_oss.modeling_gpt_oss:GptOssAttention.forward",  # calls the patched name
            (("5.24.0", "3cdb5143b2e3"), ("5.17.0", "4c90f8c6cd75"))),
    Patched("patches.transformers_patches.rotary_embedding_in_training", "transformers",
            "transformers.models.gpt_oss.modeling_gpt_oss:apply_rotary_pos_emb",
            (("5.24.0", "01a839db2c8e"), ("5.17.0", "01a839db2c8e"))),
    Patched("patches.transformers_patches.flex_sinks_in_training", "transformers",
            "transformers.integrations.flex_attention:flex_attention_forward",
            (("5.24.0", "427e66caf9e5"), ("5.17.0", "427e66caf9e5"))),
    Patched("layers.train_glue.norm_training_forward", "transformers",
            "transformers.models.gpt_oss.modeling_gpt_oss:GptOssRMSNorm.forward",
            (("5.24.0", "37184cecaff0"), ("5.17.0", "37184cecaff0"))),
    Patched("layers.train_glue.lora_training_forward", "peft",
            "peft.tuners.tuners_utils:BaseTunerLayer._cast_input_dtype",  # the cast it leaves out where exact
            (("0.21.2", "85da1d12a02e"), ("0.21.0", "85da1d12a02e"))),
    Patched("layers.train_glue.lora_training_forward", "peft",
            "peft.tuners.lora.layer:Linear.forward",
            (("0.21.2", "d2be59d6c446"), ("0.21.0", "d2be59d6c446"))),
    Patched("patches.trl_patches.score_only_completion_tokens_on_cpu", "trl",
            "trl.kernels.chunked_logprob:_use_triton",
            (("1.16.0", "41e2bdaf9a65"),)),
    Patched("patches.trl_patches.score_only_completion_tokens_on_cpu", "trl",
            "trl.trainer.utils:add_fused_lm_head",  # the call site of _use_triton the patch changes
            (("1.16.0", "2e2a772e2e61"),)),
    Patched("patches.trl_patches.quiet_all_rewards_none_warning", "trl",
            "trl.trainer.grpo_trainer:GRPOTrainer._calculate_rewards",
            (("1.16.0", "d5df91194300"),)),
    Patched("patches.trl_patches.quiet_is_gradient_checkpointing_deprecation", "trl",
            "trl.models.utils:_unwrap_model_for_generation",
            (("1.16.0", "2b31cd6ad2f7"),)),
    Patched("patches.accelerate_patches.give_trainable_weights_storage", "accelerate",
            "accelerate.utils.fsdp_utils:fsdp2_switch_optimizer_parameters",
            (("1.15.0", "ef718eb8b1b5"),)),
    Patched("sampling.sampler.Sampler.generate", "transformers",
            "transformers.generation.utils:GenerationMixin.generate",  # synced_gpus, logits_processor, the output
            (("5.24.0", "5eb11517091e"), ("5.17.0", "89fe0eae9dc9"))),
    Patched("sampling.sampler.BaseWeightsKept", "trl",
            "trl.generation.vllm_generation:VLLMGeneration.sync_weights",
            (("1.16.0", "891eefcde1cb"),)),
    Patched("training.trainer.GptOssGRPOTrainer._generate_single_turn", "trl",
            "trl.trainer.grpo_trainer:GRPOTrainer._generate_single_turn",
            (("1.16.0", "00f3a766d295"),)),
    Patched("training.trainer.GptOssGRPOTrainer._compute_loss", "trl",
            "trl.trainer.grpo_trainer:GRPOTrainer._compute_loss",
            (("1.16.0", "24eeba60c27c"),)),
    Patched("training.trainer.GptOssGRPOTrainer._get_per_token_logps_and_entropies", "trl",
            "trl.trainer.grpo_trainer:GRPOTrainer._get_per_token_logps_and_entropies",
            (("1.16.0", "90405f3bc44e"),)),
    Patched("training.trainer.GptOssGRPOTrainer.prediction_step", "trl",  # evaluation without TRL's loss forward
            "trl.trainer.grpo_trainer:GRPOTrainer.prediction_step",
            (("1.16.0", "b4cf95fc8c3b"),)),
)


def resolve(target: str):
    """The object `module:qualified.name` names (a property's getter for a property), the library's own where a patch
    of this package has wrapped it (every wrapper here keeps the original as `wraps_original`)."""
    module_name, _, qualified = target.partition(":")
    obj = importlib.import_module(module_name)
    for part in qualified.split("."):
        found = inspect.getattr_static(obj, part) if inspect.isclass(obj) else getattr(obj, part)
        while hasattr(found, "wraps_original"):
            found = found.wraps_original
        obj = found.fget if isinstance(found, property) else getattr(found, "__func__", found)
    return obj


def _docstring_lines(tree: ast.AST) -> set[int]:
    """0-based line numbers of every module, class and function docstring in a parsed source."""
    lines = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            lines.update(range(body[0].lineno - 1, body[0].end_lineno))
    return lines


def code_fingerprint(source: str) -> str:
    """12 hex digits that change when the code in `source` changes, not its docstrings, comments or whitespace.
    Made from the text, not the syntax tree, so that every Python version gives the same digits for the same code
    (ast.dump differs between 3.11 and 3.12)."""
    source = textwrap.dedent(source)
    skip = _docstring_lines(ast.parse(source))
    lines = source.splitlines()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            row, col = token.start
            lines[row - 1] = lines[row - 1][:col]
    text = " ".join(" ".join(line for i, line in enumerate(lines) if i not in skip).split())
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


def source_in_file(path, qualified: str) -> str | None:
    """The source of the function or class `qualified` (e.g. "Class.method") in a Python file, decorators included
    as inspect.getsource gives them, or None: how a library version that is not installed is fingerprinted from its
    files (a downloaded wheel, unpacked)."""
    text = Path(path).read_text(encoding="utf-8")
    scope = ast.parse(text).body
    node = None
    for part in qualified.split("."):
        # the last definition of a name is the one Python keeps (typing.overload stubs come before it)
        node = next((n for n in reversed(scope) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     and n.name == part), None)
        if node is None:
            return None
        scope = node.body
    first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
    return "\n".join(text.splitlines()[first - 1:node.end_lineno]) + "\n"


def fingerprint_in_folder(folder, target: str) -> str | None:
    """fingerprint of `target` as the package files under `folder` (an unpacked wheel) hold it, or None."""
    module, _, qualified = target.partition(":")
    base = Path(folder, *module.split("."))
    path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
    source = source_in_file(path, qualified) if path.is_file() else None
    return code_fingerprint(source) if source is not None else None


def main(argv: list[str]) -> int:
    """Prints each patch's fingerprint on the installed libraries, or, given a folder (an unpacked wheel of another
    version), on the files there."""
    if argv and not Path(argv[0]).is_dir():
        print(f"error: {argv[0]}: not a folder (give an unpacked wheel's folder, or nothing for the installed "
              "libraries)", file=sys.stderr)
        return 2
    for entry in PATCHED:
        if argv:
            print(f"{entry.patch}: {argv[0]} {entry.target} {fingerprint_in_folder(argv[0], entry.target)}")
        else:
            version = importlib.metadata.version(entry.library)
            print(f"{entry.patch}: {entry.library} {version} {entry.target} {fingerprint(entry.target)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
