"""How many completions a training pass takes and how many sequences a generate call takes, from GPU memory.

Library module, not a script. It sizes TRAIN_BATCH_SIZE=auto (at most TRAIN_TOKENS_PER_PASS tokens a pass) and the
generate calls from the memory this run has, so the same recipe fits a 24 GB card, an 80 GB one, bf16 or
MXFP4-resident experts. train_grpo.py asks it twice (`plan_run`): before loading, with the weights still to load, so
a run that cannot fit stops with a SettingsError before minutes of loading; and after loading, with the memory
measured then (`MemoryFacts.measured`), which batch_layout.py turns into the batch layout. The bytes come from
memory_estimate.py (its docstring has the formulas); everything but `MemoryFacts.measured` is plain arithmetic on
numbers, so the tests run it on made-up free-memory values.

The budget. MEMORY_BUDGET_GB = 0 takes all the GPU memory this process can still get after loading (the driver's
free memory plus what its own allocator holds unused); MEMORY_BUDGET_GB = B (GiB, 2**30 bytes) is the most the whole
run may hold, weights included, as on a card of B GiB (with torch.cuda.set_per_process_memory_fraction(B / total) a
larger card then behaves like one). The room left, less a margin (MARGIN_FRACTION of it and MARGIN_GIB, for the
allocator's fragmentation and what the estimate leaves out), has to hold one training pass or one generation call
at a time (GRPO never runs them together), plus anything held for the rest of the run.

A generation batch is one optimizer step's completions, or GENERATION_STEPS steps' (k: k times as many sequences,
so k times the KV cache when they fit one call). When the room cannot hold a whole generation batch the plan gives
the most sequences a call can take (a divisor of the batch); whoever generates then splits the batch into calls of
that many, and a plan whose calls are no larger than one step's says that the larger batch gains nothing.

Under FSDP2 (configs/accelerate/fsdp2.yaml) there is no plan for the passes and generate calls; plan_run still
checks each GPU's share of the weights (memory_estimate.fsdp_weights_per_gpu) and stops with a SettingsError before
loading when that does not fit this process's GPU.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from tes_grpo.model import model_loading  # the module: tests stand in for its cuda_available
from tes_grpo.run.processes import local_rank, process_count, uses_fsdp
from tes_grpo.run.script_config import SettingsError
from tes_grpo.training.batch_layout import generation_passes
from tes_grpo.training.lm_head import TRL_1_16_HEAD_TILE
from tes_grpo.training.memory_estimate import (
    GIB,
    OPTIMIZER_BYTES_PER_PARAM,
    GpuWeights,
    ModelShape,
    attention_weight_bytes,
    expert_bytes,
    expert_layer_bytes,
    fewest_fsdp_processes,
    fsdp_weights_per_gpu,
    generation_bytes,
    gib,
    kv_cache_bytes,
    lora_params,
    train_pass_bytes,
    weights_bytes,
)

MARGIN_FRACTION = 0.10  # of the room: the caching allocator's fragmentation (BENCHMARKS.md: reserved vs allocated)
MARGIN_GIB = 0.5  # GiB: CUDA/cuBLAS workspaces and small tensors the formula leaves out


@dataclass(frozen=True)
class MemoryFacts:
    """What the plan needs besides the settings: the GPU memory now and what the run adds to it (bytes)."""

    free_bytes: int  # what this process can still get: the driver's free memory + its allocator's unused cache
    held_bytes: int = 0  # what this process's tensors hold now (the weights, once loaded)
    to_load_bytes: int = 0  # weights not loaded yet (the check before loading; weights_bytes), 0 after
    later_resident_bytes: int = 0  # held from some point on for the rest of the run (an MXFP4 decode copy)
    train_transient_bytes: int = 0  # a pass's fixed extra (e.g. expert_layer_bytes when experts are MXFP4)
    generation_fixed_bytes: int = 0  # a generate call's fixed extra
    trainable_params: int = 0  # LoRA parameters (weights, gradients and AdamW moments stay all run)
    head_tile: tuple[int, int] | None = TRL_1_16_HEAD_TILE  # lm_head.fused_head_tile(); None: full logits
    dtype_bytes: int = 2  # the compute dtype's size (bf16 on GPUs)
    total_bytes: int = 0  # the GPU's memory, for the description only (0 = unknown)

    @classmethod
    def measured(cls, device=None, **others) -> MemoryFacts:
        """free_bytes, held_bytes and total_bytes read from torch for this process's GPU; the rest as given."""
        free, total = torch.cuda.mem_get_info(device)
        allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
        return cls(free_bytes=free + reserved - allocated, held_bytes=allocated, total_bytes=total, **others)


