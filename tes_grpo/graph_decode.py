"""Sampling from gpt-oss with a static KV cache, each decode step replayed as one CUDA graph.

Not a script; train_grpo.py uses it when DECODE_GRAPHS is on (`auto_decode_graphs` says whether "auto" means on, the
one check of the model), and the benchmark times it against transformers':

    python benchmarks/bench_generate.py --NUM_SEQS=64 --NEW_TOKENS=128 --VARIANTS=grouped_mm,graphs   # GPU machine

Why: on an H100 a decode step of the 20B model at 64 sequences through transformers' generate kept the GPU busy for
a fraction of it; the rest was Python and thousands of kernel launches a step (BENCHMARKS.md, "Where a decode step
goes"). A CUDA graph replays all of a step's kernels with one launch, but only if the step has fixed shapes, fixed
buffers and never waits for the GPU. transformers' own route there (static cache + torch.compile) compiled the 20B
forward for over seven minutes and is switched off inside TRL, so this module writes the decode step itself
(BENCHMARKS.md, "The decode step captured by the project itself", times it):

- prefill: the model's own forward (flex attention on GPUs, transformers' DynamicCache), then the keys and values
  are copied into static buffers: one of prompt + max_new_tokens slots per full-attention layer, a ring of
  `sliding_window` slots per sliding-window layer. Padding is masked, as generate() treats TRL's left padding; the
  positions are the trainer's: TRL's training forward passes no position ids, so a token's position is its column
  in the left-padded batch (generate() counts real tokens instead: the same policy in exact arithmetic, as rotary
  attention depends on position differences, but in bf16 the rounded cos/sin differ; on a CPU probe in bf16, LoRA
  at rho 1e-3, counting real tokens left a mean |log p| gap to the trainer of 0.106 on left-padded rows against
  0.015 on unpadded ones). Two changes to what goes in, neither of which changes a real token's inputs:
  - shared prompts (SHARE_PROMPTS): GRPO samples a group of completions per prompt, and TRL passes them as identical
    rows (4 prompts x 16 at the reference recipe), each prefilled in full before; each distinct row is prefilled
    once (their count rounded up to a power of two, see below) and its keys, values and logits are copied to every
    row of its group. Sampling draws nothing during prefill, so the random numbers drawn are generate()'s;
  - bucketed prompt length (PREFILL_BUCKET_TOKENS): transformers compiles flex attention for the shapes it sees, and
    in the generate benchmark it hit torch._dynamo's recompile_limit (8), past which flex attention runs unfused
    (the whole score matrix in memory). A GRPO run pads each step's prompts to a new length, so for the prefill the
    prompt is left-padded further, to a multiple of 256 tokens, and the prefilled row count is a power of two: at
    most MAX_PROMPT_LEN / 256 lengths times a few row counts (one of each for TES prompts, ~1,310 tokens). The
    static cache keeps the prompt as given (the extra slots were masked), so decoding attends over no more slots;
- decode: `decode_step` runs one new token through the same modules (router, experts as the model has them; the
  attention projections as the base products with the LoRA adapter's output added in PEFT's order, one low-rank
  product for q, k and v, see LowRank), with attention written here for one query (sinks included, grouped-query
  heads without copies; flex attention's decoding kernel on CUDA, see attention_function) over a fixed-length view
  of the cache, masks computed on the device from the current slot. It calls the layers' submodules directly, so
  neither the layers' gradient checkpointing nor train mode changes it (gpt-oss has no dropout outside attention;
  LoRA's is 0 here);
- the policy being trained: GRPO's gradient assumes the completions were drawn from the policy the trainer computes,
  so prefill and decode steps do the trainer's arithmetic: under the trainer's autocast (bf16 on GPUs; LoRA's
  products then come out in bf16, as in the training forward), LoRA added to the rounded base products (a merged
  copy's rounding errors would be independent of the trainer's; `lora="merged"` keeps that variant to compare;
  no 1.3 GB merged copy of the 20B model's attention weights either), the trainer's positions, and the logits as
  TRL's fused LM head computes them (head_logits). On the CPU in bf16 (tests/test_graph_decode.py, LoRA at rho =
  rms(delta)/rms(W) of 1e-4 to 1e-2) graph_decode's log-probabilities are the trainer's to 5e-7 nats (mean
  |diff|), against 8e-2 to 1.2e-1 for transformers' generate and 7e-2 to 8.5e-2 with the merged adapter (a random
  model: every rounding is amplified). On GPUs the kernels differ as well (flex attention's decoding kernel against
  its training kernel, the MXFP4 experts against the training experts, cuBLAS at other shapes):
  benchmarks/bench_generate.py's COMPARE_SEQS measures the gap there. `generate(..., logprobs=True)` returns the
  sampled tokens' log-probabilities, which sampling_fidelity.py compares with the trainer's every step;
- experts="mxfp4" (train_grpo's DECODE_EXPERTS=auto on a GPU): each layer's MLP is computed by mxfp4_decode.py
  from the MXFP4 form of its frozen experts (3.7x fewer bytes a step than bf16; the resident blocks themselves when
  mxfp4_experts.py keeps them), bit-equal to the model's MLP; layers that cannot be packed keep their own;
- on CUDA, `DecodeGraphs` captures decode_step once per cache-length bucket (BUCKET_TOKENS) and replays it; on CPU
  the same step runs eagerly (that is what the CPU tests compare with transformers);
- sampling follows transformers' generate for the options TRL sets (temperature, top-k, top-p, min-p with
  transformers' own warper classes; end tokens; pad after the end); `unsupported_options` names anything else, and
  the caller then uses transformers' generate (and says so).

Inside GRPO (TRL 1.16) generate() runs with the model in train mode, gradient checkpointing switched off by TRL and
under torch.no_grad. This module leaves the mode as it finds it, as generate() does: at dropout 0 nothing in
gpt-oss's forward depends on it (`state_blockers`: auto_decode_graphs keeps a model with dropout left on on
transformers' generate). The prefill switches the layers' gradient checkpointing off for its forward if a caller
left it on (checkpointed layers drop the KV cache) and back on after. It runs under no_grad, not inference_mode: a
replayed graph does no autograd bookkeeping either way, and inference tensors returned to a caller that trains on
them fail (an embedding saves its ids for backward; TRL 1.16 happens to rebuild them from lists first).
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass

import torch

BUCKET_TOKENS = 512  # full-attention layers attend over the cache rounded up to this many slots (one graph each)
PREFILL_BUCKET_TOKENS = 256  # prompts are left-padded to a multiple of this before prefill (bounded flex shapes)
SHARE_PROMPTS = True  # prefill each distinct prompt row once and copy its keys/values to its repeats (TRL's groups)

# generate() options this path implements, with the values it accepts (None = any value)
_ACCEPTED = {
    "max_new_tokens": None, "max_length": None, "do_sample": None, "temperature": None, "top_k": None, "top_p": None,
    "min_p": None, "pad_token_id": None, "bos_token_id": None, "eos_token_id": None, "disable_compile": None,
    "compile_config": None, "transformers_version": None, "_from_model_config": None, "use_cache": (True,),
    "repetition_penalty": (1.0,), "num_beams": (1,), "num_return_sequences": (1,), "cache_implementation": (None,),
    "return_dict_in_generate": (False,), "output_scores": (False,), "output_logits": (False,),
    "output_attentions": (False,), "output_hidden_states": (False,), "renormalize_logits": (False,),
    "min_new_tokens": (0,), "min_length": (0,), "typical_p": (1.0,), "top_h": (None,),
}
_INPUT_KWARGS = {"input_ids", "attention_mask", "generation_config"}


def unsupported_options(generation_config, kwargs: dict) -> list[str]:
    """What in a generate() call this path does not implement ([] = it can take the call)."""
    reasons = [f"{name}=..." for name in sorted(set(kwargs) - _INPUT_KWARGS) if kwargs[name] is not None]
    for name, value in generation_config.to_diff_dict().items():
        if name not in _ACCEPTED:
            reasons.append(f"{name}={value!r}")
        elif _ACCEPTED[name] is not None and value not in _ACCEPTED[name]:
            reasons.append(f"{name}={value!r}")
    if generation_config.max_new_tokens is None and generation_config.max_length is None:
        reasons.append("no max_new_tokens")
    return reasons


def logits_warpers(generation_config):
    """transformers' sampling warpers for the config, in generate()'s order (temperature, top-k, top-p, min-p)."""
    from transformers import (
        LogitsProcessorList,
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    g = generation_config
    warpers = LogitsProcessorList()
    if not g.do_sample:
        return warpers
    if g.temperature is not None and g.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(g.temperature))
    if g.top_k is not None and g.top_k != 0:
        warpers.append(TopKLogitsWarper(top_k=g.top_k, min_tokens_to_keep=1))
    if g.top_p is not None and g.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=g.top_p, min_tokens_to_keep=1))
    if g.min_p is not None:
        warpers.append(MinPLogitsWarper(min_p=g.min_p, min_tokens_to_keep=1))
    return warpers


def causal_lm(model):
    """The GptOssForCausalLM inside a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def prefill_length(prompt_len: int, bucket: int | None = None) -> int:
    """The prompt length the prefill runs at: prompt_len rounded up to `bucket` (default PREFILL_BUCKET_TOKENS, read
    at call time; 0 or 1 = no rounding)."""
    bucket = PREFILL_BUCKET_TOKENS if bucket is None else bucket
    return -(-prompt_len // bucket) * bucket if bucket > 1 else prompt_len


def left_pad(input_ids: torch.Tensor, attention_mask: torch.Tensor, length: int, pad_id: int):
    """input_ids/attention_mask left-padded to `length` columns (masked, as TRL pads shorter prompts)."""
    extra = length - input_ids.shape[1]
    if extra <= 0:
        return input_ids, attention_mask
    pad_ids = input_ids.new_full((input_ids.shape[0], extra), pad_id)
    return torch.cat([pad_ids, input_ids], dim=1), torch.cat([attention_mask.new_zeros(pad_ids.shape),
                                                              attention_mask], dim=1)


def shared_prefill_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """Which rows to prefill when some are identical: (rows, source), or None when sharing saves nothing.

    rows [n]: the first row of each distinct prompt (ids and mask equal; in order of first appearance), then copies of
    rows[0] up to n = the next power of two (so the prefill sees few batch sizes); source [B]: for each row, the
    position in `rows` of the row it equals. Reads the rows on the host (once per call, before any decode step).
    """
    batch = input_ids.shape[0]
    key = torch.cat([input_ids, attention_mask.to(input_ids.dtype)], dim=1)
    _, group = torch.unique(key, dim=0, return_inverse=True)  # groups numbered in sorted row order
    distinct = int(group.max()) + 1
    padded = 1 << (distinct - 1).bit_length()
    if padded >= batch:
        return None
    arange = torch.arange(batch, device=key.device)
    first = torch.full((distinct,), batch, device=key.device).scatter_reduce(0, group, arange, "amin")
    order = first.argsort()  # number the groups by first appearance instead
    rank = torch.empty_like(order)
    rank[order] = torch.arange(distinct, device=key.device)
    rows = torch.cat([first[order], first[order][:1].expand(padded - distinct)])
    return rows, rank[group]


def bucket_length(slot: int, total: int, bucket: int | None = None) -> int:
    """Cache slots the full-attention layers attend over while writing `slot`: slot + 1 rounded up to `bucket`
    (default BUCKET_TOKENS, read at call time so tests and benchmarks can change it)."""
    bucket = bucket or BUCKET_TOKENS
    return min(total, -(-(slot + 1) // bucket) * bucket)


class StaticCache:
    """Keys and values of a generate call in buffers that never move (what a CUDA graph needs).

    Full-attention layers: [batch, kv_heads, prompt + new tokens, head_dim], slot i = cache position i (left padding
    included, as in transformers). Sliding-window layers: a ring of `window` slots; slot s holds the newest position
    p <= current with p = s (mod window), which is all a sliding layer may see.
    """

    def __init__(self, config, prompt_mask: torch.Tensor, max_new_tokens: int, dtype):
        batch, self.prompt_len = prompt_mask.shape
        self.total = self.prompt_len + max_new_tokens
        self.window = config.sliding_window
        device = prompt_mask.device
        shape = (batch, config.num_key_value_heads, self.total, config.head_dim)
        ring = (batch, config.num_key_value_heads, self.window, config.head_dim)
        self.sliding = [kind == "sliding_attention" for kind in config.layer_types]
        self.keys = [torch.zeros(ring if s else shape, dtype=dtype, device=device) for s in self.sliding]
        self.values = [torch.zeros_like(k) for k in self.keys]
        # which slots hold a real token: the prompt's mask, then every generated slot (as generate() extends it)
        self.valid = torch.ones(batch, self.total, dtype=torch.bool, device=device)
        self.valid[:, :self.prompt_len] = prompt_mask.bool()
        self.slots = torch.arange(self.total, device=device)
        self.ring_slots = torch.arange(self.window, device=device)

    def fill(self, dynamic_cache, source: torch.Tensor | None = None) -> None:
        """Copies a prefill's DynamicCache (transformers 5.x: .layers[i].keys/.values) into the buffers; row r of the
        buffers takes row source[r] of the prefill (shared prompts; None = row r). A prefill of a longer prompt
        (left-padded further) gives its last prompt_len slots: the rest were masked padding."""
        layers = getattr(dynamic_cache, "layers", None)
        if layers is None or len(layers) != len(self.keys):
            raise RuntimeError("graph_decode needs transformers' DynamicCache with one .layers entry per layer "
                               "(transformers >= 5.0)")
        if any(getattr(layer, "keys", None) is None for layer in layers):
            raise RuntimeError("graph_decode: the prefill filled no KV cache (a layer ran without one)")

        def rows(tensor):
            return tensor if source is None else tensor.index_select(0, source)

        for i, layer in enumerate(layers):
            keys, values = layer.keys, layer.values
            if not self.sliding[i]:
                self.keys[i][:, :, :self.prompt_len].copy_(rows(keys[:, :, -self.prompt_len:]))
                self.values[i][:, :, :self.prompt_len].copy_(rows(values[:, :, -self.prompt_len:]))
                continue
            kept = min(keys.shape[2], self.window - 1, self.prompt_len)  # the next token's key completes the window
            positions = torch.arange(self.prompt_len - kept, self.prompt_len, device=keys.device)
            self.keys[i].index_copy_(2, positions % self.window, rows(keys[:, :, -kept:]))
            self.values[i].index_copy_(2, positions % self.window, rows(values[:, :, -kept:]))

    def masks(self, slot: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Additive float32 masks [batch, slots] for a token written at `slot` (a 0-d device tensor): full layers over
        the first `length` slots, sliding layers over the ring."""
        allowed = self.valid[:, :length] & (self.slots[:length] <= slot)
        full = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
        position = slot - torch.remainder(slot - self.ring_slots, self.window)  # newest position in each ring slot
        seen = position >= 0
        in_ring = torch.gather(self.valid, 1, position.clamp(min=0).expand(self.valid.shape[0], -1)) & seen
        ring = torch.where(in_ring, 0.0, torch.finfo(torch.float32).min)
        return full, ring

    def write(self, layer: int, slot: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, length: int):
        """Stores one token's keys/values at `slot`; returns what the layer attends over."""
        index = (torch.remainder(slot, self.window) if self.sliding[layer] else slot).view(1)
        self.keys[layer].index_copy_(2, index, keys)
        self.values[layer].index_copy_(2, index, values)
        if self.sliding[layer]:
            return self.keys[layer], self.values[layer]
        return self.keys[layer][:, :, :length], self.values[layer][:, :, :length]


def one_query_attention(query, keys, values, mask, sinks, scaling: float) -> torch.Tensor:
    """gpt-oss attention for one new token, step for step as transformers' eager attention computes it (the training
    forward's attention on CPUs): softmax over the keys plus each head's sink logit (which takes probability mass but
    has no value). query [B, H, 1, D]; keys/values [B, KV, L, D]; mask [B, L] additive (float32).

    Query heads are grouped onto their key/value head by a reshape (no repeat_kv copy of the cache). Every step is in
    the model's dtype, as eager attention rounds it: the scores out of the matmul, x scaling, + the mask (clamped to
    the dtype's minimum, eager's masked value), the sink column, minus the row maximum, the softmax (float32 inside,
    rounded), x values. In float32 that is the plain arithmetic; in bf16 it gives the eager training forward's
    roundings, not a more exact attention than the trainer computes. Returns [B, 1, H * D].
    """
    batch, heads, _, dim = query.shape
    kv_heads = keys.shape[1]
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim)
    mask = mask.clamp(min=torch.finfo(query.dtype).min).to(query.dtype)
    scores = torch.matmul(grouped, keys.transpose(-1, -2)) * scaling + mask[:, None, None, :]
    sink = sinks.to(scores.dtype).view(1, kv_heads, heads // kv_heads, 1).expand(batch, -1, -1, -1)
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits - logits.amax(dim=-1, keepdim=True)
    probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
    out = torch.matmul(probs.to(values.dtype), values)
    return out.reshape(batch, 1, heads * dim)


def flex_decode_kernel(query, keys, values, mask, scaling: float):
    """flex attention for one query, without the sinks: (output [B, H, 1, D] in the query's dtype, float32 log-sum-exp
    [B, H, 1]). On CUDA, compiled, it is flex attention's split-KV decoding kernel, which reads each key and value once
    and keeps the scores (float32) on chip. The mask [B, L] is added as a score_mod."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    def add_mask(score, batch, head, q_index, kv_index):
        return score + mask[batch, kv_index]

    out, aux = flex_attention(query, keys, values, score_mod=add_mask, scale=scaling, enable_gqa=True,
                              return_aux=AuxRequest(lse=True))
    return out, aux.lse


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Flex attention's output renormalised for gpt-oss's sinks op for op as transformers 5.17-5.24's flex attention
    does it in the training forward (integrations/flex_attention.py: the log-sum-exp rounded to the values' dtype,
    logsumexp with the sink, out * exp(lse - combined), eagerly, under the caller's autocast), so the decode step
    rounds where the trainer rounds: bf16's log-sum-exp is off by up to 1/16 at 8 to 16, which moves the sink's share
    of each head by up to ~1.5 % (a float32 sigmoid(lse - sink) here would not). out [B, H, Q, D], lse [B, H, Q]."""
    lse = lse.to(out.dtype).unsqueeze(-1)
    batch, heads, queries, _ = out.shape
    sink = sinks.view(1, -1, 1, 1).expand(batch, heads, queries, 1)
    combined = torch.logsumexp(torch.cat([lse, sink], dim=-1), dim=-1, keepdim=True)
    return (out * torch.exp(lse - combined)).to(out.dtype)


def flex_one_query_attention(query, keys, values, mask, sinks, scaling: float, kernel=flex_decode_kernel):
    """one_query_attention through flex attention, as the GPU trains with it: `kernel` (flex_decode_kernel, compiled
    on CUDA: see attention_function) then the sinks as the training forward applies them (with_sinks, eagerly: a
    compiled chain would keep its intermediates in float32 where the trainer rounds them). Same arguments and result
    as one_query_attention."""
    out, lse = kernel(query, keys, values, mask, scaling)
    batch, heads, _, dim = query.shape
    return with_sinks(out, lse, sinks).to(query.dtype).transpose(1, 2).reshape(batch, 1, heads * dim)


@dataclass(frozen=True)
class LowRank:
    """The LoRA part of one or more projections that read the same input (q, k and v), computed as PEFT 0.21's
    lora.Linear.forward computes it, in one product per factor for all of them.

    PEFT adds `lora_B(lora_A(x)) * scaling` to the base layer's output. The factors here are its A and B in the
    dtype that forward computes in: the training autocast's dtype when the trainer runs under autocast (bf16 on GPUs:
    autocast casts x, A and B to bf16 and every product comes out in bf16), else A's dtype (PEFT casts x to it).
    a: the projections' A stacked [sum of ranks, in]; b: their B as one block-diagonal matrix [sum of outputs, sum of
    ranks] (the zero blocks add exact zeros); scale: the scaling, multiplied after b as PEFT does, or None when it is
    a power of two and folded into b (exact in any float dtype: the same numbers as multiplying after); splits: the
    output features of each projection. Why batched: unbatched, each LoRA projection adds ~5 small kernels to a
    decode step, 480 in all for gpt-oss's 24 x 4 projections (BENCHMARKS.md times them); batched, q, k and v share
    two products and no cast kernels are left.
    """

    a: torch.Tensor
    b: torch.Tensor
    scale: float | None
    splits: tuple[int, ...]

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = torch.nn.functional.linear(torch.nn.functional.linear(x.to(self.a.dtype), self.a), self.b)
        if self.scale is not None:
            y = y * self.scale
        return y.split(self.splits, dim=-1)


def _power_of_two(value: float) -> bool:
    return value > 0 and math.frexp(value)[0] == 0.5


def low_rank(factors: list[tuple[torch.Tensor, torch.Tensor, float]], dtype: torch.dtype) -> LowRank:
    """LowRank for (A, B, scaling) of projections sharing an input (all with the same scaling), in `dtype`."""
    scale = factors[0][2]
    a = torch.cat([A.detach() for A, _, _ in factors]).to(dtype)
    b = torch.block_diag(*[B.detach() for _, B, _ in factors]).to(dtype)
    folded = _power_of_two(scale)
    return LowRank(a=a, b=b * scale if folded else b, scale=None if folded else scale,
                   splits=tuple(B.shape[0] for _, B, _ in factors))


def lora_parts(module):
    """(weight, bias, lora) that compute module(x) in PEFT's order: the base layer's F.linear(x, weight, bias), then,
    when lora = (A, B, scaling) is not None, + B(A(x)) * scaling (see LowRank). An nn.Linear gives its own tensors and
    no lora. None (call the module) for anything else: other layer types, several active adapters, LoRA variants
    (DoRA), LoRA biases, dropout left on, input casting switched off, or adapters disabled over merged weights (PEFT
    would unmerge them). Branch for branch as PEFT 0.21's lora.Linear.forward: adapters disabled -> the base layer;
    merged -> the base layer (which holds the delta); else each active adapter's product added.
    """
    if type(module) is torch.nn.Linear:
        return module.weight, module.bias, None
    base = getattr(module, "base_layer", None)
    if type(base) is not torch.nn.Linear or not hasattr(module, "lora_A"):
        return None
    if module.disable_adapters:
        return None if module.merged else (base.weight, base.bias, None)
    if module.merged:
        return base.weight, base.bias, None
    active = [a for a in module.active_adapters if a in module.lora_A]
    if not active:
        return base.weight, base.bias, None
    name = active[0]
    dropout = module.lora_dropout[name]
    if (len(active) > 1 or name in getattr(module, "lora_variant", {}) or module.use_dora.get(name)
            or getattr(module, "lora_bias", {}).get(name) or not getattr(module, "cast_input_dtype_enabled", True)
            or (isinstance(dropout, torch.nn.Dropout) and dropout.p > 0 and dropout.training)):
        return None
    return base.weight, base.bias, (module.lora_A[name].weight, module.lora_B[name].weight, module.scaling[name])


def merged_linear(module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """LORA="merged" (kept to compare with): (weight, bias) with each active adapter's delta (PEFT's
    get_delta_weight, scaling included) added to the base weight in float32 and rounded once to the weight's dtype,
    for F.linear: a new tensor, the model is untouched. None (call the module) where lora_parts gives None.

    What it costs in fidelity: the merged copy's rounding errors are independent of the trainer's, which rounds the
    base product and adds the LoRA output to it (measured on a bf16 q_proj, relative to the trainer's output: 3e-4 to
    3.3e-3 against 3e-6 to 4e-4 for PEFT's order, at rms(delta)/rms(W) from 1e-4 to 1e-2).
    """
    parts = lora_parts(module)
    if parts is None:
        return None
    weight, bias, lora = parts
    if lora is None:
        return weight, bias
    A, B, scaling = lora
    return (weight.float() + (B.float() @ A.float()) * scaling).to(weight.dtype), bias


@dataclass(frozen=True)
class Projections:
    """How decode_step computes one layer's attention projections. base: (weight, bias) of q_proj, k_proj, v_proj,
    o_proj for F.linear (merged copies under LORA="merged"), or None: call the four modules themselves (PEFT's
    forward); qkv, o: their LoRA parts added after the base products (None: no adapter)."""

    base: tuple | None
    qkv: LowRank | None = None
    o: LowRank | None = None


def attention_projections(lm, lora: str = "peft", autocast: torch.dtype | None = None) -> list[Projections]:
    """Per layer, how decode_step computes the attention projections (taken anew each generate call: the adapter
    trains between calls). lora="peft": the base products then the adapter's output added as PEFT's forward does in
    the trainer (LowRank; computed in `autocast`'s dtype when the trainer trains under autocast); "merged": the
    adapter merged into bf16 copies of the weights (merged_linear). A layer whose projections lora_parts cannot
    take (or whose q, k, v scalings differ) calls the modules."""
    if lora not in ("peft", "merged"):
        raise ValueError(f"graph_decode: lora must be 'peft' or 'merged', got {lora!r}")
    names = ("q_proj", "k_proj", "v_proj", "o_proj")
    layers = []
    for layer in lm.model.layers:
        modules = [getattr(layer.self_attn, name) for name in names]
        if lora == "merged":
            merged = [merged_linear(m) for m in modules]
            layers.append(Projections(base=None if any(m is None for m in merged) else tuple(merged)))
            continue
        parts = [lora_parts(m) for m in modules]
        qkv = [p[2] for p in parts[:3] if p is not None and p[2] is not None]
        if any(p is None for p in parts) or len(qkv) not in (0, 3) or len({s for _, _, s in qkv}) > 1:
            layers.append(Projections(base=None))
            continue
        dtype = autocast or (qkv[0][0].dtype if qkv else None)
        o = parts[3][2]
        layers.append(Projections(base=tuple((w, b) for w, b, _ in parts),
                                  qkv=low_rank(qkv, dtype) if qkv else None,
                                  o=low_rank([o], autocast or o[0].dtype) if o is not None else None))
    return layers


@dataclass(frozen=True)
class DecodeWeights:
    """What decode_step computes from besides the model's modules (None: the modules themselves):
    experts: per layer, the MXFP4 copy of the layer's experts (mxfp4_decode.PackedExperts; see expert_packs);
    attention: per layer, the attention projections (Projections; see attention_projections);
    autocast: the dtype the trainer's forward runs under autocast in (bf16 on GPUs; None: no autocast): the decode
    step runs under the same autocast, so every op the trainer's autocast casts is cast here too."""

    experts: list | None = None
    attention: list | None = None
    autocast: torch.dtype | None = None


def _add_lora(outputs, lora: LowRank | None, x: torch.Tensor):
    """PEFT's `result = (result + lora_B(lora_A(x)) * scaling).to(result.dtype)` for each output."""
    if lora is None:
        return outputs
    return [(out + extra).to(out.dtype) for out, extra in zip(outputs, lora(x), strict=True)]


def qkv_projections(attn, projections: Projections | None, x: torch.Tensor):
    """q_proj, k_proj, v_proj of x as decode_step computes them (see Projections)."""
    if projections is None or projections.base is None:
        return attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    linear = torch.nn.functional.linear
    return _add_lora([linear(x, *projections.base[i]) for i in range(3)], projections.qkv, x)


def output_projection(attn, projections: Projections | None, x: torch.Tensor):
    """o_proj of x as decode_step computes it (see Projections)."""
    if projections is None or projections.base is None:
        return attn.o_proj(x)
    return _add_lora([torch.nn.functional.linear(x, *projections.base[3])], projections.o, x)[0]


def head_logits(lm, hidden: torch.Tensor) -> torch.Tensor:
    """float32 logits [..., vocab] of the final hidden states, as TRL 1.16's fused LM head computes them for the loss
    (trl/kernels/chunked_logprob.py, _addmm_fp32): on CUDA the bf16 hidden states times the bf16 head with the
    float32 sums kept (`out_dtype=torch.float32`, outside autocast's reach), never rounded to bf16; elsewhere float32
    operands, under whatever autocast the caller runs (TRL's runs under the trainer's: on a CPU under bf16 autocast
    that rounds to bf16, as measured against TRL's head). The model's own lm_head rounds every logit to bf16 first:
    steps of 1/8 to 1/4 at logits of 16 to 64, an error in every token's log-probability on GPUs."""
    head = lm.get_output_embeddings()
    weight, bias = head.weight, head.bias
    half = hidden.dtype in (torch.bfloat16, torch.float16) and weight.dtype == hidden.dtype
    if hidden.device.type == "cuda" and half:
        logits = torch.mm(hidden.reshape(-1, hidden.shape[-1]), weight.t(), out_dtype=torch.float32)
        logits = logits.view(*hidden.shape[:-1], -1)
    else:
        logits = torch.nn.functional.linear(hidden.float(), weight.float()).float()
    return logits if bias is None else logits + bias.float()


def autocast_context(device: torch.device, dtype: torch.dtype | None):
    """torch.autocast(device, dtype) as the trainer runs its forward, or no context for None. The weight-cast cache
    is off: a cast cached while warming up would live outside a captured graph's memory pool."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype, cache_enabled=False)


_COMPILED_ATTENTION: list = []


def attention_function(like: torch.Tensor):
    """The one-query attention to use on like's device: on CUDA flex_one_query_attention, its flex kernel compiled
    (once: the cache length is marked dynamic, so every bucket shares one kernel set) and its sink step eager, as the
    training forward's; elsewhere one_query_attention, eagerly.

    Why: one_query_attention's scores for 64 sequences x 64 heads x the cache length go through memory several times
    (float32, + mask, the sink column, max, softmax, bf16), eagerly and still when compiled; flex attention's
    decoding kernel reads the cache once and keeps the scores on chip (BENCHMARKS.md, "Speed at the recipe, fourth
    session", times both; the eager sink step adds ~6 small kernels a layer). CPUs run it eagerly:
    torch 2.13's inductor compiles flex attention on CPUs for inference only, without the log-sum-exp the sink needs
    (and the CPU trains with eager attention, which one_query_attention mirrors). Both follow the training forward's
    attention of their device: flex attention's float32 scores on GPUs, eager attention on CPUs.
    """
    if like.device.type != "cuda":
        return one_query_attention
    if not _COMPILED_ATTENTION:
        _COMPILED_ATTENTION.append(functools.partial(flex_one_query_attention,
                                                     kernel=torch.compile(flex_decode_kernel, fullgraph=True)))
    return _COMPILED_ATTENTION[0]


def decode_step(lm, cache: StaticCache, tokens: torch.Tensor, slot: torch.Tensor, length: int,
                weights: DecodeWeights | None = None) -> torch.Tensor:
    """float32 logits [B, vocab] for tokens [B, 1] written at cache slot `slot` (0-d device tensor).

    Mirrors GptOssModel/GptOssDecoderLayer.forward for one token, with the module calls kept (so the experts
    implementation applies) and attention replaced by attention_function's one-query attention over the static cache.
    weights: the MXFP4 experts, the attention projections (the base products, then LoRA added in PEFT's order) and
    the trainer's autocast (DecodeWeights); the logits come from head_logits, as the trainer's fused head computes
    them. Everything is a device operation on fixed shapes: no host reads, so it can be captured as a CUDA graph.
    """
    weights = weights or DecodeWeights()
    with autocast_context(tokens.device, weights.autocast):
        return head_logits(lm, _decode_hidden(lm, cache, tokens, slot, length, weights))[:, -1]


def _decode_hidden(lm, cache: StaticCache, tokens, slot, length: int, weights: DecodeWeights) -> torch.Tensor:
    from transformers.models.gpt_oss.modeling_gpt_oss import apply_rotary_pos_emb

    packs, attention = weights.experts, weights.attention
    body = lm.model
    hidden = body.embed_tokens(tokens)
    cos, sin = body.rotary_emb(hidden, slot.view(1, 1))  # the trainer's position of this token: its column (prefill)
    full_mask, ring_mask = cache.masks(slot, length)
    batch = tokens.shape[0]
    if packs is not None:
        from tes_grpo.mxfp4_decode import moe_forward
    attend = attention_function(hidden)
    for i, layer in enumerate(body.layers):
        attn = layer.self_attn
        residual = hidden
        x = layer.input_layernorm(hidden)
        projections = attention[i] if attention is not None else None
        query, key, value = (t.view(batch, 1, -1, attn.head_dim).transpose(1, 2)
                             for t in qkv_projections(attn, projections, x))
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        keys, values = cache.write(i, slot, key, value, length)
        mask = ring_mask if cache.sliding[i] else full_mask
        for t, dim in ((keys, 2), (values, 2), (mask, 1)):
            torch._dynamo.maybe_mark_dynamic(t, dim)  # the cache length: one compiled kernel set for all buckets
        attended = attend(query, keys, values, mask, attn.sinks, attn.scaling)
        hidden = residual + output_projection(attn, projections, attended)
        residual = hidden
        x = layer.post_attention_layernorm(hidden)
        if packs is not None and packs[i] is not None:
            out = moe_forward(layer.mlp, packs[i], x)
        else:
            out = layer.mlp(x)
        hidden = residual + (out[0] if isinstance(out, tuple) else out)
    return body.norm(hidden)


_WARM_UP_STREAMS: dict = {}


def warm_up_stream(device) -> torch.cuda.Stream:
    """One side stream per device for the warm-up steps, reused: cuBLAS keeps a workspace per (handle, stream) until
    the process ends, so a fresh stream per capture would pin more GPU memory with every generate call."""
    key = torch.device(device).index
    if key not in _WARM_UP_STREAMS:
        _WARM_UP_STREAMS[key] = torch.cuda.Stream(device=device)
    return _WARM_UP_STREAMS[key]


class DecodeGraphs:
    """decode_step captured as CUDA graphs, one per cache-length bucket, sharing one memory pool.

    Inputs go through two static tensors (the token ids and the slot); the first step of each bucket runs eagerly
    (as warm-up, and for real: it writes the same cache slot the replays would) and is then captured.
    """

    def __init__(self, lm, cache: StaticCache, batch: int, device, weights: DecodeWeights | None = None):
        self.lm, self.cache, self.weights = lm, cache, weights
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.slot = torch.zeros((), dtype=torch.long, device=device)
        self.graphs: dict[int, tuple] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, tokens: torch.Tensor, slot: int) -> torch.Tensor:
        length = bucket_length(slot, self.cache.total)
        self.tokens.copy_(tokens.view(-1, 1))
        self.slot.fill_(slot)
        if length in self.graphs:
            graph, logits = self.graphs[length]
            graph.replay()
            return logits
        side = warm_up_stream(self.tokens.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            logits = decode_step(self.lm, self.cache, self.tokens, self.slot, length, self.weights)
        torch.cuda.current_stream().wait_stream(side)
        logits.record_stream(torch.cuda.current_stream())  # made on the side stream, read on this one
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            captured = decode_step(self.lm, self.cache, self.tokens, self.slot, length, self.weights)
        self.graphs[length] = (graph, captured)
        return logits


class EagerSteps:
    """decode_step run directly (CPU, or CUDA with graphs off): the same arithmetic as DecodeGraphs."""

    def __init__(self, lm, cache: StaticCache, device, weights: DecodeWeights | None = None):
        self.lm, self.cache, self.weights = lm, cache, weights
        self.slot = torch.zeros((), dtype=torch.long, device=device)

    def __call__(self, tokens: torch.Tensor, slot: int) -> torch.Tensor:
        self.slot.fill_(slot)
        return decode_step(self.lm, self.cache, tokens.view(-1, 1), self.slot, bucket_length(slot, self.cache.total),
                           self.weights)


@contextlib.contextmanager
def checkpointing_off(lm):
    """Switches the layers' gradient checkpointing off for a forward and back on after (exactly as it was).

    A checkpointed layer in train mode runs without the KV cache (transformers sets past_key_values=None), which would
    leave nothing to decode from. TRL already switches it off around generate(); this covers other callers."""
    layers = [m for m in lm.modules() if getattr(m, "gradient_checkpointing", False) is True]
    for layer in layers:
        layer.gradient_checkpointing = False
    try:
        yield
    finally:
        for layer in layers:
            layer.gradient_checkpointing = True


def prefill(lm, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int, pad_id: int | None = None,
            share_prompts: bool | None = None, bucket: int | None = None, autocast: torch.dtype | None = None):
    """The prompt through the model's own forward; returns the last position's float32 logits [B, vocab] and the
    filled StaticCache. Positions are the columns of the batch as given (see the module docstring: the trainer's).

    The forward is the model body's (GptOssModel, PEFT's LoRA layers included), under the trainer's autocast when
    `autocast` names its dtype, and the logits come from head_logits: the trainer's arithmetic, as in decode_step.
    For the forward only, the prompt is left-padded to prefill_length (bucket, default PREFILL_BUCKET_TOKENS) with
    pad_id (default the model's pad token) and masked, and identical rows are prefilled once when share_prompts
    (default SHARE_PROMPTS); the cache holds the prompt as given (the extra slots were masked padding).
    """
    from transformers import DynamicCache

    share = SHARE_PROMPTS if share_prompts is None else share_prompts
    if pad_id is None:
        pad_id = lm.config.pad_token_id if lm.config.pad_token_id is not None else 0
    ids, mask = left_pad(input_ids, attention_mask, prefill_length(input_ids.shape[1], bucket), pad_id)
    plan = shared_prefill_rows(ids, mask) if share else None
    run_ids, run_mask = (ids, mask) if plan is None else (ids[plan[0]], mask[plan[0]])
    dynamic = DynamicCache(config=lm.config)
    extra = run_ids.shape[1] - input_ids.shape[1]  # bucket padding: not a column of the batch TRL trains on
    positions = (torch.arange(run_ids.shape[1], device=run_ids.device) - extra).clamp(min=0).expand(len(run_ids), -1)
    with checkpointing_off(lm), autocast_context(input_ids.device, autocast):
        out = lm.model(input_ids=run_ids, attention_mask=run_mask, position_ids=positions, past_key_values=dynamic,
                       use_cache=True)
        logits = head_logits(lm, out.last_hidden_state[:, -1])
    source = None if plan is None else plan[1]
    filled = [layer.keys for layer in getattr(dynamic, "layers", []) if getattr(layer, "keys", None) is not None]
    if not filled:
        raise RuntimeError("graph_decode: the prefill filled no KV cache (a layer ran without one)")
    cache = StaticCache(lm.config, attention_mask, max_new_tokens, dtype=filled[0].dtype)
    cache.fill(dynamic, source)
    return (logits if source is None else logits.index_select(0, source)), cache


def decode_steps(lm, cache: StaticCache, batch: int, device, graphs: bool | None,
                 weights: DecodeWeights | None = None):
    """The decode-step runner: CUDA graphs if `graphs` (default: when on CUDA), else eager steps."""
    if graphs is None:
        graphs = device.type == "cuda"
    return DecodeGraphs(lm, cache, batch, device, weights) if graphs else EagerSteps(lm, cache, device, weights)


def expert_packs(lm, experts: str, say=print) -> list | None:
    """experts="mxfp4": each layer's MXFP4 copy of its experts (mxfp4_decode.pack_model; packed once, kept while the
    weights stay as they are; None for a layer that cannot be packed); "model": None (the model's own MLP)."""
    if experts == "model":
        return None
    if experts != "mxfp4":
        raise ValueError(f"graph_decode: experts must be 'model' or 'mxfp4', got {experts!r}")
    from tes_grpo.mxfp4_decode import pack_model

    return pack_model(lm.model.layers, say=say)


def decode_weights(lm, experts: str = "model", lora: str = "peft", autocast: torch.dtype | None = None,
                   say=print) -> DecodeWeights:
    """The DecodeWeights of one generate call: experts (expert_packs), attention projections (attention_projections:
    lora "peft" or "merged") and the trainer's autocast dtype (None: the trainer runs without autocast)."""
    return DecodeWeights(expert_packs(lm, experts, say), attention_projections(lm, lora, autocast), autocast)


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, generation_config,
             graphs: bool | None = None, share_prompts: bool | None = None, prefill_bucket: int | None = None,
             experts: str = "model", say=print, lora: str = "peft", autocast: torch.dtype | None = None,
             logprobs: bool = False):
    """Prompt + sampled completion ids [B, prompt + n], as transformers' generate() returns them (n <= max_new_tokens;
    finished rows padded with pad_token_id; stops when every row has emitted an end token). logprobs=True: also the
    log-probability [B, n] (float32) of each sampled token under the distribution it was drawn from (log_softmax of
    the warped scores at the chosen token; 0 after a row's end), returned as (ids, logprobs).

    graphs: replay CUDA graphs (default: when the model is on CUDA; on CPU the steps run eagerly); whether this model
    can be captured is checked once, when the caller installs the path (auto_decode_graphs). share_prompts,
    prefill_bucket: see prefill (defaults SHARE_PROMPTS, PREFILL_BUCKET_TOKENS). experts: "model" (the model's MLP) or
    "mxfp4" (see expert_packs; what cannot be packed is said through `say`). lora: "peft" (the adapter added to the
    base products as PEFT's forward does) or "merged" (see attention_projections). autocast: the dtype the trainer's
    forward runs under autocast in (decode_step). The random numbers drawn are generate()'s: one torch.multinomial
    over all rows per step, nothing in the prefill.
    """
    lm = causal_lm(model)
    device = input_ids.device
    batch, prompt_len = input_ids.shape
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    g = generation_config
    max_new = g.max_new_tokens if g.max_new_tokens is not None else g.max_length - prompt_len
    eos = g.eos_token_id if isinstance(g.eos_token_id, (list, tuple)) else [g.eos_token_id]
    eos = torch.tensor([e for e in eos if e is not None], dtype=torch.long, device=device)
    pad = g.pad_token_id if g.pad_token_id is not None else int(eos[0])
    warpers = logits_warpers(g)
    weights = decode_weights(lm, experts, lora, autocast, say)
    logits, cache = prefill(lm, input_ids, attention_mask, max_new, pad, share_prompts, prefill_bucket, autocast)
    step = decode_steps(lm, cache, batch, device, graphs, weights)
    unfinished = torch.ones(batch, dtype=torch.long, device=device)
    new_tokens, new_logprobs = [], []
    for n in range(max_new):
        scores = warpers(input_ids, logits)
        if g.do_sample:
            chosen = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        else:
            chosen = scores.argmax(dim=-1)
        if logprobs:
            picked = scores.gather(1, chosen[:, None]).squeeze(1) - torch.logsumexp(scores, dim=-1)
            new_logprobs.append(picked * unfinished)
        chosen = chosen * unfinished + pad * (1 - unfinished)
        new_tokens.append(chosen)
        unfinished = unfinished & ~torch.isin(chosen, eos)
        if n + 1 == max_new or unfinished.max() == 0:
            break
        logits = step(chosen, prompt_len + n)
    ids = torch.cat([input_ids, torch.stack(new_tokens, dim=1)], dim=1)
    return (ids, torch.stack(new_logprobs, dim=1)) if logprobs else ids


def graph_blockers(model) -> list[str]:
    """Why decode steps of this model could not be captured as CUDA graphs ([] = none known)."""
    experts = getattr(causal_lm(model).config, "_experts_implementation", None)
    if experts not in ("grouped_mm", "batched_mm"):
        return [f"experts_implementation={experts!r} (only grouped_mm and batched_mm are known to read nothing on the "
                "host; eager loops over the experts hit)"]
    return []


def model_blockers(model) -> list[str]:
    """Why this path cannot decode this model at all ([] = it can): it is written for gpt-oss on transformers 5."""
    import transformers

    reasons = []
    model_type = getattr(causal_lm(model).config, "model_type", None)
    if model_type != "gpt_oss":
        reasons.append(f"model_type={model_type!r} (graph_decode's decode step is gpt-oss's)")
    if int(transformers.__version__.split(".")[0]) < 5:
        reasons.append(f"transformers {transformers.__version__} (needs >= 5: DynamicCache.layers)")
    return reasons


def state_blockers(model, training: bool | None = None) -> list[str]:
    """What in the model's state would make this path sample differently from generate() ([] = nothing): dropout
    that train mode leaves on (TRL generates in train mode; gpt-oss and train_grpo's LoRA have none). training: judge
    as if every module were in that mode (None = as each one is now)."""
    lm = causal_lm(model)
    reasons = []
    if (lm.training if training is None else training) and getattr(lm.config, "attention_dropout", 0.0):
        reasons.append(f"attention_dropout={lm.config.attention_dropout} in train mode")
    dropout = sorted({m.p for m in lm.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0
                      and (m.training if training is None else training)})
    if dropout:
        reasons.append(f"dropout p={dropout} in train mode")
    return reasons


def auto_decode_graphs(model, cuda: bool | None = None, sharded: bool = False) -> tuple[bool, str]:
    """What DECODE_GRAPHS="auto" means for this model: (on, why), `why` fit for a log line. The one check of the
    model, its state and its capturability: GraphDecodeGenerate does not repeat it on each call.

    On when the model is on CUDA (default: torch.cuda.is_available()), not sharded by FSDP, has no dropout in train
    mode (GRPO generates in it) and nothing blocks capturing its decode steps; the reason names what turned it off.
    Call it after the trainer wrapped the model (LoRA) and decided on FSDP; vLLM (the other way to generate) is the
    caller's to exclude.
    """
    if cuda is None:
        cuda = torch.cuda.is_available()
    reasons = [] if cuda else ["no CUDA device (on CPU the decode steps would run eagerly, without graphs)"]
    if sharded:
        reasons.append("FSDP shards the weights (a captured step cannot gather them)")
    reasons += model_blockers(model) + state_blockers(model, training=True) + (graph_blockers(model) if cuda else [])
    if reasons:
        return False, "off: " + "; ".join(reasons)
    return True, "on: CUDA, gpt-oss with capturable experts, not sharded"


def first_end_token(generation_config) -> int:
    eos = generation_config.eos_token_id
    return eos[0] if isinstance(eos, (list, tuple)) else eos


def joined_rows(parts: list[torch.Tensor], fill) -> torch.Tensor:
    """The row blocks of consecutive generate calls as one batch: each right-padded with `fill` to the longest (a
    call stops when all its rows ended, so calls return different lengths; generate() pads a finished row alike)."""
    if len(parts) == 1:
        return parts[0]
    width = max(p.shape[1] for p in parts)
    return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1]), value=fill) for p in parts])


class GraphDecodeGenerate:
    """Stands in for a model's generate(): graph_decode.generate for the calls it supports, transformers' own for
    the others (said once per reason). Whether the model itself can take this path is the installer's check
    (auto_decode_graphs), made once; each call checks only its options (unsupported_options).

    Settable after construction: experts ("model" or "mxfp4", see generate), lora ("peft" or "merged"), autocast (the
    trainer's autocast dtype; sampling_fidelity.install sets it from the trainer's mixed precision), max_batch (rows
    a generate call takes at most: a larger batch is generated in consecutive calls of that many rows, as the memory
    plan allows; None = all at once). A
    logits_processor of sampling_fidelity.SampledLogprobs recorders is served here: each gets the sampled tokens'
    log-probabilities; any other processor sends the call to transformers' generate.
    """

    def __init__(self, model, original, say=print, experts: str = "model"):
        self.model, self.original, self.say, self.experts = model, original, say, experts
        self.lora: str = "peft"
        self.autocast: torch.dtype | None = None
        self.max_batch: int | None = None
        self.reported: set[str] = set()

    def __call__(self, input_ids=None, attention_mask=None, generation_config=None, logits_processor=None, **kwargs):
        from tes_grpo.sampling_fidelity import SampledLogprobs

        config = generation_config if generation_config is not None else self.model.generation_config
        recorders = [p for p in logits_processor or () if isinstance(p, SampledLogprobs)]
        others = [p for p in logits_processor or () if not isinstance(p, SampledLogprobs)]
        reasons = unsupported_options(config, {**kwargs, "logits_processor": others or None})
        if input_ids is None:
            reasons.append("no input_ids")
        if reasons:
            text = ", ".join(reasons)
            if text not in self.reported:
                self.reported.add(text)
                self.say(f"DECODE_GRAPHS: this generate call uses transformers' generate ({text} not supported)")
            if logits_processor is not None:
                kwargs["logits_processor"] = logits_processor
            return self.original(input_ids=input_ids, attention_mask=attention_mask,
                                 generation_config=generation_config, **kwargs)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        size = self.max_batch or input_ids.shape[0]
        parts = [generate(self.model, input_ids[i:i + size], attention_mask[i:i + size], config, experts=self.experts,
                          say=self.say, lora=self.lora, autocast=self.autocast, logprobs=bool(recorders))
                 for i in range(0, input_ids.shape[0], size)]
        pad = config.pad_token_id if config.pad_token_id is not None else first_end_token(config)
        if not recorders:
            return joined_rows(parts, pad)
        logprobs = joined_rows([p[1] for p in parts], 0.0)
        for recorder in recorders:
            recorder.record(logprobs)
        return joined_rows([p[0] for p in parts], pad)
