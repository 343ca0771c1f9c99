"""Workarounds for library behaviour, in one place: each says the library version it serves and why.

Delete one when the library it works around no longer needs it (each checks for the hook it patches and says so
when the hook is gone).
"""

from __future__ import annotations

import contextlib


def _say(message: str) -> None:
    from tes_grpo.processes import say

    say(message)


def keep_grouped_mm_experts_for_decode(model, say=_say) -> bool:
    """transformers 5.17-5.23: stops generate() from switching grouped_mm experts to batched_mm for decoding.

    transformers (on GPUs) swaps in `batched_mm` for the decode phase, which gathers every token's expert weights:
    fast for a few sequences, but GRPO decodes 64 at once, where it ran out of memory on an H100 and was slower
    (BENCHMARKS.md, "Generation alone: which experts implementation decodes"). Permanent for this model object;
    returns whether there was a switch to turn off.
    """
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not hasattr(inner, "_optimize_model_for_decode"):
        say("note: this transformers has no decode-time experts switch; nothing to keep")
        return False
    inner._optimize_model_for_decode = contextlib.nullcontext
    return True


@contextlib.contextmanager
def grouped_mm_experts_for_decode(model, say=_say):
    """keep_grouped_mm_experts_for_decode for the duration of a with-block (transformers' switch comes back after)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    kept = keep_grouped_mm_experts_for_decode(model, say)
    try:
        yield model
    finally:
        if kept:
            del inner._optimize_model_for_decode


def _completion_positions_only(original):
    def use_compact_scoring(device):
        return device.type == "cpu" or original(device)

    use_compact_scoring.wraps_original = original
    return use_compact_scoring


def score_only_completion_tokens_on_cpu(say=_say) -> bool:
    """TRL 1.16: makes its fused LM head score only completion positions on CPU too, as it does on CUDA.

    TRL picks "compact" scoring (log-probs only where labels are set, i.e. the completion tokens) only when Triton
    runs on the device; on CPU it pushes every prompt position through the 201,088-token head, forward and
    backward, which makes a CPU step minutes long for ~870-token prompts. The result is the same either way (prompt
    positions are masked out afterwards). Patches the private `trl.trainer.utils._use_triton` for CPU devices only;
    the kernels keep TRL's own CPU fallback. Returns False (and says so) if this TRL lacks the hook.
    """
    import trl.trainer.utils as trl_utils

    current = getattr(trl_utils, "_use_triton", None)
    if current is None:
        say("note: this TRL has no trl.trainer.utils._use_triton; CPU steps score every prompt position")
        return False
    if not hasattr(current, "wraps_original"):
        trl_utils._use_triton = _completion_positions_only(current)
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
    """TRL 1.16 / transformers 5.x: drops the warnings a step with no scorable completion causes, every step.

    With INVALID_REWARD=nan a step can have no scorable completion: TRL's "All reward functions returned None"
    then prints a whole ~870-token prompt, and TensorBoard's "attempting to log a value of None" fires for each
    reward metric TRL logs as None. The share of such completions is logged as action/valid_fraction instead.
    """
    import logging

    logging.getLogger("trl.trainer.grpo_trainer").addFilter(AllRewardsNoneFilter())
    logging.getLogger("transformers.integrations.integration_utils").addFilter(AllRewardsNoneFilter())


class SyncedGenerate:
    """Wraps a model's generate() to pass synced_gpus=True (see sync_generation_across_processes)."""

    def __init__(self, generate):
        self.generate = generate

    def __call__(self, *args, **kwargs):
        kwargs.setdefault("synced_gpus", True)
        return self.generate(*args, **kwargs)


def sync_generation_across_processes(model, sharded: bool, processes: int, say=_say) -> bool:
    """transformers 5.17-5.23 + accelerate 1.x FSDP2: makes generate() keep all processes in step.

    Under FSDP every process must run the same number of forward passes (each gathers the sharded weights), so a
    process whose completions all ended keeps stepping until every process is done. transformers sets
    synced_gpus itself only for its own FSDP integration, not for accelerate's. Returns whether it wrapped.
    """
    if not (sharded and processes > 1):
        return False
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not isinstance(inner.generate, SyncedGenerate):
        inner.generate = SyncedGenerate(inner.generate)
    say("FSDP: generate() runs with synced_gpus=True (processes step together until all completions end)")
    return True