def fsdp_over(processes: int) -> str:
    return f"FSDP2 over {processes} process{'es' if processes > 1 else ''}"


def recipe_facts(s, m: ModelShape, loaded: bool, experts_resident_mxfp4: bool, mxfp4_decode_copy: bool,
                 device=None, bf16_expert_layers: int = 0) -> MemoryFacts:
    """MemoryFacts for train_grpo's recipe, measured now: before loading (loaded=False) the weights still to come
    count against the free memory; experts_resident_mxfp4: training dequantizes one layer's experts at a time
    (mxfp4_experts.py); mxfp4_decode_copy: DECODE_EXPERTS=mxfp4 over bf16 experts packs an MXFP4 copy at the first
    generation and keeps it; bf16_expert_layers: layers whose experts stay bf16 among resident ones (weights_bytes);
    LoRA r = s.LORA_R."""
    return MemoryFacts.measured(
        device,
        to_load_bytes=0 if loaded else weights_bytes(m, experts_mxfp4=experts_resident_mxfp4,
                                                     bf16_expert_layers=bf16_expert_layers),
        train_transient_bytes=expert_layer_bytes(m) if experts_resident_mxfp4 else 0,
        later_resident_bytes=expert_bytes(m, mxfp4=True) if mxfp4_decode_copy else 0,
        trainable_params=lora_params(m, s.LORA_R))


def no_plan_reason(s) -> str | None:
    """Why this run has no memory plan for its passes and generate calls ("no GPU", "FSDP", "FSDP and vLLM" or
    "vLLM": memory this estimate does not model), or None."""
    if not model_loading.cuda_available():
        return "no GPU"
    if uses_fsdp():
        return "FSDP and vLLM" if s.USE_VLLM else "FSDP"
    return "vLLM" if s.USE_VLLM else None


