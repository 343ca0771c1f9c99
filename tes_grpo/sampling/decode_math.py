"""The decode step's math: one new token through gpt-oss, in the trainer's arithmetic (used by graph_decode.py).

`decode_step` mirrors GptOssModel's forward for one token per row over a static KV cache (decode_cache.StaticCache):
the layers' own modules (router; the experts as the model has them, or mxfp4_decode's MXFP4 kernel), the
attention projections as the base products with the LoRA adapter's output added in PEFT's order (`LowRank`: one
low-rank product for q, k and v), one-query attention with gpt-oss's sinks (`attention_function`: decode_attention.py's
Triton kernel on CUDA, `one_query_attention` elsewhere) and the logits as TRL's fused LM head computes them
(`head_logits`). The small steps between the products (residual adds and norms, rotary embedding, the sink step,
the LoRA adds) are decode_glue's functions, run eagerly or (DECODE_GLUE=compiled) compiled on CUDA with the
trainer's roundings. `DecodeWeights` says what a step computes from besides the modules; `decode_weights` builds it
once per generate call (the adapter trains between calls). Every operation is on the device with fixed shapes, so
the step can be captured as a CUDA graph.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import AuxRequest, flex_attention

from tes_grpo.layers.decode_glue import EAGER, Glue, glue_for, with_sinks
from tes_grpo.layers.lora import LowRank, lora_parts, low_rank, merged_linear


def one_query_attention(query, keys, values, mask, sinks, scaling: float, seen=None) -> torch.Tensor:
    """gpt-oss attention for one new token, step for step as transformers 5.17-5.24's eager attention computes it
    (modeling_gpt_oss.eager_attention_forward, the training forward's attention on CPUs): softmax over the keys plus
    each head's sink logit (which takes probability mass but has no value). query [B, H, 1, D]; keys/values
    [B, KV, L, D]; mask [B, L] additive (float32).

    Query heads are grouped onto their key/value head by a reshape (no repeat_kv copy of the cache). Every step is in
    the model's dtype, as eager attention rounds it: the scores out of the matmul, x scaling, + the mask (clamped to
    the dtype's minimum, eager's masked value), the sink column, minus the row maximum, the softmax (float32 inside,
    rounded), x values. In float32 that is the plain arithmetic; in bf16 it gives the eager training forward's
    roundings, not a more exact attention than the trainer computes. Returns [B, 1, H * D]. seen: how many leading
    slots any row may see (a 0-d tensor) or None; the mask already masks the rest, so it is not needed here (the
    GPU's kernel uses it to skip reading them).
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


def flex_decode_kernel(query, keys, values, mask, scaling: float, seen=None, kernel_options: dict | None = None):
    """flex attention for one query, without the sinks: (output [B, H, 1, D] in the query's dtype, float32 log-sum-exp
    [B, H, 1]). On CUDA, compiled, it is flex attention's split-KV decoding kernel, which reads each key and value once
    and keeps the scores (float32) on chip; what decoded before decode_attention.attention, kept to time against it
    (benchmarks/bench_decode_attention.py). The mask [B, L] is added as a score_mod; it reads every slot (seen, the
    slots any row may see, is not used: the mask masks the rest).

    kernel_options: flex attention's, passed on; among them SPLIT_KV, into how many parts the decoding kernel cuts each
    sequence's keys for each key-value head, the parts read in parallel and combined after (read by inductor's
    flex decoding lowering in torch 2.11 and 2.13, though not listed in FlexKernelOptions). Without it flex attention
    gives (SMs // (B x key-value heads)) x 2 parts, at least one: a single part once B x key-value heads exceed the
    SMs."""
    def add_mask(score, batch, head, q_index, kv_index):
        return score + mask[batch, kv_index]

    out, aux = flex_attention(query, keys, values, score_mod=add_mask, scale=scaling, enable_gqa=True,
                              return_aux=AuxRequest(lse=True), kernel_options=kernel_options)
    return out, aux.lse


def attention_with_sinks(query, keys, values, mask, sinks, scaling: float, seen=None, kernel=flex_decode_kernel,
                         sink_step=with_sinks):
    """one_query_attention as the GPU trains with it (flex attention's float32 scores): `kernel`'s attention without
    the sinks (decode_attention.attention, or flex_decode_kernel compiled: see attention_function), then the sinks
    as the training forward applies them (`sink_step`: decode_glue.with_sinks, eager or compiled with the trainer's
    roundings: see decode_glue). Same arguments and result as one_query_attention."""
    out, lse = kernel(query, keys, values, mask, scaling, seen)
    batch, heads, _, dim = query.shape
    return sink_step(out, lse, sinks).to(query.dtype).transpose(1, 2).reshape(batch, 1, heads * dim)


@dataclass(frozen=True)
class Projections:
    """How decode_step computes one layer's attention projections. base: (weight, bias) of q_proj, k_proj, v_proj,
    o_proj for F.linear (merged copies under LORA="merged"), or None: call the four modules themselves (PEFT's
    forward); qkv, o: their LoRA parts added after the base products (None: no adapter); linear: None (cuBLAS's
    products: F.linear, then LowRank's and the add), or decode_linear.linear, which computes the same roundings with
    the base products, their bias and the adapter's output in one kernel a call (q, k and v in one, qkv_bias their
    biases one after another; see projection_linear)."""

    base: tuple | None
    qkv: LowRank | None = None
    o: LowRank | None = None
    linear: Callable | None = None
    qkv_bias: torch.Tensor | None = None


PROJECTION_KERNELS = ("triton", "cublas")  # the GPU's attention projections: decode_linear.py's kernel, or cuBLAS's


def projection_kernel_blocker(device_type: str, autocast: torch.dtype | None, kernel: str = "triton") -> str | None:
    """Why decode_linear's kernel cannot compute a run's attention projections, or None: it computes those of every
    layer whose weights, biases and adapter are bf16 (projection_parts_fit). It takes bf16 products on CUDA, so the
    trainer's autocast, if any, must be bf16 (under fp16 autocast the trainer's products are fp16)."""
    if kernel != "triton":
        return f"the projection kernel {kernel!r} chosen"
    if device_type != "cuda":
        return "no GPU"
    if autocast not in (None, torch.bfloat16):
        return f"autocast {autocast}, not bf16"
    return None


def projection_parts_fit(parts: list, autocast: torch.dtype | None) -> bool:
    """Whether one layer's (weight, bias, lora) parts (lora_parts' of q, k, v, o) are what decode_linear takes: the
    weights bf16 and contiguous, the biases all bf16 or all absent, each adapter computed in bf16 (under the trainer's
    bf16 autocast, or its factors bf16 without autocast)."""
    weights = [w for w, _, _ in parts]
    biases = [b for _, b, _ in parts]
    adapters = {autocast or lora[0].dtype for _, _, lora in parts if lora is not None}
    return (adapters <= {torch.bfloat16}
            and all(w.dtype == torch.bfloat16 and w.is_contiguous() for w in weights)
            and all((b is None) == (biases[0] is None) and (b is None or b.dtype == torch.bfloat16) for b in biases))


def projection_linear(parts: list, autocast: torch.dtype | None, kernel: str = "triton") -> Callable | None:
    """decode_linear.linear for one layer's parts when projection_kernel_blocker has nothing against the run and
    projection_parts_fit; None (F.linear, LowRank and the add: cuBLAS's products on a GPU) otherwise."""
    if (projection_kernel_blocker(parts[0][0].device.type, autocast, kernel) is not None
            or not projection_parts_fit(parts, autocast)):
        return None
    from tes_grpo.sampling import decode_linear  # Triton: only where a GPU decodes

    return decode_linear.linear


def attention_projections(lm, lora: str = "peft", autocast: torch.dtype | None = None,
                          kernel: str = "triton") -> list[Projections]:
    """Per layer, how decode_step computes the attention projections (taken anew each generate call: the adapter
    trains between calls). lora="peft": the base products then the adapter's output added as PEFT's forward does in
    the trainer (LowRank; computed in `autocast`'s dtype when the trainer trains under autocast), on CUDA by
    decode_linear.py's kernel unless kernel="cublas" (projection_linear); "merged": the adapter merged into bf16
    copies of the weights (merged_linear). A layer whose projections lora_parts cannot take (or whose q, k, v
    scalings differ) calls the modules."""
    if lora not in ("peft", "merged"):
        raise ValueError(f"graph_decode: lora must be 'peft' or 'merged', got {lora!r}")
    if kernel not in PROJECTION_KERNELS:
        raise ValueError(f"graph_decode: the projection kernel must be one of {PROJECTION_KERNELS}, got {kernel!r}")
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
        linear = projection_linear(parts, autocast, kernel)
        biases = [b for _, b, _ in parts[:3]]
        layers.append(Projections(base=tuple((w, b) for w, b, _ in parts),
                                  qkv=low_rank(qkv, dtype) if qkv else None,
                                  o=low_rank([o], autocast or o[0].dtype) if o is not None else None,
                                  linear=linear,
                                  qkv_bias=torch.cat(biases) if linear is not None and biases[0] is not None else None))
    return layers


@dataclass(frozen=True)
class DecodeWeights:
    """What decode_step computes from besides the model's modules (None: the modules themselves):
    experts: per layer, the MXFP4 copy of the layer's experts (mxfp4_decode.PackedExperts; see expert_packs);
    attention: per layer, the attention projections (Projections; see attention_projections);
    autocast: the dtype the trainer's forward runs under autocast in (bf16 on GPUs; None: no autocast): the decode
    step runs under the same autocast, so every op the trainer's autocast casts is cast here too;
    glue: how the step's norms, residual adds, rotary embedding, sink step and LoRA adds run (decode_glue.Glue:
    eager, or compiled on CUDA with DECODE_GLUE=compiled; see decode_glue.glue_for);
    attention_kernel: the GPU's attention kernel (attention_function: "triton", or "flex" to time against it)."""

    experts: list | None = None
    attention: list | None = None
    autocast: torch.dtype | None = None
    glue: Glue = EAGER
    attention_kernel: str = "triton"


def _add_lora(outputs, lora: LowRank | None, x: torch.Tensor, glue: Glue):
    """PEFT's `result = (result + lora_B(lora_A(x)) * scaling).to(result.dtype)` for each output (decode_glue)."""
    if lora is None:
        return outputs
    return glue.add_lora(outputs, list(lora(x)))


def _factors(lora: LowRank | None):
    return None if lora is None else (lora.a, lora.b, lora.scale)


def qkv_projections(attn, projections: Projections | None, x: torch.Tensor, glue: Glue = EAGER):
    """q_proj, k_proj, v_proj of x as decode_step computes them (see Projections)."""
    if projections is None or projections.base is None:
        return attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    if projections.linear is not None:
        weights = [w for w, _ in projections.base[:3]]
        out = projections.linear(x, weights, projections.qkv_bias, _factors(projections.qkv))
        return out.split([w.shape[0] for w in weights], dim=-1)
    linear = torch.nn.functional.linear
    return _add_lora([linear(x, *projections.base[i]) for i in range(3)], projections.qkv, x, glue)


def output_projection(attn, projections: Projections | None, x: torch.Tensor, glue: Glue = EAGER):
    """o_proj of x as decode_step computes it (see Projections)."""
    if projections is None or projections.base is None:
        return attn.o_proj(x)
    if projections.linear is not None:
        weight, bias = projections.base[3]
        return projections.linear(x, [weight], bias, _factors(projections.o))
    return _add_lora([torch.nn.functional.linear(x, *projections.base[3])], projections.o, x, glue)[0]


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


ATTENTION_KERNELS = ("triton", "flex")  # the GPU's decode attention: decode_attention.py's kernel, or flex attention's
_COMPILED_ATTENTION: list = []


def attention_function(like: torch.Tensor, glue: Glue = EAGER, kernel: str = "triton"):
    """The one-query attention to use on like's device: on CUDA attention_with_sinks with its sink step glue's
    (decode_glue.with_sinks, as the training forward applies the sinks) and, as kernel, decode_attention.attention
    (kernel "triton") or flex_decode_kernel compiled (kernel "flex": once; the cache length is marked dynamic, so every
    bucket shares one kernel set); elsewhere one_query_attention, eagerly, whatever `kernel` says.

    Why: one_query_attention's scores for 64 sequences x 64 heads x the cache length go through memory several times
    (float32, + mask, the sink column, max, softmax, bf16), eagerly and still when compiled; a decoding kernel reads
    the cache once and keeps the scores on chip; decode_attention's reads only the slots the token may see, faster
    than flex attention's (BENCHMARKS.md times them). CPUs run it eagerly: torch 2.13's inductor compiles flex
    attention on CPUs for inference only, without the log-sum-exp the sink needs (and the CPU trains with eager
    attention, which one_query_attention mirrors). Both follow the training forward's attention of their device:
    flex attention's float32 scores on GPUs, eager attention on CPUs.
    """
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(f"graph_decode: the attention kernel must be one of {ATTENTION_KERNELS}, got {kernel!r}")
    if like.device.type != "cuda":
        return one_query_attention
    if kernel == "triton":
        from tes_grpo.sampling import decode_attention  # Triton: only where a GPU decodes

        return functools.partial(attention_with_sinks, kernel=decode_attention.attention, sink_step=glue.with_sinks)
    if not _COMPILED_ATTENTION:
        _COMPILED_ATTENTION.append(torch.compile(flex_decode_kernel, fullgraph=True))
    return functools.partial(attention_with_sinks, kernel=_COMPILED_ATTENTION[0], sink_step=glue.with_sinks)


def decode_step(lm, cache, tokens: torch.Tensor, slot: torch.Tensor, length: int,
                weights: DecodeWeights | None = None) -> torch.Tensor:
    """float32 logits [B, vocab] for tokens [B, 1] written at slot `slot` (0-d device tensor) of `cache`, a
    decode_cache.StaticCache.

    Mirrors transformers 5.17-5.24's GptOssForCausalLM/GptOssModel/GptOssDecoderLayer.forward for one token
    (_decode_hidden), with the module calls kept (so the experts implementation applies) and attention replaced by
    attention_function's one-query attention over the static cache. weights: the MXFP4 experts, the attention
    projections (the base products, then LoRA added in PEFT's order), the trainer's autocast and how the glue between
    the products runs (DecodeWeights); the logits come from head_logits, as the trainer's fused head computes them.
    Everything is a device operation on fixed shapes: no host reads, so it can be captured as a CUDA graph.
    """
    weights = weights or DecodeWeights()
    with autocast_context(tokens.device, weights.autocast):
        return head_logits(lm, _decode_hidden(lm, cache, tokens, slot, length, weights))[:, -1]


def _decode_hidden(lm, cache, tokens, slot, length: int, weights: DecodeWeights) -> torch.Tensor:
    """The final norm's output [B, 1, H] for decode_step: transformers 5.17-5.24's GptOssModel.forward,
    GptOssDecoderLayer.forward, GptOssAttention.forward (projections, rotary embedding, cache, attention, o_proj) and
    GptOssMLP.forward's output for one token, step for step."""
    packs, attention, glue = weights.experts, weights.attention, weights.glue
    body = lm.model
    layers = body.layers
    hidden = body.embed_tokens(tokens)
    cos, sin = body.rotary_emb(hidden, slot.view(1, 1))  # the trainer's position of this token: its column (prefill)
    full_mask, ring_mask = cache.masks(slot, length)
    batch = tokens.shape[0]
    if packs is not None:
        from tes_grpo.experts.mxfp4_decode import moe_forward  # Triton: only where the MXFP4 experts decode
    attend = attention_function(hidden, glue, weights.attention_kernel)
    seen = slot + 1  # the full layers' slots this token may see: the kernel reads none past them
    # each residual add is fused with the norm that reads its sum: the post-attention norm, the next layer's input
    # norm, after the last layer the final norm
    x = glue.norm(hidden, layers[0].input_layernorm)
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        projections = attention[i] if attention is not None else None
        query, key, value = (t.view(batch, 1, -1, attn.head_dim).transpose(1, 2)
                             for t in qkv_projections(attn, projections, x, glue))
        query, key = glue.rope_qk(query, key, cos, sin)
        keys, values = cache.write(i, slot, key, value, length)
        mask = ring_mask if cache.sliding[i] else full_mask
        for t, dim in ((keys, 2), (values, 2), (mask, 1)):
            torch._dynamo.maybe_mark_dynamic(t, dim)  # the cache length: one compiled kernel set for all buckets
        attended = attend(query, keys, values, mask, attn.sinks, attn.scaling,
                          None if cache.sliding[i] else seen)
        hidden, x = glue.add_norm(hidden, output_projection(attn, projections, attended, glue),
                                  layer.post_attention_layernorm)
        if packs is not None and packs[i] is not None:
            out = moe_forward(layer.mlp, packs[i], x)
        else:
            out = layer.mlp(x)
        next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else body.norm
        hidden, x = glue.add_norm(hidden, out[0] if isinstance(out, tuple) else out, next_norm)
    return x


def expert_packs(lm, experts: str, say=print) -> list | None:
    """experts="mxfp4": each layer's MXFP4 copy of its experts (mxfp4_decode.pack_model; packed once, kept while the
    weights stay as they are; None for a layer that cannot be packed); "model": None (the model's own MLP)."""
    if experts == "model":
        return None
    if experts != "mxfp4":
        raise ValueError(f"graph_decode: experts must be 'model' or 'mxfp4', got {experts!r}")
    from tes_grpo.experts import mxfp4_decode  # Triton: only where the MXFP4 experts decode

    return mxfp4_decode.pack_model(lm.model.layers, say=say)


def decode_weights(lm, experts: str = "model", lora: str = "peft", autocast: torch.dtype | None = None,
                   say=print, glue: str = "eager", attention_kernel: str = "triton",
                   projection_kernel: str = "triton") -> DecodeWeights:
    """The DecodeWeights of one generate call: experts (expert_packs), attention projections (attention_projections:
    lora "peft" or "merged", the GPU's projection kernel "triton" or "cublas"), the trainer's autocast dtype (None:
    the trainer runs without autocast), the glue (decode_glue.glue_for on the model's device: glue "eager" or
    "compiled"; said through `say` when first decided) and the GPU's attention kernel (attention_function, which
    checks it)."""
    return DecodeWeights(expert_packs(lm, experts, say), attention_projections(lm, lora, autocast, projection_kernel),
                         autocast, glue_for(lm.device, glue, say), attention_kernel)