def give_trainable_weights_storage(model) -> int:
    """accelerate 1.x FSDP2: gives trainable parameters left on the meta device real (uninitialised) CPU storage.

    On FSDP ranks > 0 the base model is built without weights (meta) and PEFT adds its LoRA weights there too.
    accelerate maps the optimizer's parameters to their sharded copies by data_ptr(), which is 0 for every meta
    tensor: left on meta, all LoRA weights would map to one tensor and never be trained on that rank. FSDP
    overwrites the storage with rank 0's values while sharding. The frozen base weights stay on meta. Returns how
    many parameters moved.
    """
    import torch

    moved = 0
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.requires_grad and param.is_meta:
                setattr(module, name, torch.nn.Parameter(torch.empty_like(param, device="cpu"), requires_grad=True))
                moved += 1
    return moved


def _top_saved_tensors_hooks():
    import torch

    return getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def saved_tensors_hooks_readable() -> bool:
    """Whether this torch lets saved_tensors_hooks_now read the active hooks."""
    return _top_saved_tensors_hooks() is not None


def saved_tensors_hooks_now():
    """torch 2.8-2.13: the saved-tensor hooks active in this thread now, (pack, unpack), or None.

    torch applies only the innermost torch.autograd.graph.saved_tensors_hooks, so the hooks mxfp4_experts.py sets
    around a resident experts call (to keep the dequantized weights out of autograd's saved tensors) would shadow
    gradient checkpointing's inside a checkpointed layer, and that layer's activations would be kept; it hands every
    other tensor to the hooks returned here. torch has no public way to read them, only the private
    torch._C._autograd._top_saved_tensors_default_hooks(ignore_is_tracing). RuntimeError when it is gone.
    """
    top = _top_saved_tensors_hooks()
    if top is None:
        import torch

        raise RuntimeError(f"torch {torch.__version__} has no torch._C._autograd._top_saved_tensors_default_hooks: "
                           "resident MXFP4 experts cannot leave gradient checkpointing's hooks in charge "
                           "(EXPERTS=bf16 loads the experts dequantized)")
    return top(False)


def point_tensorboard(trainer, log_dir, resume_step: int | None = None) -> bool:
    """transformers 5.x: sends the Trainer's TensorBoard events to log_dir, and after a resume hides the events of
    the steps that will be redone.

    transformers 5 takes TensorBoard's folder only from the TENSORBOARD_LOGGING_DIR environment variable (read when
    the callback is made), and its SummaryWriter has no purge_step, so a resumed run left two points for every redone
    step. Here the callback gets its folder directly and, on resume, a SummaryWriter with purge_step=resume_step+1
    (TensorBoard then drops older events at or after that step). Returns False when the run has no TensorBoard
    callback (e.g. on ranks > 0 nothing is written anyway).
    """
    from transformers.integrations import TensorBoardCallback

    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, TensorBoardCallback):
            callback.logging_dir = str(log_dir)
            if resume_step is not None and callback._SummaryWriter is not None and trainer.is_world_process_zero():
                callback.tb_writer = callback._SummaryWriter(log_dir=str(log_dir), purge_step=resume_step + 1)
            return True
    return False


def padding_bounds(attention_mask):
    """(start, end) per row [B] when each row of a 2-D 0/1 mask is one run of ones (left and right padding, as TRL
    batches it; an all-zero row gives start = end), else None."""
    import torch

    m = attention_mask.bool()
    count = m.sum(-1)
    start = m.int().argmax(-1) * (count > 0)
    end = start + count
    position = torch.arange(m.shape[-1], device=m.device)
    if not torch.equal((position >= start[:, None]) & (position < end[:, None]), m):
        return None
    return start, end


def _bounded(mask_function, start, end):
    def mask_mod(batch_idx, head_idx, q_idx, kv_idx):
        return mask_function(batch_idx, head_idx, q_idx, kv_idx) & (kv_idx >= start[batch_idx]) & (
            kv_idx < end[batch_idx])

    return mask_mod


def _flex_mask_with_padding_bounds(original):
    def flex_attention_mask(*args, **kwargs):
        attention_mask = kwargs.get("attention_mask")
        if args or attention_mask is None or attention_mask.dim() != 2 or bool(attention_mask.all()):
            return original(*args, **kwargs)
        bounds = padding_bounds(attention_mask)
        if bounds is None:  # holes inside a row: transformers' per-position lookup, exact and slower
            return original(**kwargs)
        from transformers.masking_utils import causal_mask_function

        mask_function = _bounded(kwargs.get("mask_function", causal_mask_function), *bounds)
        return original(**{**kwargs, "mask_function": mask_function, "attention_mask": None})

    flex_attention_mask.wraps_original = original
    return flex_attention_mask