def check_fsdp_weights(s, m: ModelShape, processes: int, experts_resident_mxfp4: bool,
                       facts: MemoryFacts, bf16_expert_layers: int = 0) -> GpuWeights:
    """fsdp_weights_per_gpu for this run, checked against the GPU's free memory (facts.free_bytes) or, when set,
    MEMORY_BUDGET_GB less what this process holds (facts.held_bytes). SettingsError when the weights and one
    dequantized expert layer alone do not fit: it names the need, the limit and what would fit."""
    weights = fsdp_weights_per_gpu(m, processes, experts_resident_mxfp4, s.LORA_R,
                                   bf16_expert_layers=bf16_expert_layers)
    budget = budget_bytes_of(s)
    binds = budget is not None and budget - facts.held_bytes < facts.free_bytes
    available = budget - facts.held_bytes if binds else facts.free_bytes
    if weights.needs_bytes <= available:
        return weights
    if binds:
        limit = f"MEMORY_BUDGET_GB={s.MEMORY_BUDGET_GB:g} leaves {gib(max(0, available))} GiB"
    else:
        limit = f"the GPU has {gib(facts.free_bytes)} GiB free" + (
            f" of {gib(facts.total_bytes)} GiB" if facts.total_bytes else "")
    options = ["raise MEMORY_BUDGET_GB (0 = all the GPU's free memory)"] if binds else []
    like = "at this budget" if binds else "like this one"
    fewest_bf16 = fewest_fsdp_processes(m, False, s.LORA_R, available)
    if experts_resident_mxfp4:
        bf16 = fsdp_weights_per_gpu(m, processes, False, s.LORA_R)
        options += [f"use GPUs with at least {gib(weights.needs_bytes)} GiB free: the resident MXFP4 experts "
                    f"({gib(weights.replicated_bytes)} GiB) are replicated on every GPU, so more GPUs shrink only "
                    "the sharded part",
                    f"EXPERTS=bf16: dequantized at load, the experts are parameters that FSDP2 shards, "
                    f"{bf16.describe()} over {processes}, which "
                    + (f"fits {fewest_bf16} or more GPUs {like}" if fewest_bf16 else f"fits no number of GPUs {like}")
                    + f"; rank 0's host then needs RAM for the whole bf16 model "
                    f"({gib(weights_bytes(m, experts_mxfp4=False))} GiB) while loading"]
    else:
        options.append((f"use {fewest_bf16} or more GPUs {like} (--num_processes), or " if fewest_bf16 else "")
                       + "use GPUs with more memory")
    raise SettingsError(f"memory: {fsdp_over(processes)} needs {weights.describe(transient=True)} before any "
                        f"activations (memory_estimate.fsdp_weights_per_gpu), but {limit}; " + "; or ".join(options))


def plan_run(s, config, longest_prompt: int, steps_per_generation: int | None, experts_resident_mxfp4: bool,
             loaded: bool, say=print, bf16_expert_layers: int = 0) -> MemoryPlan | None:
    """train_grpo's memory plan for a model `config` on this process's GPU: None (and why, through `say`) where
    there is nothing to plan (no GPU; FSDP and vLLM hold memory this estimate does not model). Before loading
    (loaded=False) it only checks that the run can fit, so a run that cannot stops with a SettingsError before
    minutes of loading; after loading it says the budget and both choices.

    Under FSDP (without vLLM) there is no plan for the passes and generate calls either, but the weights each GPU
    will hold (check_fsdp_weights) are checked against this process's GPU, before loading and after (the weights
    reach the GPUs only when the trainer prepares the model), and said after loading. bf16_expert_layers: with
    resident experts, the layers that keep bf16 ones (weights_bytes)."""
    why = no_plan_reason(s)
    if why == "FSDP":
        facts = MemoryFacts.measured(local_rank())
        processes = process_count()
        weights = check_fsdp_weights(s, ModelShape.from_config(config), processes, experts_resident_mxfp4, facts,
                                     bf16_expert_layers)
        if loaded:
            dequantized = (f", {gib(weights.needs_bytes)} GiB with one layer's experts dequantized for training"
                           if weights.train_transient_bytes else "")  # the check counts it too
            say(f"memory: {fsdp_over(processes)}: weights {weights.describe()}{dequantized}, of "
                f"{gib(facts.free_bytes)} GiB free; no plan for passes (TRAIN_TOKENS_PER_PASS sizes them, "
                "generation takes the whole batch)")
        return None
    if why is not None:
        if loaded:
            say(f"memory: no plan ({why}): TRAIN_TOKENS_PER_PASS sizes the training passes, generation takes the "
                "whole batch")
        return None
    m = ModelShape.from_config(config)
    decode_copy = not experts_resident_mxfp4 and s.DECODE_EXPERTS in ("auto", "mxfp4")
    facts = recipe_facts(s, m, loaded, experts_resident_mxfp4, decode_copy, bf16_expert_layers=bf16_expert_layers)
    if s.DECODE_LORA == "merged":  # graph_decode folds LoRA into a copy of the attention weights per generate call
        facts = dataclasses.replace(facts, generation_fixed_bytes=attention_weight_bytes(m))
    plan = plan_memory(s, m, longest_prompt, facts, steps_per_generation)
    if loaded:
        say(plan.describe())
    return plan


