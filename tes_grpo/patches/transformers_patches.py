"""Patches of transformers, each with the versions it was checked on and why. Which of them a run takes is decided
by training/fast_paths.py (the speed choices) or tes_grpo.patches.fixes (the corrections). What a patch puts in
place of a library function is given to it by its caller (a patch module knows the library, not the project's
layers)."""

from __future__ import annotations

import contextlib
import logging
import warnings
import weakref
from collections.abc import Callable

import torch
import transformers.masking_utils as masking_utils
import transformers.models.gpt_oss.modeling_gpt_oss as modeling_gpt_oss
from torch.nn.attention import flex_attention as torch_flex_attention
from transformers.generation.utils import GenerationMixin
from transformers.integrations import TensorBoardCallback
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from tes_grpo.run.processes import say as _say

# the models whose experts stay on grouped_mm while generating (keep_grouped_mm_experts_for_decode)
_KEEP_GROUPED_MM: weakref.WeakSet = weakref.WeakSet()


class ExpertsSwitchUnlessKept:
    """GenerationMixin._optimize_model_for_decode for the process: transformers' own switch, but none for the models
    keep_grouped_mm_experts_for_decode names."""

    def __init__(self, original):
        self.wraps_original = original

    def __get__(self, model, owner=None):
        if model is None:
            return self
        if model in _KEEP_GROUPED_MM:
            return contextlib.nullcontext
        return self.wraps_original.__get__(model, owner)

GRADIENT_CHECKPOINTING_DEPRECATION = (r"`(is_gradient_checkpointing|gradient_checkpointing_enable|"
                                      r"gradient_checkpointing_disable)` is deprecated")


def quiet_gradient_checkpointing_deprecation() -> None:
    """transformers 5.24 (5.17 does not warn), read by TRL 1.16 and PEFT 0.21: hides transformers' FutureWarnings
    that `is_gradient_checkpointing`, `gradient_checkpointing_disable` and `gradient_checkpointing_enable` are
    deprecated. TRL's generation helpers (trl/models/utils.py) call them around every generate() call, and PEFT reads
    `is_gradient_checkpointing` whenever it wraps a model (PeftModel.__init__: training, evaluation, the export's
    merge); the project never calls them itself, so the warnings say nothing a user can act on. Only those messages
    are filtered, for the rest of the process."""
    warnings.filterwarnings("ignore", message=GRADIENT_CHECKPOINTING_DEPRECATION, category=FutureWarning)


MXFP4_LOGGER = "transformers.quantizers.quantizer_mxfp4"


class Mxfp4FallbackFilter(logging.Filter):
    """Logging filter for quiet_mxfp4_fallback_warnings: the quantizer's "we will dequantize" warnings."""

    def filter(self, record) -> bool:
        return "dequantiz" not in record.getMessage()


def quiet_mxfp4_fallback_warnings() -> None:
    """transformers 5.17-5.24: drops, for the rest of the process, the MXFP4 quantizer's warnings that it will
    dequantize the experts to bf16, each inviting an install (`pip install kernels==...`, triton, use_kernels=True on
    the CPU). The project asks for that dequantization itself (Mxfp4Config(dequantize=True): the training loader's
    EXPERTS=bf16, the export's merge and check), where the CPU warning fires all the same; and where it loads a
    checkpoint as it is to see what transformers does (the export's check), its own `FELL BACK:` line says why, from
    model_loading.native_mxfp4_blockers. Its other warnings pass. Installed once however often it is called."""
    logger = logging.getLogger(MXFP4_LOGGER)
    if not any(isinstance(known, Mxfp4FallbackFilter) for known in logger.filters):
        logger.addFilter(Mxfp4FallbackFilter())


def keep_grouped_mm_experts_for_decode(model, say=_say) -> bool:
    """transformers 5.17-5.24: stops generate() from switching this model's grouped_mm experts to batched_mm for
    decoding (`model`: the causal LM whose generate() runs, the PEFT base model under LoRA).

    transformers (on GPUs) swaps in `batched_mm` for the decode phase, which gathers every token's expert weights:
    fast for a few sequences, but GRPO decodes 64 at once, where it needs more memory and is slower (BENCHMARKS.md,
    "Generation alone: which experts implementation decodes"). GenerationMixin's method is wrapped once for the
    process (ExpertsSwitchUnlessKept); the models named here get no switch, every other model transformers' own. For
    as long as the model lives (release_grouped_mm_experts_for_decode ends it); returns whether there was a switch to
    turn off.
    """
    current = getattr(GenerationMixin, "_optimize_model_for_decode", None)
    if current is None:
        say("note: this transformers has no decode-time experts switch; nothing to keep")
        return False
    if not isinstance(vars(GenerationMixin)["_optimize_model_for_decode"], ExpertsSwitchUnlessKept):
        GenerationMixin._optimize_model_for_decode = ExpertsSwitchUnlessKept(
            vars(GenerationMixin)["_optimize_model_for_decode"])
    _KEEP_GROUPED_MM.add(model)
    return True