def flex_masks_with_padding_bounds(say=_say) -> bool:
    """transformers 5.17-5.23 + torch 2.11: builds flex attention's padded block masks from each row's bounds.

    For a padded batch transformers' flex_attention_mask adds `attention_mask[batch, kv]` (the 2-D 0/1 mask, int64
    from TRL) to the mask function; with it, flex attention's forward kernel was several times slower than for the
    same mask written as `start[batch] <= kv < end[batch]`, its backward the same either way (BENCHMARKS.md, "Speed
    at the recipe, third session"; benchmarks/bench_train_pass.py). A row of TRL's batches is one run of ones
    (prompt left-padded, completion right-padded), so its bounds give the same mask; a mask with holes inside a row
    keeps transformers' lookup.
    Installed into transformers' mask registry for the process (idempotent); returns False, and says so, if this
    transformers has no flex mask entry to wrap.
    """
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

        current = ALL_MASK_ATTENTION_FUNCTIONS["flex_attention"]
    except (ImportError, KeyError):
        say("note: this transformers has no flex_attention mask function to wrap; padded masks stay per position")
        return False
    if not hasattr(current, "wraps_original"):
        ALL_MASK_ATTENTION_FUNCTIONS["flex_attention"] = _flex_mask_with_padding_bounds(current)
    return True


def adapter_base_parameters(model) -> list:
    """The frozen parameters of every PEFT adapter layer's base layer (what PEFT's merge_adapter writes into):
    nn.Linear weights and biases under LoRA, the experts' tensors under target_parameters."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    found = {}
    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            for param in module.get_base_layer().parameters(recurse=False):
                if not param.requires_grad:
                    found[id(param)] = param
    return list(found.values())


class BaseWeightsKept:
    """Wraps TRL's VLLMGeneration.sync_weights: the adapter layers' base weights are copied before the sync and
    written back after it (see keep_base_weights_across_vllm_sync). The copies live on the CPU (pinned when the
    weights are on a GPU, so the copies are fast) and are kept between syncs."""

    def __init__(self, sync, model):
        self.sync, self.model = sync, model
        self.saved: list | None = None

    def __call__(self, *args, **kwargs):
        import torch

        if self.saved is None:
            params = adapter_base_parameters(self.model)
            self.saved = [(p, torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=p.is_cuda))
                          for p in params]
        with torch.no_grad():
            for param, copy in self.saved:
                copy.copy_(param.detach())
        try:
            return self.sync(*args, **kwargs)
        finally:
            with torch.no_grad():
                for param, copy in self.saved:
                    param.data.copy_(copy)


def keep_base_weights_across_vllm_sync(trainer, say=_say) -> bool:
    """TRL 1.16 (trl/generation/vllm_generation.py, VLLMGeneration._iter_named_params): keeps the frozen base weights
    bit for bit across every weight sync to vLLM.

    To send vLLM the adapted weights, TRL calls PEFT's merge_adapter() (W += delta, in place, in the trainer's own
    bf16 base weights), reads them, then unmerge_adapter() (W -= delta). In bf16, W + delta - delta is not W: each
    sync moves some base elements by an ulp, and the frozen base, the policy's starting point, drifts a little more
    every step (tests/test_sampling_fidelity.py measures it). Here the adapter layers' base weights are copied
    before each sync and written back after it, so vLLM still gets the merged weights and the trainer's base never
    changes. Costs a copy of those weights to pinned CPU memory and back per sync (1.3 GB for gpt-oss-20b's attention
    projections). Returns False (and says so) when the trainer has no vLLM weight sync to wrap.
    """
    generation = getattr(trainer, "vllm_generation", None)
    sync = getattr(generation, "sync_weights", None)
    if sync is None:
        say("note: this trainer has no vllm_generation.sync_weights; base weights are not guarded across syncs")
        return False
    if not isinstance(sync, BaseWeightsKept):
        generation.sync_weights = BaseWeightsKept(sync, trainer.model)
    say("vLLM: the base weights are copied before each weight sync and restored after it (TRL merges the adapter "
        "into them in place; workarounds.py)")
    return True


def leave_process_group(wait: bool) -> bool:
    """torch 2.11-2.13: destroys the process group before Python exits. Left to the interpreter's finalization, gloo's
    worker threads can release tensors after the interpreter is gone and abort the process with SIGABRT ("terminate
    called without an active exception"; seen here once in the DDP resume test, on the CPU, after its last step; an
    upstream change to register this at exit was abandoned in 2026). wait: meet every process first, so none leaves
    while another still needs it (only on success: after an error one process may never arrive). Returns whether
    there was a group to leave."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    if wait:
        dist.barrier()
    dist.destroy_process_group()
    return True
