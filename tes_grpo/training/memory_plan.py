"""How many completions a training pass takes and how many sequences a generation call takes, from GPU memory.

Library module, not a script. It sizes TRAIN_BATCH_SIZE=auto (at most TRAIN_TOKENS_PER_PASS tokens a pass) and the
generate calls from the memory this run has, so the same recipe fits a 24 GB card, an 80 GB one, bf16 or
MXFP4-resident experts. train_grpo.py asks it twice (`plan_run`): before loading, with the weights still to load, so
a run that cannot fit stops with a SettingsError before minutes of loading; and after loading, with the memory
measured then (`MemoryFacts.measured`), which gives the batch layout (`batch_layout`). Everything but
`MemoryFacts.measured` is plain arithmetic on numbers, so the tests run it on made-up free-memory values. The GPU
benchmark checks the constants, and BENCHMARKS.md ("The reference recipe's optimizer step at the defaults") sets
the estimate beside measured peaks:

    python benchmarks/bench_memory.py      # GPU machine: measured peak per training token against this estimate

The budget. MEMORY_BUDGET_GB = 0 takes all the GPU memory this process can still get after loading (the driver's
free memory plus what its own allocator holds unused); MEMORY_BUDGET_GB = B (GiB, 2**30 bytes) is the most the whole
run may hold, weights included, as on a card of B GiB (with torch.cuda.set_per_process_memory_fraction(B / total) a
larger card then behaves like one). The room left, less a margin (MARGIN_FRACTION of it and MARGIN_GIB, for the
allocator's fragmentation and what the estimate leaves out), has to hold one training pass or one generation call
at a time (GRPO never runs them together), plus anything held for the rest of the run.

Training bytes of one pass (rows completions, each P + N tokens at worst: the longest prompt + MAX_COMPLETION_LEN;
b = bytes of the compute dtype, 2 for bf16; f = 4, float32; H hidden size, L layers, q = heads x head_dim,
kv = kv_heads x head_dim, A heads, k experts per token, I expert intermediate size, V vocabulary):

    pass = ACTIVATION_SCALE x [rows (P + N) x per_token + rows N x per_completion_token] + head_tile + fixed

    per_token, gradient checkpointing on (GRADIENT_CHECKPOINTING=1, the GPU default):
        L b H                      each decoder layer's input, kept from the forward until that layer's backward
      + layer                      one layer's tensors saved for backward while it is recomputed and backpropagated
      + layer_backward             the gradients alive inside that layer's backward
      + head                       the final norm's float32 input and the gradient of the last hidden state
    per_token, checkpointing off:  L x layer + layer_backward + head (every layer's tensors kept until the backward)

    layer          = 2 f H             the two RMSNorms' float32 copies of their input (the variance's gradient)
                   + 3 b H + b q       LoRA A's inputs: q/k/v each keep their own autocast copy, o_proj its input
                   + b (2q + 2kv) + 2 f A  flex attention's q, k, v and output, its float32 log-sum-exp, and
                                           the sinks' per-head renormalisation (transformers' flex path)
                   + b k (2I + H)      experts: the gate_up output (SwiGLU's backward) and the down output (the
                                       routing weights' gradient), for each of the k routed copies of a token
    layer_backward = b k (3I + H)      the gradients of the gate_up output, the SwiGLU output and the routed inputs
    head           = f H + b H
    per_completion_token = b H + (f + b) H   TRL's fused head keeps the completion positions' hidden states and
                                             builds their gradient in float32, then casts it
    head_tile      = 4,096 x 32,768 x b      TRL 1.16's fused LM head scores completion positions in tiles of this
                                             many tokens x vocabulary entries (256 MiB), forward and backward; never
                                             [rows, P + N, V] (lm_head.py). Without the fused head (another TRL):
                                             rows N x V x (b + 2 f): bf16 logits, their float32 copy, log-softmax
    fixed          = trainable parameters x 16 (float32 weight, gradient, two Adam moments) + train_transient_bytes
                     (e.g. one layer's experts dequantized from MXFP4 while it runs)

The terms come from a census of the tensors autograd saves in one gpt-oss decoder layer with LoRA r 4 under bf16
autocast and fused_experts.py (transformers 5.24, PEFT 0.21: each saved storage counted once, parameters left out;
tests/test_memory_plan.py repeats it on the CPU). The gradients alive in a backward and the allocator are not in
such a census, so ACTIVATION_SCALE (measured / derived) comes from the GPU benchmark.

Generation bytes of one call of s sequences (graph_decode.py: a static KV cache of P + N slots in each
full-attention layer and a ring of sliding_window slots in each sliding one; the distinct prompts prefilled once):

    generation = s x (kv_cache(P + N) + DECODE_VOCAB_BUFFERS x f x V)      + prefill + generation_fixed_bytes
    kv_cache(T) = 2 kv b x (full_layers x T + sliding_layers x sliding_window)     (keys and values)
    prefill     = prompts x P' x (2 kv b L + b k (2H + 3I) + 3 b q)   the prompts' transformers cache (every layer,
                  before the copy), one MoE layer's routed rows, attention's q/output, for the distinct prompts of
                  the call (rounded up to a power of two) at P' = P rounded up to 256 tokens (graph_decode's buckets)

A generation batch is one optimizer step's completions, or GENERATION_STEPS steps' (k: k times as many sequences,
so k times the KV cache when they fit one call). When the room cannot hold a whole generation batch the plan gives
the most sequences a call can take (a divisor of the batch); whoever generates then splits the batch into calls of
that many, and a plan whose calls are no larger than one step's says that the larger batch gains nothing.

Under FSDP2 (configs/accelerate/fsdp2.yaml) there is no plan for the passes and generate calls; what each GPU must
hold for the weights is still known (`fsdp_weights_per_gpu`: the resident MXFP4 experts replicated on every GPU,
the rest sharded 1/N, two FSDP units gathered at a time), and plan_run stops with a SettingsError before loading
when that does not fit this process's GPU. The figures for gpt-oss-20b and -120b over 1 to 8 GPUs, without a GPU:

    python benchmarks/bench_memory.py --FSDP_TABLE=1
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from tes_grpo.experts.mxfp4 import padded_bytes
from tes_grpo.model import model_loading  # the module: tests stand in for its cuda_available
from tes_grpo.run.processes import local_rank, process_count, uses_fsdp
from tes_grpo.run.script_config import SettingsError

GIB = 2**30
MARGIN_FRACTION = 0.10  # of the room: the caching allocator's fragmentation (BENCHMARKS.md: reserved vs allocated)
MARGIN_GIB = 0.5  # GiB: CUDA/cuBLAS workspaces and small tensors the formula leaves out
ACTIVATION_SCALE = 1.0  # measured / derived training bytes per token (benchmarks/bench_memory.py prints it)
DECODE_VOCAB_BUFFERS = 4  # float32 [sequences, V] tensors alive while a token is sampled: logits, warped, probs, head
PREFILL_BUCKET_TOKENS = 256  # decode_cache.PREFILL_BUCKET_TOKENS (prompts are prefilled left-padded to a multiple)
OPTIMIZER_BYTES_PER_PARAM = 16  # float32 LoRA weight (PEFT upcasts adapters), its gradient, AdamW's two moments
TRL_FUSED_HEAD_TILE = (4096, 32768)  # TRL 1.16: kernels/chunked_logprob.TOKEN_CHUNK_SIZE x the head's vocab chunk


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a gpt-oss config that its memory depends on."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    experts_per_token: int
    intermediate: int
    vocab: int
    sliding_window: int
    full_layers: int

    @classmethod
    def from_config(cls, config) -> ModelShape:
        """From a transformers GptOssConfig (or anything with its attribute names)."""
        layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
        return cls(hidden=config.hidden_size, layers=config.num_hidden_layers, heads=config.num_attention_heads,
                   kv_heads=config.num_key_value_heads, head_dim=config.head_dim, experts=config.num_local_experts,
                   experts_per_token=config.num_experts_per_tok, intermediate=config.intermediate_size,
                   vocab=config.vocab_size, sliding_window=config.sliding_window or 0,
                   full_layers=sum(kind != "sliding_attention" for kind in layer_types))

    @property
    def sliding_layers(self) -> int:
        return self.layers - self.full_layers


# ---------------------------------------------------------------------------------------------------------------
# Bytes: training, generation, weights (the formula in the module docstring, term by term)
# ---------------------------------------------------------------------------------------------------------------

def layer_terms(m: ModelShape, b: int = 2) -> dict[str, int]:
    """Bytes per token of one decoder layer: the tensors saved for its backward ("layer") and the gradients alive
    inside its backward ("layer_backward"). Left out (under 0.2 % at the 20B's sizes): the routing's int64 expert
    ids and orders, LoRA's rank-r intermediates."""
    f, q, kv, k = 4, m.heads * m.head_dim, m.kv_heads * m.head_dim, m.experts_per_token
    saved = (2 * f * m.hidden + 3 * b * m.hidden + b * q + b * (2 * q + 2 * kv) + 2 * f * m.heads
             + b * k * (2 * m.intermediate + m.hidden))
    return {"layer": saved, "layer_backward": b * k * (3 * m.intermediate + m.hidden)}


def train_token_terms(m: ModelShape, checkpointing: bool, b: int = 2) -> dict[str, int]:
    """The per-token terms of a training pass (before ACTIVATION_SCALE): name -> bytes per token; the key
    "per_completion_token" counts completion positions only (see the module docstring)."""
    f = 4
    terms = layer_terms(m, b)
    if checkpointing:
        terms["checkpoints"] = m.layers * b * m.hidden
    else:
        terms["layer"] *= m.layers
    terms["head"] = f * m.hidden + b * m.hidden
    terms["per_completion_token"] = b * m.hidden + (f + b) * m.hidden
    return terms


def train_pass_bytes(m: ModelShape, rows: int, prompt_len: int, completion_len: int, checkpointing: bool,
                     b: int = 2, head_tile: tuple[int, int] | None = TRL_FUSED_HEAD_TILE,
                     scale: float | None = None) -> int:
    """Estimated peak bytes of one training forward + backward of `rows` completions of prompt_len +
    completion_len tokens (the fixed bytes of `MemoryFacts` not included). head_tile: (tokens, vocabulary) of the
    fused LM head's tile; None = the logits are materialised. scale: ACTIVATION_SCALE unless given."""
    terms = dict(train_token_terms(m, checkpointing, b))
    per_completion = terms.pop("per_completion_token")
    activations = rows * (prompt_len + completion_len) * sum(terms.values()) + rows * completion_len * per_completion
    scale = ACTIVATION_SCALE if scale is None else scale
    return int(scale * activations) + lm_head_bytes(m, rows, completion_len, b, head_tile)


def lm_head_bytes(m: ModelShape, rows: int, completion_len: int, b: int = 2,
                  head_tile: tuple[int, int] | None = TRL_FUSED_HEAD_TILE) -> int:
    """The LM head's scoring buffer: one fused-head tile, or (head_tile None) the whole logits, their float32 copy
    and log-softmax."""
    if head_tile is None:
        return rows * completion_len * m.vocab * (b + 2 * 4)
    return min(head_tile[0], max(1, rows * completion_len)) * min(head_tile[1], m.vocab) * b


def kv_cache_bytes(m: ModelShape, sequences: int, tokens: int, b: int = 2) -> int:
    """graph_decode's static KV cache: keys and values, tokens slots per full-attention layer, a ring of
    sliding_window slots per sliding-window layer."""
    per_slot = 2 * m.kv_heads * m.head_dim * b
    window = min(m.sliding_window, tokens) if m.sliding_window else tokens
    return sequences * per_slot * (m.full_layers * tokens + m.sliding_layers * window)


def prefill_bytes(m: ModelShape, prompts: int, prompt_len: int, b: int = 2) -> int:
    """The prefill of `prompts` distinct prompts (rounded up to a power of two) at prompt_len rounded up to
    PREFILL_BUCKET_TOKENS: transformers' cache of every layer, one MoE layer's routed rows, attention's q/output."""
    rows = 1 << max(0, prompts - 1).bit_length()
    tokens = -(-prompt_len // PREFILL_BUCKET_TOKENS) * PREFILL_BUCKET_TOKENS
    q, kv, k = m.heads * m.head_dim, m.kv_heads * m.head_dim, m.experts_per_token
    per_token = 2 * kv * b * m.layers + b * k * (2 * m.hidden + 3 * m.intermediate) + 3 * b * q
    return rows * tokens * per_token


def generation_bytes(m: ModelShape, sequences: int, prompt_len: int, completion_len: int, group: int,
                     b: int = 2) -> int:
    """Estimated peak bytes of one generate call of `sequences` rows (groups of `group` rows share a prompt), the
    fixed bytes of `MemoryFacts` not included: KV cache, sampling buffers, prefill."""
    decode = sequences * DECODE_VOCAB_BUFFERS * 4 * m.vocab
    prompts = -(-sequences // group)
    return kv_cache_bytes(m, sequences, prompt_len + completion_len, b) + decode + prefill_bytes(m, prompts,
                                                                                                 prompt_len, b)


def attention_weight_bytes(m: ModelShape, b: int = 2) -> int:
    """The attention projections' weights and biases (what graph_decode merges LoRA into, a copy per generate
    call)."""
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    return m.layers * b * (m.hidden * (q + 2 * kv) + q * m.hidden + (q + 2 * kv) + m.hidden)


def expert_layer_bytes(m: ModelShape, b: int = 2) -> int:
    """One layer's experts (gate_up and down weights) in the compute dtype: what dequantizing a layer of MXFP4
    experts for its forward or backward needs at once."""
    return m.experts * (m.hidden * 2 * m.intermediate + m.intermediate * m.hidden) * b


def expert_bytes(m: ModelShape, mxfp4: bool, b: int = 2, layers: int | None = None) -> int:
    """The expert weights of `layers` layers (default: all): as MXFP4 in the Hopper layout (mxfp4.padded_bytes:
    4-bit values + one 8-bit scale per 32, each matrix padded to whole tiles; how the resident experts and
    mxfp4_decode's decoding copy are kept) or in the compute dtype."""
    layers = m.layers if layers is None else layers
    if mxfp4:  # gate_up [2 x intermediate, hidden] and down [hidden, intermediate], (out, in)
        per_expert = padded_bytes(2 * m.intermediate, m.hidden) + padded_bytes(m.hidden, m.intermediate)
        return m.experts * layers * per_expert
    return m.experts * 3 * m.hidden * m.intermediate * layers * b


def resident_expert_bytes(m: ModelShape, bf16_expert_layers: int = 0) -> int:
    """The resident MXFP4 experts (mxfp4_experts.py): every layer's but those of the `bf16_expert_layers` layers
    that keep bf16 experts (EXPERTS=mxfp4 with LORA_EXPERT_LAYERS: PEFT adapts bf16 parameters)."""
    return expert_bytes(m, mxfp4=True, layers=m.layers - bf16_expert_layers)


def weights_bytes(m: ModelShape, experts_mxfp4: bool, b: int = 2, bf16_expert_layers: int = 0) -> int:
    """The model's weights on the GPU: the experts (expert_bytes; resident MXFP4 but for bf16_expert_layers layers,
    or all bf16), the rest (embeddings, attention, router, norms, LM head, biases) in the compute dtype."""
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    per_layer = (m.hidden * (q + 2 * kv) + q * m.hidden + (q + 2 * kv) + m.hidden + m.heads  # attention + sinks
                 + m.hidden * m.experts + m.experts + 2 * m.hidden  # router, norms
                 + m.experts * 3 * m.intermediate)  # expert biases (gate_up 2I, down H = I here)
    experts = (resident_expert_bytes(m, bf16_expert_layers) + expert_bytes(m, False, b, layers=bf16_expert_layers)
               if experts_mxfp4 else expert_bytes(m, False, b))
    return experts + (2 * m.vocab * m.hidden + m.layers * per_layer + m.hidden) * b


def lora_params(m: ModelShape, r: int) -> int:
    """Trainable parameters of LoRA rank r on q/k/v/o of every layer (train_grpo's all-linear on gpt-oss), for the
    plan before the adapter exists; afterwards count the model's."""
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    return m.layers * r * ((m.hidden + q) + 2 * (m.hidden + kv) + (q + m.hidden))


# ---------------------------------------------------------------------------------------------------------------
# FSDP2: the weights each GPU holds
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GpuWeights:
    """Bytes of the weights one GPU holds under FSDP2 over `processes` GPUs (fsdp_weights_per_gpu)."""

    processes: int
    replicated_bytes: int  # resident MXFP4 experts: whole on every GPU (0 when the experts are bf16 parameters)
    sharded_bytes: int  # this GPU's 1/processes of every parameter and of LoRA's optimizer state
    gathered_bytes: int  # unsharded copies alive at once: the FSDP unit running and the next one
    train_transient_bytes: int  # one layer's resident experts dequantized while training runs it

    @property
    def weights_bytes(self) -> int:
        return self.replicated_bytes + self.sharded_bytes + self.gathered_bytes

    @property
    def needs_bytes(self) -> int:
        """What the GPU must hold before any activation, KV cache or sampling buffer."""
        return self.weights_bytes + self.train_transient_bytes

    def describe(self, transient: bool = False) -> str:
        """The sum in words: "~X GiB a GPU (MXFP4 experts replicated Y GiB + 1/N of the rest Z GiB + two gathered
        units W GiB)"; transient: needs_bytes, with the dequantized expert layer as one more part."""
        share = f"1/{self.processes} of the {'rest' if self.replicated_bytes else 'weights'}"
        parts = ([f"MXFP4 experts replicated {gib(self.replicated_bytes)} GiB"] if self.replicated_bytes else []) + [
            f"{share} {gib(self.sharded_bytes)} GiB", f"two gathered units {gib(self.gathered_bytes)} GiB"]
        if transient and self.train_transient_bytes:
            parts.append(f"one layer's experts dequantized for training {gib(self.train_transient_bytes)} GiB")
        total = self.needs_bytes if transient else self.weights_bytes
        return f"~{gib(total)} GiB a GPU ({' + '.join(parts)})"


def fsdp_weights_per_gpu(m: ModelShape, processes: int, experts_resident_mxfp4: bool, lora_r: int = 0,
                         b: int = 2, bf16_expert_layers: int = 0) -> GpuWeights:
    """The weights one GPU holds when FSDP2 (configs/accelerate/fsdp2.yaml) shards the model over `processes` GPUs.

    Counted:
    - replicated: the resident MXFP4 experts (resident_expert_bytes: the layers of bf16_expert_layers keep bf16
      experts, parameters like the rest). They are non-persistent buffers
      (mxfp4_experts.py), which FSDP2 does not shard, so every GPU holds all of them. Without them (bf16 experts)
      nothing is replicated: the experts are parameters like the rest.
    - sharded: 1/processes of every parameter (weights_bytes less the replicated experts) and of LoRA rank
      lora_r's float32 weights, gradients and AdamW moments (OPTIMIZER_BYTES_PER_PARAM a parameter).
    - gathered: the unsharded copies of two FSDP units at once, the one running and the next, which FSDP2
      all-gathers while the first computes (its prefetch). The units are the decoder layers (each with its share of
      LoRA, gathered in the compute dtype) and, as accelerate's FSDP2 preparation carves them, the input
      embeddings and the LM head with the final norm: the larger of one vocabulary matrix and one layer, plus one
      layer.
    - train_transient: one layer's experts dequantized to the compute dtype while training runs that layer
      (expert_layer_bytes), on every GPU, when the experts are resident; 0 otherwise.
    Left out: activations, KV cache and sampling buffers (per process, as on one GPU), the gradient
    reduce-scatter buffers of LoRA, and the padding that makes each shard a whole 1/processes.
    """
    if processes < 1:
        raise ValueError(f"processes must be at least 1, got {processes}")
    replicated = resident_expert_bytes(m, bf16_expert_layers) if experts_resident_mxfp4 else 0
    rest = weights_bytes(m, experts_resident_mxfp4, b, bf16_expert_layers) - replicated
    lora = lora_params(m, lora_r)
    vocab_unit = (m.vocab + 1) * m.hidden * b  # the LM head and the final norm (the embeddings: one norm less)
    layer_unit = (rest - 2 * m.vocab * m.hidden * b - m.hidden * b + lora * b) // m.layers
    return GpuWeights(processes=processes, replicated_bytes=replicated,
                      sharded_bytes=-(-(rest + lora * OPTIMIZER_BYTES_PER_PARAM) // processes),
                      gathered_bytes=max(vocab_unit, layer_unit) + layer_unit,
                      train_transient_bytes=expert_layer_bytes(m, b) if experts_resident_mxfp4 else 0)


def fsdp_over(processes: int) -> str:
    return f"FSDP2 over {processes} process{'es' if processes > 1 else ''}"


def fewest_fsdp_processes(m: ModelShape, experts_resident_mxfp4: bool, lora_r: int, available: int,
                          up_to: int = 1024) -> int | None:
    """The fewest processes whose FSDP2 share (fsdp_weights_per_gpu's needs_bytes) fits `available` bytes a GPU;
    None if none up to `up_to` does (replicated experts or the gathered units alone do not fit)."""
    return next((n for n in range(1, up_to + 1)
                 if fsdp_weights_per_gpu(m, n, experts_resident_mxfp4, lora_r).needs_bytes <= available), None)


# ---------------------------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------------------------

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
    head_tile: tuple[int, int] | None = TRL_FUSED_HEAD_TILE  # lm_head.fused_head_tile(); None: full logits
    dtype_bytes: int = 2  # the compute dtype's size (bf16 on GPUs)
    total_bytes: int = 0  # the GPU's memory, for the description only (0 = unknown)

    @classmethod
    def measured(cls, device=None, **others) -> MemoryFacts:
        """free_bytes, held_bytes and total_bytes read from torch for this process's GPU; the rest as given."""
        free, total = torch.cuda.mem_get_info(device)
        allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
        return cls(free_bytes=free + reserved - allocated, held_bytes=allocated, total_bytes=total, **others)


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
                        f"activations (memory_plan.fsdp_weights_per_gpu), but {limit}; " + "; or ".join(options))


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


def gib(n: float) -> str:
    return f"{n / GIB:.1f}"


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
    return SettingsError(f"memory: {what} needs ~{gib(needs)} GiB by the estimate (memory_plan.py), but {limit} "
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


# ---------------------------------------------------------------------------------------------------------------
# The batch layout of an optimizer step
# ---------------------------------------------------------------------------------------------------------------

def largest_divisor_at_most(total: int, cap: int) -> int:
    return max(d for d in range(1, total + 1) if total % d == 0 and d <= max(1, cap))


def check_generation_cadence(s, steps_per_generation: int | None) -> None:
    """SettingsError when GENERATION_STEPS (optimizer steps) and the seed's GRPO_STEPS_PER_GENERATION
    (steps_per_generation, forward/backward passes) are both set: they set the same thing in two units."""
    if steps_per_generation is not None and s.GENERATION_STEPS != 1:
        raise SettingsError(f"GENERATION_STEPS={s.GENERATION_STEPS} and GRPO_STEPS_PER_GENERATION="
                            f"{steps_per_generation} both set how often completions are generated (optimizer steps / "
                            "forward-backward passes); unset the environment variable or leave GENERATION_STEPS at 1")


def generation_passes(s, passes: int, micro: int, steps_per_generation: int | None) -> int:
    """TRL's steps_per_generation: the forward/backward passes (of `micro` completions) one generation batch feeds.
    GENERATION_STEPS=k: k optimizer steps' `passes`. steps_per_generation (the seed's GRPO_STEPS_PER_GENERATION, in
    passes): that many, a divisor of one step's (check_generation_cadence: not both)."""
    check_generation_cadence(s, steps_per_generation)
    if steps_per_generation is None:
        return passes * s.GENERATION_STEPS
    if passes % steps_per_generation or (steps_per_generation * micro) % s.NUM_GENERATIONS:
        raise SettingsError(f"GRPO_STEPS_PER_GENERATION={steps_per_generation}: must divide the {passes} "
                            f"forward/backward passes of an optimizer step, and {steps_per_generation} x {micro} "
                            f"completions must be whole groups of NUM_GENERATIONS={s.NUM_GENERATIONS}")
    return steps_per_generation


def batch_layout(s, longest_prompt: int, steps_per_generation: int | None = None, plan=None) -> dict:
    """How one optimizer step's completions are generated and split into forward/backward passes.

    completions_per_step = PROMPTS_PER_STEP x NUM_GENERATIONS x GRADIENT_ACCUMULATION_STEPS. TRAIN_BATCH_SIZE=auto
    takes the largest divisor of it whose worst case (every completion at MAX_COMPLETION_LEN after the longest
    prompt) fits TRAIN_TOKENS_PER_PASS, so a longer MAX_COMPLETION_LEN trains in smaller passes, never out of
    memory, and the step still trains the same completions. A generation batch feeds GENERATION_STEPS optimizer
    steps (steps_per_generation = passes x GENERATION_STEPS, generation_batch = completions_per_step x
    GENERATION_STEPS), or, with steps_per_generation given (GRPO_STEPS_PER_GENERATION), that many passes
    (`generation_passes`). plan (memory_plan.plan_run, on a GPU): TRAIN_BATCH_SIZE=auto takes its completions a
    pass, and a generate call its sequences, which may split the generation batch.
    """
    per_step = s.PROMPTS_PER_STEP * s.NUM_GENERATIONS * s.GRADIENT_ACCUMULATION_STEPS
    sequence = longest_prompt + s.MAX_COMPLETION_LEN
    if str(s.TRAIN_BATCH_SIZE) == "auto":
        cap = s.TRAIN_TOKENS_PER_PASS // sequence
        micro = plan.train_batch_size if plan else largest_divisor_at_most(per_step, cap)
    else:
        micro = int(s.TRAIN_BATCH_SIZE)
    if per_step % micro:
        raise SettingsError(f"TRAIN_BATCH_SIZE={micro} must divide the {per_step} completions of an optimizer step "
                            "(PROMPTS_PER_STEP x NUM_GENERATIONS x GRADIENT_ACCUMULATION_STEPS)")
    passes = per_step // micro
    generation = generation_passes(s, passes, micro, steps_per_generation)
    return {"completions_per_step": per_step, "prompts_per_step": per_step // s.NUM_GENERATIONS,
            "train_batch_size": micro, "gradient_accumulation_steps": passes, "steps_per_generation": generation,
            "generation_steps": s.GENERATION_STEPS if steps_per_generation is None else 1,
            "generation_batch": generation * micro,
            "generation_sequences": plan.generation_sequences if plan else generation * micro,
            "worst_case_tokens_per_pass": micro * sequence, "longest_prompt": longest_prompt}
