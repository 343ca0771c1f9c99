"""The bytes a gpt-oss LoRA run needs on a GPU: its weights, one training pass, one generate call, and each GPU's
weights under FSDP2, as plain arithmetic on a config's sizes (ModelShape).

Library module, not a script. memory_plan.py sets these against the GPU's memory to size the training passes and
the generate calls; benchmarks/bench_memory.py sets them beside measured peaks (it prints ACTIVATION_SCALE) and,
with --FSDP_TABLE=1, prints each GPU's FSDP2 share for gpt-oss-20b and -120b. Nothing here reads a GPU, so the
tests run it on the real models' configs without one.

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
    head_tile      = tokens x vocabulary x b   TRL's fused LM head scores completion positions in tiles of this
                                             many tokens x vocabulary entries (lm_head.fused_head_tile(); by
                                             default TRL 1.16's), forward and backward; never [rows, P + N, V]
                                             (lm_head.py). Without the fused head (another TRL):
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
                  the call (rounded up to a power of two) at P' = P rounded up to decode_cache's
                  PREFILL_BUCKET_TOKENS

Under FSDP2 (configs/accelerate/fsdp2.yaml), what each GPU holds for the weights (`fsdp_weights_per_gpu`): the
resident MXFP4 experts replicated on every GPU, the rest sharded 1/N, two FSDP units gathered at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

from tes_grpo.experts.mxfp4 import padded_bytes
from tes_grpo.sampling.decode_cache import PREFILL_BUCKET_TOKENS
from tes_grpo.training.lm_head import TRL_1_16_HEAD_TILE

GIB = 2**30
ACTIVATION_SCALE = 1.0  # measured / derived training bytes per token (benchmarks/bench_memory.py prints it)
DECODE_VOCAB_BUFFERS = 4  # float32 [sequences, V] tensors alive while a token is sampled: logits, warped, probs, head
OPTIMIZER_BYTES_PER_PARAM = 16  # float32 LoRA weight (PEFT upcasts adapters), its gradient, AdamW's two moments


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
                     b: int = 2, head_tile: tuple[int, int] | None = TRL_1_16_HEAD_TILE,
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
                  head_tile: tuple[int, int] | None = TRL_1_16_HEAD_TILE) -> int:
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


def fewest_fsdp_processes(m: ModelShape, experts_resident_mxfp4: bool, lora_r: int, available: int,
                          up_to: int = 1024) -> int | None:
    """The fewest processes whose FSDP2 share (fsdp_weights_per_gpu's needs_bytes) fits `available` bytes a GPU;
    None if none up to `up_to` does (replicated experts or the gathered units alone do not fit)."""
    return next((n for n in range(1, up_to + 1)
                 if fsdp_weights_per_gpu(m, n, experts_resident_mxfp4, lora_r).needs_bytes <= available), None)


def gib(n: float) -> str:
    return f"{n / GIB:.1f}"