@dataclass(frozen=True)
class MemoryPlan:
    """The room after loading and what it holds: completions a training pass, sequences a generate call."""

    free_bytes: int
    budget_bytes: int | None  # MEMORY_BUDGET_GB in bytes; None = all of free_bytes
    held_bytes: int
    room_bytes: int  # for one pass or one generate call, after the margin and what stays resident
    train_batch_size: int
    train_tokens: int  # worst case tokens of one pass
    train_bytes: int  # estimated peak of one pass (fixed extras included)
    generation_sequences: int  # sequences per generate call (the lead's chunked generation)
    generation_batch: int  # sequences a generation batch has (TRL's one generate call)
    generation_bytes: int
    kv_cache_bytes: int
    generation_steps: int = 1  # optimizer steps a generation batch feeds (GENERATION_STEPS)
    notes: tuple[str, ...] = field(default=())

    def describe(self) -> str:
        """One line for the log: the budget and both choices."""
        budget = "no budget set" if self.budget_bytes is None else f"budget {gib(self.budget_bytes)} GiB"
        calls = ("at once" if self.generation_sequences == self.generation_batch else
                 f"at a time ({self.generation_batch // self.generation_sequences} calls for "
                 f"{self.generation_batch})")
        if self.generation_steps > 1:
            calls += f", one batch for {self.generation_steps} optimizer steps"
        line = (f"memory: {gib(self.free_bytes)} GiB free after loading ({budget}; {gib(self.room_bytes)} GiB for "
                f"a pass or a generate call after the margin); training passes of {self.train_batch_size} "
                f"completions (worst case {self.train_batch_size} x {self.train_tokens // self.train_batch_size:,} "
                f"tokens ~ {gib(self.train_bytes)} GiB est.); generation {self.generation_sequences} sequences "
                f"{calls} (KV cache {gib(self.kv_cache_bytes)} GiB, ~{gib(self.generation_bytes)} GiB est.)")
        return "; ".join([line, *self.notes])


def divisors(n: int) -> list[int]:
    """The divisors of n, largest first."""
    return [d for d in range(n, 0, -1) if n % d == 0]


def budget_bytes_of(s) -> int | None:
    """MEMORY_BUDGET_GB in bytes (None for 0: all the free memory); SettingsError if negative or not finite."""
    value = float(s.MEMORY_BUDGET_GB)
    if not math.isfinite(value) or value < 0:
        raise SettingsError(f"MEMORY_BUDGET_GB={s.MEMORY_BUDGET_GB:g}: must be 0 (all the GPU's free memory) or a "
                            "number of GiB above 0")
    return int(value * GIB) if value > 0 else None


def room_before_margin(facts: MemoryFacts, budget: int | None) -> int:
    """The free memory (or the budget less what is held), less what is still to load and what stays resident."""
    room = facts.free_bytes - facts.to_load_bytes
    if budget is not None:
        room = min(room, budget - facts.held_bytes - facts.to_load_bytes)
    return room - facts.later_resident_bytes - facts.trainable_params * OPTIMIZER_BYTES_PER_PARAM


def room_bytes(facts: MemoryFacts, budget: int | None) -> int:
    """What a pass or a generate call may use: room_before_margin less the margin. Negative when even that does not
    fit."""
    room = room_before_margin(facts, budget)
    return int(room - max(0.0, room) * MARGIN_FRACTION - MARGIN_GIB * GIB)


def _train_bytes(m, facts, s, rows: int, prompt_len: int, completion_len: int) -> int:
    return train_pass_bytes(m, rows, prompt_len, completion_len, s.GRADIENT_CHECKPOINTING, facts.dtype_bytes,
                            facts.head_tile) + facts.train_transient_bytes


