"""The static KV cache of a generate call and the decode steps run over it (used by graph_decode.py).

`prefill` runs the prompt through the model's own forward (flex attention on GPUs, transformers' DynamicCache) and
copies the keys and values into a `StaticCache`: buffers that never move, one of prompt + max_new_tokens slots per
full-attention layer and a ring of `sliding_window` slots per sliding-window layer. Two changes to what the prefill
runs, neither of which changes a real token's inputs: identical prompt rows (TRL's groups) are prefilled once and
copied (SHARE_PROMPTS, `shared_prefill_rows`), and the prompt is left-padded to a multiple of PREFILL_BUCKET_TOKENS so
that flex attention sees few shapes. Positions are the trainer's: TRL's training forward passes no position ids, so
a token's position is its column in the left-padded batch.

`decode_steps` returns the step runner: on CUDA `DecodeGraphs`, decode_math.decode_step captured once per
cache-length bucket (BUCKET_TOKENS) and replayed; elsewhere `EagerSteps`, the same step run directly.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import DynamicCache

from tes_grpo.sampling.decode_math import DecodeWeights, autocast_context, decode_step, head_logits

BUCKET_TOKENS = 512  # full-attention layers attend over the cache rounded up to this many slots (one graph each)
PREFILL_BUCKET_TOKENS = 256  # prompts are left-padded to a multiple of this before prefill (bounded flex shapes)
SHARE_PROMPTS = True  # prefill each distinct prompt row once and copy its keys/values to its repeats (TRL's groups)


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
        """Copies a prefill's DynamicCache (transformers 5.17-5.24: .layers[i].keys/.values, a sliding-window layer
        keeping its last window - 1 positions) into the buffers; row r of the buffers takes row source[r] of the
        prefill (shared prompts; None = row r). A prefill of a longer prompt (left-padded further) gives its last
        prompt_len slots: the rest were masked padding."""
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
        the first `length` slots, sliding layers over the ring; what transformers 5.17-5.24's causal_mask_function and
        sliding_window_overlay let the token see (a sliding layer: the last `window` positions, its own included)."""
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


_WARM_UP_STREAMS: dict = {}


def warm_up_stream(device) -> torch.cuda.Stream:
    """One side stream per device for the warm-up steps, reused: cuBLAS keeps a workspace per (handle, stream) until
    the process ends, so a fresh stream per capture would pin more GPU memory with every generate call."""
    key = torch.device(device).index
    if key not in _WARM_UP_STREAMS:
        _WARM_UP_STREAMS[key] = torch.cuda.Stream(device=device)
    return _WARM_UP_STREAMS[key]


_GENERATOR_ANCHORS: dict = {}


def keep_generator_registered(device) -> None:
    """torch 2.11 (the GPU machine's): keeps one CUDA graph registered with the device's default generator for the
    rest of the process, so that no capture has to allocate the generator's graph-safe seed and offset.

    Why: a capture registers its graph with the generator in two steps (CUDAGeneratorImpl::register_graph: the graph
    takes the generator's state, then the state records the graph), and when no other graph is registered (every
    generate call frees its graphs) the second step allocates those two tensors. Out of GPU memory there, the graph
    is left half registered, and its destructor aborts the process ("terminate called after throwing an instance of
    'c10::Error' what(): The graph should be registered to the state") after train_grpo's one out-of-memory line,
    instead of the exit 1 that line promises. With one graph always registered the tensors stay allocated (two
    int64s) and a capture allocates nothing for the generator. torch 2.13 keeps a state per capture instead; this
    graph is harmless there."""
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    if index in _GENERATOR_ANCHORS:
        return
    anchor = torch.cuda.CUDAGraph()
    register = getattr(anchor, "register_generator_state", None)
    if register is not None:
        register(torch.cuda.default_generators[index])
    _GENERATOR_ANCHORS[index] = anchor


class DecodeGraphs:
    """decode_step captured as CUDA graphs, one per cache-length bucket, sharing one memory pool.

    Inputs go through two static tensors (the token ids and the slot); the first step of each bucket runs eagerly
    (as warm-up, and for real: it writes the same cache slot the replays would) and is then captured.
    """

    def __init__(self, lm, cache: StaticCache, batch: int, device, weights: DecodeWeights | None = None):
        keep_generator_registered(device)  # before memory runs short: see there
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

    A checkpointed layer in train mode runs without the KV cache (transformers 5.17-5.24's GradientCheckpointingLayer
    sets the cache to None while its `gradient_checkpointing` is on), which would leave nothing to decode from. TRL
    already switches it off around generate(); this covers other callers."""
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

    The forward is the model body's (transformers 5.17-5.24's GptOssModel, into a DynamicCache built from the config;
    PEFT's LoRA layers included), under the trainer's autocast when `autocast` names its dtype, and the logits come
    from head_logits: the trainer's arithmetic, as in decode_step.
    For the forward only, the prompt is left-padded to prefill_length (bucket, default PREFILL_BUCKET_TOKENS) with
    pad_id (default the model's pad token) and masked, and identical rows are prefilled once when share_prompts
    (default SHARE_PROMPTS); the cache holds the prompt as given (the extra slots were masked padding).
    """
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