def release_grouped_mm_experts_for_decode(model) -> None:
    """Gives `model` transformers' decode-time experts switch back."""
    _KEEP_GROUPED_MM.discard(model)


@contextlib.contextmanager
def grouped_mm_experts_for_decode(model, say=_say):
    """keep_grouped_mm_experts_for_decode for the duration of a with-block (transformers' switch comes back after,
    unless the model was kept already)."""
    kept_before = model in _KEEP_GROUPED_MM
    kept = keep_grouped_mm_experts_for_decode(model, say)
    try:
        yield model
    finally:
        if kept and not kept_before:
            release_grouped_mm_experts_for_decode(model)


def dequantized_experts_in_dtype(model, dtype, say=_say) -> int:
    """transformers 5.17-5.24: puts the experts that Mxfp4Config(dequantize=True) dequantized into the model's dtype.

    5.17's Mxfp4Dequantize.convert dequantizes to bf16 whatever dtype the model loads in (5.24 takes the dtype of the
    parameter it fills), so a float32 load (the CPU's) got bf16 experts in a float32 model: other numbers than the
    resident experts give (seen on the GPU machine with its GPUs hidden). bf16 -> float32 is exact. Returns how many
    parameters it cast (0 where the library already did it)."""
    cast = 0
    for name, param in model.named_parameters():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")) and param.dtype != dtype:
            param.data = param.data.to(dtype)
            cast += 1
    if cast:
        say(f"note: this transformers dequantized {cast} expert weights to bf16; cast to {dtype} as asked")
    return cast


def point_tensorboard(trainer, log_dir, resume_step: int | None = None) -> bool:
    """transformers 5.17-5.24: sends the Trainer's TensorBoard events to log_dir, and after a resume hides the events
    of the steps that will be redone.

    transformers 5 takes TensorBoard's folder only from the TENSORBOARD_LOGGING_DIR environment variable (read when
    the callback is made), and its SummaryWriter has no purge_step, so a resumed run left two points for every redone
    step. Here the callback gets its folder directly and, on resume, a SummaryWriter with purge_step=resume_step+1
    (TensorBoard then drops older events at or after that step). Returns False when the run has no TensorBoard
    callback (e.g. on ranks > 0 nothing is written anyway).
    """
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
    m = attention_mask.bool()
    count = m.sum(-1)
    start = m.int().argmax(-1) * (count > 0)
    end = start + count
    position = torch.arange(m.shape[-1], device=m.device)
    if not torch.equal((position >= start[:, None]) & (position < end[:, None]), m):
        return None
    return start, end


class BoundedMask:
    """A flex attention mask function limited to each row's [start, end) keys (padding_bounds)."""

    def __init__(self, mask_function, start, end):
        self.mask_function, self.start, self.end = mask_function, start, end

    def __call__(self, batch_idx, head_idx, q_idx, kv_idx):
        return self.mask_function(batch_idx, head_idx, q_idx, kv_idx) & (kv_idx >= self.start[batch_idx]) & (
            kv_idx < self.end[batch_idx])


# create_block_mask's block size, which transformers' flex_attention_mask leaves at torch's default
BLOCK_SIZE = 128


def same_function(a, b) -> bool:
    """Whether two mask functions are the same code over equal captured values, closures compared all the way down
    (transformers builds a fresh closure for each mask; `is` cannot tell them apart)."""
    if a is b:
        return True
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        return len(a) == len(b) and all(same_function(x, y) for x, y in zip(a, b, strict=True))
    code = getattr(a, "__code__", None)
    if code is None or not callable(a):
        return type(a) is type(b) and not callable(b) and a == b
    if code is not getattr(b, "__code__", None):
        return False
    cells, others = a.__closure__ or (), b.__closure__ or ()
    return len(cells) == len(others) and all(
        same_function(x.cell_contents, y.cell_contents) for x, y in zip(cells, others, strict=True))


def causal_window(mask_function, local_size) -> int | None | bool:
    """The sliding window of transformers' sliding-window causal mask function (`local_size` is the window
    create_sliding_window_causal_mask passes along), None for its plain causal one, False for any other."""
    if mask_function is masking_utils.causal_mask_function:
        return None
    if isinstance(local_size, int) and local_size > 0 and same_function(
            mask_function, masking_utils.sliding_window_causal_mask_function(local_size)):
        return local_size
    return False


