"""Sampling from gpt-oss with a static KV cache, each decode step replayed as one CUDA graph (issue 5).

Not a script; train_grpo.py uses it when DECODE_GRAPHS is on, and the benchmark times it against transformers':

    python bench_generate.py --NUM_SEQS=64 --NEW_TOKENS=128 --VARIANTS=grouped_mm,graphs   # on the GPU machine

Why: on an H100 a decode step of the 20B model at 64 sequences took ~69 ms through transformers' generate, of which
the GPU was busy ~15 ms; the rest was Python and ~2,400 kernel launches a step (BENCHMARKS.md, "Where a decode step
goes"). A CUDA graph replays all of a step's kernels with one launch, but only if the step has fixed shapes, fixed
buffers and never waits for the GPU. transformers' own route there (static cache + torch.compile) compiled the 20B
forward for over seven minutes and is switched off inside TRL, so this module writes the decode step itself:

- prefill: the model's own forward (flex attention on GPUs, transformers' DynamicCache), exactly as generate() does
  it, then the keys and values are copied into static buffers: one of prompt + MAX_NEW_TOKENS slots per full-attention
  layer, a ring of `sliding_window` slots per sliding-window layer;
- decode: `decode_step` runs one new token through the same modules (LoRA-wrapped projections, router, experts as
  the model has them), with attention written here for one query (sinks included, grouped-query heads without
  copies) over a fixed-length view of the cache, masks computed on the device from the current slot;
- on CUDA, `DecodeGraphs` captures decode_step once per cache-length bucket (BUCKET_TOKENS) and replays it; on CPU
  the same step runs eagerly (that is what the CPU tests compare with transformers);
- sampling follows transformers' generate for the options TRL sets (temperature, top-k, top-p, min-p with
  transformers' own warper classes; end tokens; pad after the end); `unsupported_options` names anything else, and
  the caller then uses transformers' generate (and says so).
"""

from __future__ import annotations

import torch