def _generation_bytes(m, facts, s, sequences: int, prompt_len: int, completion_len: int) -> int:
    return generation_bytes(m, sequences, prompt_len, completion_len, s.NUM_GENERATIONS,
                            facts.dtype_bytes) + facts.generation_fixed_bytes


def longest_completion_that_fits(m: ModelShape, facts: MemoryFacts, s, prompt_len: int, room: int) -> int:
    """The largest MAX_COMPLETION_LEN (up to the setting) with which one completion a pass and one sequence a
    generate call fit `room`; 0 if none does."""
    def fits(n: int) -> bool:
        return (_train_bytes(m, facts, s, 1, prompt_len, n) <= room
                and _generation_bytes(m, facts, s, 1, prompt_len, n) <= room)

    low, high = 0, s.MAX_COMPLETION_LEN
    if not fits(1):
        return 0
    while low < high:  # both estimates grow with n
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low


def _budget_binds(facts: MemoryFacts, budget: int | None) -> bool:
    return budget is not None and budget - facts.held_bytes < facts.free_bytes


def _nothing_fits(m, facts, s, prompt_len: int, room: int, budget: int | None, what: str, needs: int) -> SettingsError:
    binds = _budget_binds(facts, budget)
    limit = (f"MEMORY_BUDGET_GB={s.MEMORY_BUDGET_GB:g}" if binds
             else f"the GPU's {gib(facts.free_bytes)} GiB of free memory")
    weights = (f"the {gib(facts.to_load_bytes)} GiB of weights still to load" if facts.to_load_bytes
               else f"the {gib(facts.held_bytes)} GiB this process holds" if binds else "")
    bigger = ("raise MEMORY_BUDGET_GB (0 = all the GPU's free memory)" if binds
              else "use a GPU with more free memory")
    if (budget - facts.held_bytes if binds else facts.free_bytes) - facts.to_load_bytes <= 0:
        return SettingsError(f"memory: {limit} does not even hold {weights or 'what is loaded'}; {bigger}")
    fit = longest_completion_that_fits(m, facts, s, prompt_len, room)
    options = [f"lower MAX_COMPLETION_LEN to {fit:,} or less (fits by the estimate)" if fit else
               "no MAX_COMPLETION_LEN fits (the fixed part alone is too large)"]
    if not s.GRADIENT_CHECKPOINTING and "training" in what:
        options.append("set GRADIENT_CHECKPOINTING=1")
    if "training" in what and needs <= room_before_margin(facts, budget):
        # The margin covers what the estimate leaves out; a run past it is the user's informed choice, not auto's.
        options.append("set TRAIN_BATCH_SIZE=1 to run inside the margin (the estimate is over only by it, so it may "
                       "fit or run out of memory; BENCHMARKS.md has a 16 GiB run that fit this way)")
    options.append(bigger)
    return SettingsError(f"memory: {what} needs ~{gib(needs)} GiB by the estimate (memory_estimate.py), but {limit} "
                         f"leaves {gib(max(0, room))} GiB for it (after {weights + ', ' if weights else ''}what stays "
                         f"resident and the {MARGIN_FRACTION:.0%} + {MARGIN_GIB} GiB margin); " + "; or ".join(options))