def bounded_block_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int, kv_offset: int, start, end,
                       window: int | None, mask_mod):
    """The BlockMask that create_block_mask builds for a causal (window None) or sliding-window causal mask cut to
    each row's keys [start, end) (padding_bounds), worked out per block instead of evaluating every position.

    Query i (offset q_offset) may see key k (offset kv_offset) where k <= i, k > i - window, start <= k < end: each
    condition is linear in (i, k), so a block's corners tell whether it is full (every pair, the block inside both
    lengths: create_block_mask pads a cut block with False) or empty. torch's create_block_mask turns those flags into
    its ordered block lists, and so does this, so flex attention gets the same mask from a few small tensors, with
    nothing to compile.
    """
    device = start.device
    q_blocks, kv_blocks = -(-q_length // BLOCK_SIZE), -(-kv_length // BLOCK_SIZE)
    q_lo = torch.arange(q_blocks, device=device).view(1, 1, -1, 1) * BLOCK_SIZE
    kv_lo = torch.arange(kv_blocks, device=device).view(1, 1, 1, -1) * BLOCK_SIZE
    q_hi = (q_lo + BLOCK_SIZE - 1).clamp(max=q_length - 1) + q_offset  # the last positions that exist
    kv_hi = (kv_lo + BLOCK_SIZE - 1).clamp(max=kv_length - 1) + kv_offset
    q_lo, kv_lo = q_lo + q_offset, kv_lo + kv_offset
    whole = (q_lo + BLOCK_SIZE - 1 == q_hi) & (kv_lo + BLOCK_SIZE - 1 == kv_hi)
    start, end = start.view(-1, 1, 1, 1).to(kv_lo.dtype), end.view(-1, 1, 1, 1).to(kv_lo.dtype)
    # keys a block may keep: within the row's bounds, no later than its last query, within the window of its first
    first = torch.maximum(kv_lo, start)
    last = torch.minimum(torch.minimum(kv_hi, end - 1), q_hi)
    full = whole & (kv_lo >= start) & (kv_hi < end) & (kv_hi <= q_lo)
    if window is not None:
        first = torch.maximum(first, q_lo - window + 1)
        full = full & (kv_lo > q_hi - window)
    kept = first <= last
    shape = (batch_size, 1, q_blocks, kv_blocks)
    # torch's own step from dense block flags to ordered block lists, the one create_block_mask ends with
    return torch_flex_attention._create_sparse_block_from_block_mask(
        ((kept & ~full).expand(shape), full.expand(shape)), mask_mod, (q_length, kv_length), BLOCK_SIZE, BLOCK_SIZE)


# the window a full-attention layer's BoundedCausalMask gets: longer than any sequence
FULL_WINDOW = 2**30


class BoundedCausalMask:
    """Causal attention within `window` keys (a 0-d tensor; FULL_WINDOW for a full-attention layer) and each row's
    [start, end) keys: one mask function for both of gpt-oss's layer kinds. Flex attention's compilation is keyed on
    the mask function's code and the values it holds, and transformers' two masks differ in both (a window in a
    closure), so it compiled each kind apart; here the window is a tensor it reads."""

    def __init__(self, start, end, window):
        self.start, self.end, self.window = start, end, window

    def __call__(self, batch_idx, head_idx, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (kv_idx > q_idx - self.window) & (kv_idx >= self.start[batch_idx]) & (
            kv_idx < self.end[batch_idx])


class FlexMaskWithPaddingBounds:
    """transformers' flex_attention_mask with padding written as each row's bounds (flex_masks_with_padding_bounds)."""

    def __init__(self, original):
        self.wraps_original = original

    def __call__(self, *args, **kwargs):
        original = self.wraps_original
        attention_mask = kwargs.get("attention_mask")
        shape = {"batch_size", "q_length", "kv_length"} <= kwargs.keys()
        if args or (attention_mask is None and not shape) or (attention_mask is not None and attention_mask.dim() != 2):
            return original(*args, **kwargs)
        q_offset, kv_offset = kwargs.get("q_offset", 0), kwargs.get("kv_offset", 0)
        if attention_mask is None:  # every key of every row
            rows, device = kwargs["batch_size"], kwargs.get("device")
            bounds = (torch.zeros(rows, dtype=torch.long, device=device),
                      torch.full((rows,), kv_offset + kwargs["kv_length"], dtype=torch.long, device=device))
        else:
            bounds = padding_bounds(attention_mask)
        if bounds is None:  # holes inside a row: transformers' per-position lookup, exact and slower
            return original(**kwargs)
        mask_function = kwargs.get("mask_function", masking_utils.causal_mask_function)
        window = causal_window(mask_function, kwargs.get("local_size"))
        if window is not False and shape:
            start = bounds[0]
            causal = BoundedCausalMask(*bounds, torch.full((), window or FULL_WINDOW, dtype=start.dtype,
                                                           device=start.device))
            return bounded_block_mask(kwargs["batch_size"], kwargs["q_length"], kwargs["kv_length"], q_offset,
                                      kv_offset, *bounds, window,
                                      masking_utils.add_offsets_to_mask_function(causal, q_offset, kv_offset))
        # any other mask function: worked out position by position, in transformers' compiled create_block_mask
        if attention_mask is None or bool(attention_mask.all()):  # no padding: transformers leaves the mask out itself
            return original(**kwargs)
        return original(**{**kwargs, "mask_function": BoundedMask(mask_function, *bounds), "attention_mask": None})


def flex_masks_with_padding_bounds(say=_say) -> bool:
    """transformers 5.17-5.24 + torch 2.11-2.13: builds flex attention's padded block masks from each row's bounds.

    For a padded batch transformers' flex_attention_mask adds `attention_mask[batch, kv]` (the 2-D 0/1 mask) to the
    mask function; with it, flex attention's forward kernel is slower than for the same mask
    written as `start[batch] <= kv < end[batch]`, its backward the same either way (BENCHMARKS.md times both;
    benchmarks/bench_train_pass.py). A row of TRL's batches is one run of ones
    (prompt left-padded, completion right-padded), so its bounds give the same mask; a mask with holes inside a row
    keeps transformers' lookup.
    For transformers' causal and sliding-window causal masks the BlockMask itself is worked out from the bounds
    (bounded_block_mask; the same block lists create_block_mask gives). transformers builds it with
    `torch.compile(create_block_mask)`, whose compilations a cold first step waits for, per mask kind and again as
    shapes change (BENCHMARKS.md); any other mask function still goes through it. Both kinds then hold one mask
    function (BoundedCausalMask), so transformers' compiled flex attention compiles once for both, not per kind.
    Installed into transformers' mask registry for the process (idempotent); returns False, and says so, if this
    transformers has no flex mask entry to wrap.
    """
    registry = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS  # read at call time: tests swap in a fresh registry
    try:
        current = registry["flex_attention"]
    except KeyError:
        say("note: this transformers has no flex_attention mask function to wrap; padded masks stay per position")
        return False
    if not isinstance(current, FlexMaskWithPaddingBounds):
        registry["flex_attention"] = FlexMaskWithPaddingBounds(current)
    return True


def rotary_embedding_in_training(wrap: Callable | None, say=_say) -> bool:
    """transformers 5.17-5.24: gpt-oss's attention applies the rotary embedding through `wrap(original)` (the training
    glue's RopeForTraining, layers/train_glue.py) instead of the library's function.

    GptOssAttention.forward calls the module-level `apply_rotary_pos_emb` of modeling_gpt_oss by name (it is not an
    attribute of the module, so no instance can be given another); its seven elementwise kernels over the query and
    the key become one compiled kernel (train_glue.py says why and how; the same numbers). The module's name is
    pointed at what `wrap` makes of the library's function, which it calls wherever the call is not the training
    forward's. For the process; installing again replaces it; wrap None puts the library's function back. Returns
    False, and says so, if this transformers' gpt-oss has no such function.
    """
    current = getattr(modeling_gpt_oss, "apply_rotary_pos_emb", None)
    if current is None:
        say("note: this transformers' gpt-oss has no apply_rotary_pos_emb; the rotary embedding stays kernel by kernel")
        return False
    original = getattr(current, "wraps_original", current)
    modeling_gpt_oss.apply_rotary_pos_emb = original if wrap is None else wrap(original)
    return True


def flex_sinks_in_training(wrap: Callable | None, say=_say) -> bool:
    """transformers 5.17-5.24: flex attention's sink step in the training forward through `wrap(original)` (the
    training glue's SinksInTraining, layers/train_glue.py).

    flex_attention_forward renormalises its output for gpt-oss's sinks with a float32 product over the whole output,
    a cast back and a transposed copy (train_glue.py says why that costs); its entry in ALL_ATTENTION_FUNCTIONS is
    replaced by what `wrap` makes of it, which calls it without the sinks and applies them in one compiled kernel (the
    same arithmetic). For the process; installing again replaces it; wrap None puts the library's entry back. Returns
    False, and says so, if this transformers has no flex attention entry.
    """
    try:
        current = ALL_ATTENTION_FUNCTIONS["flex_attention"]
    except KeyError:
        say("note: this transformers has no flex_attention entry; its sink step stays kernel by kernel")
        return False
    original = getattr(current, "wraps_original", current)
    ALL_ATTENTION_FUNCTIONS["flex_attention"] = original if wrap is None else wrap(original)
    return True