BUCKET_TOKENS = 512  # full-attention layers attend over the cache rounded up to this many slots (one graph each)

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
    from transformers import (LogitsProcessorList, MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper,
                              TopPLogitsWarper)

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

    def __init__(self, config, prompt_mask: torch.Tensor, max_new_tokens: int, dtype,
                 first_position: torch.Tensor | None = None):
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
        # generate()'s position of the first new token: the prompt's last position + 1 (given by prefill; the count
        # of real tokens is the same thing for left-padded prompts)
        self.first_position = prompt_mask.long().sum(-1) if first_position is None else first_position
        self.slots = torch.arange(self.total, device=device)
        self.ring_slots = torch.arange(self.window, device=device)

    def fill(self, dynamic_cache) -> None:
        """Copies a prefill's DynamicCache (transformers 5.x: .layers[i].keys/.values) into the buffers."""
        layers = getattr(dynamic_cache, "layers", None)
        if layers is None or len(layers) != len(self.keys):
            raise RuntimeError("graph_decode needs transformers' DynamicCache with one .layers entry per layer "
                               "(transformers >= 5.0)")
        for i, layer in enumerate(layers):
            keys, values = layer.keys, layer.values
            if not self.sliding[i]:
                self.keys[i][:, :, :self.prompt_len].copy_(keys)
                self.values[i][:, :, :self.prompt_len].copy_(values)
                continue
            kept = min(keys.shape[2], self.window - 1)  # the next token's own key completes the window
            positions = torch.arange(self.prompt_len - kept, self.prompt_len, device=keys.device)
            self.keys[i].index_copy_(2, positions % self.window, keys[:, :, -kept:])
            self.values[i].index_copy_(2, positions % self.window, values[:, :, -kept:])

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
    """gpt-oss attention for one new token: softmax over the keys plus each head's sink logit (which takes
    probability mass but has no value). query [B, H, 1, D]; keys/values [B, KV, L, D]; mask [B, L] additive.

    Query heads are grouped onto their key/value head by a reshape (no repeat_kv copy of the cache). The scores come
    out of the matmul in the model's dtype (bf16 on GPUs, as in transformers' eager attention; flex attention keeps
    them in float32, and `torch.bmm(..., out_dtype=torch.float32)` would too, but only on CUDA); the softmax runs in
    float32. Returns [B, 1, H * D].
    """
    batch, heads, _, dim = query.shape
    kv_heads = keys.shape[1]
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim)
    scores = torch.matmul(grouped, keys.transpose(-1, -2)).float() * scaling + mask[:, None, None, :]
    sink = sinks.float().view(1, kv_heads, heads // kv_heads, 1).expand(batch, -1, -1, -1)
    logits = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(logits - logits.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
    out = torch.matmul(probs.to(values.dtype), values)
    return out.reshape(batch, 1, heads * dim)


def decode_step(lm, cache: StaticCache, tokens: torch.Tensor, slot: torch.Tensor, length: int) -> torch.Tensor:
    """Logits [B, vocab] for tokens [B, 1] written at cache slot `slot` (0-d device tensor).

    Mirrors GptOssModel/GptOssDecoderLayer.forward for one token, with the module calls kept (so LoRA layers and the
    experts implementation apply) and attention replaced by one_query_attention over the static cache. Everything
    is a device operation on fixed shapes: no host reads, so it can be captured as a CUDA graph.
    """
    from transformers.models.gpt_oss.modeling_gpt_oss import apply_rotary_pos_emb

    body = lm.model
    hidden = body.embed_tokens(tokens)
    positions = (cache.first_position + (slot - cache.prompt_len)).unsqueeze(1)
    cos, sin = body.rotary_emb(hidden, positions)
    full_mask, ring_mask = cache.masks(slot, length)
    batch = tokens.shape[0]
    for i, layer in enumerate(body.layers):
        attn = layer.self_attn
        residual = hidden
        x = layer.input_layernorm(hidden)
        query = attn.q_proj(x).view(batch, 1, -1, attn.head_dim).transpose(1, 2)
        key = attn.k_proj(x).view(batch, 1, -1, attn.head_dim).transpose(1, 2)
        value = attn.v_proj(x).view(batch, 1, -1, attn.head_dim).transpose(1, 2)
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        keys, values = cache.write(i, slot, key, value, length)
        mask = ring_mask if cache.sliding[i] else full_mask
        hidden = residual + attn.o_proj(one_query_attention(query, keys, values, mask, attn.sinks, attn.scaling))
        residual = hidden
        out = layer.mlp(layer.post_attention_layernorm(hidden))
        hidden = residual + (out[0] if isinstance(out, tuple) else out)
    return lm.lm_head(body.norm(hidden))[:, -1]


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

    def __init__(self, lm, cache: StaticCache, batch: int, device):
        self.lm, self.cache = lm, cache
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
            logits = decode_step(self.lm, self.cache, self.tokens, self.slot, length)
        torch.cuda.current_stream().wait_stream(side)
        logits.record_stream(torch.cuda.current_stream())  # made on the side stream, read on this one
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            captured = decode_step(self.lm, self.cache, self.tokens, self.slot, length)
        self.graphs[length] = (graph, captured)
        return logits


class EagerSteps:
    """decode_step run directly (CPU, or CUDA with graphs off): the same arithmetic as DecodeGraphs."""

    def __init__(self, lm, cache: StaticCache, device):
        self.lm, self.cache = lm, cache
        self.slot = torch.zeros((), dtype=torch.long, device=device)

    def __call__(self, tokens: torch.Tensor, slot: int) -> torch.Tensor:
        self.slot.fill_(slot)
        return decode_step(self.lm, self.cache, tokens.view(-1, 1), self.slot, bucket_length(slot, self.cache.total))


def prefill(lm, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int):
    """The prompt through the model's own forward, as generate() runs it (position ids count real tokens only, so
    left padding does not shift them); returns the last position's float32 logits and the filled StaticCache."""
    from transformers import DynamicCache

    dynamic = DynamicCache(config=lm.config)
    positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
    out = lm(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, past_key_values=dynamic,
             use_cache=True, logits_to_keep=1)
    cache = StaticCache(lm.config, attention_mask, max_new_tokens, dtype=dynamic.layers[0].keys.dtype,
                        first_position=positions[:, -1] + 1)
    cache.fill(dynamic)
    return out.logits[:, -1].float(), cache


def decode_steps(lm, cache: StaticCache, batch: int, device, graphs: bool | None):
    """The decode-step runner: CUDA graphs if `graphs` (default: when on CUDA), else eager steps."""
    if graphs is None:
        graphs = device.type == "cuda"
    return DecodeGraphs(lm, cache, batch, device) if graphs else EagerSteps(lm, cache, device)


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, generation_config,
             graphs: bool | None = None) -> torch.Tensor:
    """Prompt + sampled completion ids [B, prompt + n], as transformers' generate() returns them (n <= max_new_tokens;
    finished rows padded with pad_token_id; stops when every row has emitted an end token).

    graphs: replay CUDA graphs (default: when the model is on CUDA; on CPU the steps run eagerly).
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
    blockers = graph_blockers(lm) if (device.type == "cuda" if graphs is None else graphs) else []
    if blockers:
        raise ValueError("graph_decode: cannot capture this model's decode step: " + "; ".join(blockers))
    logits, cache = prefill(lm, input_ids, attention_mask, max_new)
    step = decode_steps(lm, cache, batch, device, graphs)
    unfinished = torch.ones(batch, dtype=torch.long, device=device)
    new_tokens = []
    for n in range(max_new):
        scores = warpers(input_ids, logits)
        if g.do_sample:
            chosen = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        else:
            chosen = scores.argmax(dim=-1)
        chosen = chosen * unfinished + pad * (1 - unfinished)
        new_tokens.append(chosen)
        unfinished = unfinished & ~torch.isin(chosen, eos)
        if n + 1 == max_new or unfinished.max() == 0:
            break
        logits = step(chosen, prompt_len + n).float()
    return torch.cat([input_ids, torch.stack(new_tokens, dim=1)], dim=1)


@torch.no_grad()
def completion_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_ids: torch.Tensor,
                        graphs: bool | None = None) -> torch.Tensor:
    """Log-probabilities [B, n] the decode path gives the tokens of completion_ids [B, n] (fed in as if sampled):
    what compares this path with transformers' on the same completions."""
    lm = causal_lm(model)
    device = input_ids.device
    batch, prompt_len = input_ids.shape
    steps = completion_ids.shape[1]
    logits, cache = prefill(lm, input_ids, attention_mask, steps)
    step = decode_steps(lm, cache, batch, device, graphs)
    out = []
    for n in range(steps):
        token = completion_ids[:, n]
        out.append(torch.log_softmax(logits, dim=-1).gather(1, token[:, None]).squeeze(1))
        if n + 1 < steps:
            logits = step(token, prompt_len + n).float()
    return torch.stack(out, dim=1)


@torch.no_grad()
def full_forward_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                          completion_ids: torch.Tensor) -> torch.Tensor:
    """Log-probabilities [B, n] of completion_ids from one forward over prompt + completion, positions as generate()
    sets them: the reference both decode paths are compared with."""
    full_ids = torch.cat([input_ids, completion_ids], dim=1)
    full_mask = torch.cat([attention_mask, torch.ones_like(completion_ids)], dim=1)
    positions = (full_mask.long().cumsum(-1) - 1).masked_fill(full_mask == 0, 0)
    logits = model(input_ids=full_ids, attention_mask=full_mask, position_ids=positions,
                   logits_to_keep=completion_ids.shape[1] + 1).logits[:, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(2, completion_ids[..., None]).squeeze(2)


def graph_blockers(model) -> list[str]:
    """Why decode steps of this model could not be captured as CUDA graphs ([] = none known)."""
    experts = getattr(causal_lm(model).config, "_experts_implementation", None)
    if experts not in ("grouped_mm", "batched_mm"):
        return [f"experts_implementation={experts!r} (only grouped_mm and batched_mm are known to read nothing on the "
                "host; eager loops over the experts hit)"]
    return []


class GraphDecodeGenerate:
    """Stands in for a model's generate(): graph_decode.generate for the calls it supports, transformers' own for
    the others (said once per reason)."""

    def __init__(self, model, original, say=print):
        self.model, self.original, self.say = model, original, say
        self.reported: set[str] = set()

    def __call__(self, input_ids=None, attention_mask=None, generation_config=None, **kwargs):
        config = generation_config if generation_config is not None else self.model.generation_config
        reasons = unsupported_options(config, kwargs)
        if input_ids is not None and input_ids.device.type == "cuda":
            reasons += graph_blockers(self.model)
        if input_ids is None:
            reasons.append("no input_ids")
        if reasons:
            text = ", ".join(reasons)
            if text not in self.reported:
                self.reported.add(text)
                self.say(f"DECODE_GRAPHS: this generate call uses transformers' generate ({text} not supported)")
            return self.original(input_ids=input_ids, attention_mask=attention_mask,
                                 generation_config=generation_config, **kwargs)
        return generate(self.model, input_ids, attention_mask, config)