def plan_memory(s, m: ModelShape, longest_prompt: int, facts: MemoryFacts,
                steps_per_generation: int | None = None) -> MemoryPlan:
    """Completions per training pass and sequences per generate call that fit the memory, for settings `s`
    (train_grpo's: MEMORY_BUDGET_GB, MAX_COMPLETION_LEN, NUM_GENERATIONS, PROMPTS_PER_STEP,
    GRADIENT_ACCUMULATION_STEPS, GENERATION_STEPS, GRADIENT_CHECKPOINTING, TRAIN_BATCH_SIZE, TRAIN_TOKENS_PER_PASS).

    TRAIN_BATCH_SIZE=auto: the largest divisor of a step's completions whose worst case (every completion at
    MAX_COMPLETION_LEN after the longest prompt) fits the room and TRAIN_TOKENS_PER_PASS (an upper bound, 0 = none);
    a number is kept, with a note when the estimate says it does not fit. Generation: a whole generation batch
    (`generation_passes`: GENERATION_STEPS optimizer steps' passes, or GRPO_STEPS_PER_GENERATION's) in one call if
    it fits, else the largest divisor that does. Raises SettingsError naming what fits and what to change when one
    completion a pass or one sequence a call does not fit.
    """
    budget = budget_bytes_of(s)
    room = room_bytes(facts, budget)
    prompt_len, completion_len = longest_prompt, s.MAX_COMPLETION_LEN
    per_step = s.PROMPTS_PER_STEP * s.NUM_GENERATIONS * s.GRADIENT_ACCUMULATION_STEPS
    sequence = prompt_len + completion_len
    notes = []
    if facts.head_tile is None:
        notes.append("LM head: logits materialised (no TRL fused head), counted in full")

    def train_fits(rows: int) -> bool:
        return _train_bytes(m, facts, s, rows, prompt_len, completion_len) <= room

    fitting = [d for d in divisors(per_step) if train_fits(d)]
    if str(s.TRAIN_BATCH_SIZE) == "auto":
        if not fitting:
            raise _nothing_fits(m, facts, s, prompt_len, room, budget,
                                f"one completion a training pass (1 x {sequence:,} tokens)",
                                _train_bytes(m, facts, s, 1, prompt_len, completion_len))
        cap = s.TRAIN_TOKENS_PER_PASS // sequence if s.TRAIN_TOKENS_PER_PASS > 0 else per_step
        micro = next((d for d in fitting if d <= max(1, cap)), 1)
        if fitting[0] > micro:
            notes.append(f"{fitting[0]} a pass would fit; TRAIN_TOKENS_PER_PASS={s.TRAIN_TOKENS_PER_PASS} caps it")
    else:
        micro = int(s.TRAIN_BATCH_SIZE)
        if not train_fits(micro):
            notes.append(f"TRAIN_BATCH_SIZE={micro} is over the estimate (kept as set; auto would take "
                         f"{fitting[0] if fitting else 'none'})")

    passes = max(1, per_step // micro)
    batch = generation_passes(s, passes, micro, steps_per_generation) * micro
    one_sequence = _generation_bytes(m, facts, s, 1, prompt_len, completion_len)
    if one_sequence > room:
        raise _nothing_fits(m, facts, s, prompt_len, room, budget,
                            f"generating one sequence ({sequence:,} tokens of KV cache and sampling buffers)",
                            one_sequence)

    def call_size(total: int) -> int:
        return next(d for d in divisors(total) if _generation_bytes(m, facts, s, d, prompt_len, completion_len) <= room)

    sequences = call_size(batch)
    if batch > per_step and sequences <= call_size(per_step):  # one step's batch already gives calls this large
        notes.append(f"GENERATION_STEPS={s.GENERATION_STEPS} gains nothing here: a generate call fits {sequences} "
                     f"sequences, as it would of one step's {per_step}, while the later steps train off-policy "
                     "(GENERATION_STEPS=1 decodes as fast)")
    return MemoryPlan(
        free_bytes=facts.free_bytes - facts.to_load_bytes, budget_bytes=budget, held_bytes=facts.held_bytes,
        room_bytes=room, train_batch_size=micro, train_tokens=micro * sequence,
        train_bytes=_train_bytes(m, facts, s, micro, prompt_len, completion_len),
        generation_sequences=sequences, generation_batch=batch,
        generation_bytes=_generation_bytes(m, facts, s, sequences, prompt_len, completion_len),
        kv_cache_bytes=kv_cache_bytes(m, sequences, sequence, facts.dtype_bytes),
        generation_steps=s.GENERATION_STEPS if steps_per_generation is None else 1, notes=tuple(notes))
