"""The decode limit: the shortest time one decode step of a gpt-oss model can take on a GPU, as the bytes that step
must move divided by the GPU's measured copy rate. Not a script; the benchmarks print every decode figure as a
share of it:

    bench_generate.py   per variant: ms a decode step against the limit at its batch and mean cache length
    bench_grpo.py       per GRPO step: generation seconds against the limit of the decode steps it ran
    profile_decode.py   per kernel group of one captured decode step: time against the bytes the group must move

At tens of sequences a decode step is bound by memory bandwidth, not arithmetic: every weight it uses is read once
and the KV cache once, whatever the batch. `decode_bytes` counts them from the model's config:
- the MoE experts a step hits, in the format decoding reads them (MXFP4: 4.25 bits a value plus bf16 biases; bf16;
  the physical minimum: the padding of the Hopper layout the experts are kept in, ~3 % more, is not counted),
  at the expected number of distinct experts hit per layer when each of the batch's tokens picks top_k of E experts
  uniformly at random (`expected_experts_hit`), unless the caller measured the number from the router;
- the router, the attention projections (bf16 weights and biases, plus the LoRA factors in the autocast dtype), the
  LM head, the norms, sinks and the embedding rows of the batch's tokens;
- the KV cache at the mean context length: full-attention layers over the whole context, sliding-window layers over
  min(window, context); and the one token's keys and values each layer writes.
Not counted: activations (a few MB), and the float32 logits the LM head writes and sampling reads (a sampler fused
with the head would not need them; profile_decode.py shows what they cost).

`measure_copy_rate` measures the rate: a large device-to-device copy, bytes read plus bytes written over its
event-timed duration, the median of repeats.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

# what decode_bytes counts, in the order it prints them; profile_decode.py maps its kernel groups onto these
EXPERTS = "MoE experts hit"
ROUTER = "router"
PROJECTIONS = "attention projections + LoRA"
LM_HEAD = "LM head"
SMALL = "norms, sinks, embedding rows"
KV_FULL = "KV cache, full-attention layers"
KV_SLIDING = "KV cache, sliding-window layers"
KV_WRITES = "KV writes"

MXFP4_BITS = 4.25  # a 4-bit value plus its share of a one-byte scale per block of 32


def expected_experts_hit(tokens: int, top_k: int, experts: int) -> float:
    """Expected number of distinct experts hit when each of `tokens` tokens picks `top_k` distinct experts of
    `experts` uniformly at random: each expert is missed by one token with probability 1 - top_k / experts."""
    if not 0 < top_k <= experts or tokens < 0:
        raise ValueError(f"expected_experts_hit: top_k {top_k} of {experts} experts, {tokens} tokens")
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


def experts_format(decode_experts: str, resident: bool) -> str:
    """How a decode step reads the experts: "mxfp4" when decoding computes them from MXFP4 (graph_decode's
    experts="mxfp4") or the model holds them resident as MXFP4; else "bf16"."""
    return "mxfp4" if decode_experts == "mxfp4" or resident else "bf16"


@dataclass(frozen=True)
class DecodeBytes:
    """What one decode step must move: bytes per item (decode_bytes' names, in order), at `batch` sequences and
    `mean_context` cached tokens, with `experts_hit` distinct experts per layer (`routing`: how it was obtained)."""

    items: dict
    batch: int
    mean_context: float
    experts_hit: float
    experts_total: int
    routing: str
    experts_format: str

    @property
    def total(self) -> float:
        return float(sum(self.items.values()))

    def seconds(self, rate: float) -> float:
        """The decode limit in seconds at `rate` bytes/s."""
        return self.total / rate

    def lines(self, rate: float | None) -> list[str]:
        """Printable: the items, the total and (given a rate) the limit."""
        out = [f"decode limit: {self.batch} sequences, mean cache {self.mean_context:,.0f} tokens, experts "
               f"{self.experts_format}, {self.experts_hit:.2f} of {self.experts_total} hit per layer ({self.routing})"]
        out += [f"  {name:<34}{value / 1e9:>8.3f} GB" for name, value in self.items.items()]
        total = f"  {'total a decode step':<34}{self.total / 1e9:>8.3f} GB"
        if rate:
            total += f" / copy rate {rate / 1e12:.3f} TB/s = {1e3 * self.seconds(rate):.2f} ms a step"
        return out + [total]


def decode_bytes(config, batch: int, mean_context: float, experts: str = "mxfp4", lora_rank: int = 0,
                 experts_hit: float | None = None, weight_bytes: int = 2, lora_bytes: int = 2) -> DecodeBytes:
    """The bytes one decode step of a gpt-oss model (`config`: GptOssConfig or anything with its fields) must move
    at `batch` sequences and `mean_context` cached tokens (see the module docstring). experts: "mxfp4" or "bf16";
    lora_rank: the adapter on q, k, v and o (train_grpo's all-linear), its factors read in `lora_bytes`-byte floats
    (the bf16 autocast decoding computes them in); experts_hit: distinct experts per layer, measured (None: the
    uniform-routing expectation); weight_bytes: the dense weights' and the cache's element size (bf16)."""
    if experts not in ("mxfp4", "bf16"):
        raise ValueError(f"decode_bytes: experts must be 'mxfp4' or 'bf16', got {experts!r}")
    hidden, inter = config.hidden_size, config.intermediate_size
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    n_experts, layers = config.num_local_experts, config.num_hidden_layers
    kinds = list(config.layer_types)
    full = sum(kind != "sliding_attention" for kind in kinds)
    sliding = len(kinds) - full
    routing = "measured from the router"
    if experts_hit is None:
        experts_hit = expected_experts_hit(batch, config.num_experts_per_tok, n_experts)
        routing = "uniform-routing expectation"
    values = hidden * 2 * inter + inter * hidden  # gate_up [H, 2I] and down [I, H] of one expert
    per_value = MXFP4_BITS / 8 if experts == "mxfp4" else weight_bytes
    per_expert = values * per_value + (2 * inter + hidden) * weight_bytes  # + the bf16 biases
    q, kv = heads * head_dim, kv_heads * head_dim
    projection_weights = hidden * (q + 2 * kv) + q * hidden
    projection_biases = (q + 2 * kv + hidden) if getattr(config, "attention_bias", True) else 0
    lora = lora_rank * ((hidden + q) + (hidden + kv) * 2 + (q + hidden))  # A [r, in] and B [out, r] of q, k, v, o
    kv_token = 2 * kv * weight_bytes  # keys and values of one token in one layer
    items = {
        EXPERTS: layers * experts_hit * per_expert,
        ROUTER: layers * (n_experts * hidden + n_experts) * weight_bytes,
        PROJECTIONS: layers * ((projection_weights + projection_biases) * weight_bytes + lora * lora_bytes),
        LM_HEAD: config.vocab_size * hidden * weight_bytes,
        SMALL: ((2 * layers + 1) * hidden + layers * heads + batch * hidden) * weight_bytes,
        KV_FULL: full * batch * mean_context * kv_token,
        KV_SLIDING: sliding * batch * min(config.sliding_window, mean_context) * kv_token,
        KV_WRITES: layers * batch * kv_token,
    }
    return DecodeBytes(items, batch, float(mean_context), experts_hit, n_experts, routing, experts)


def measure_copy_rate(device=None, nbytes: int = 2**30, repeats: int = 20) -> float:
    """The GPU's copy rate in bytes/s: a device-to-device copy of `nbytes`, (bytes read + bytes written) over its
    duration timed with CUDA events, the median of `repeats` copies after one untimed."""
    import torch

    source = torch.empty(nbytes, dtype=torch.uint8, device=device or "cuda")
    target = torch.empty_like(source)
    target.copy_(source)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(source)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del source, target
    torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(times)


def copy_rate_line(rate: float, device_name: str, nbytes: int = 2**30, repeats: int = 20) -> str:
    """What measure_copy_rate measured, for the logs."""
    return (f"copy rate: {rate / 1e12:.3f} TB/s on {device_name} (device-to-device copy of {nbytes / 2**30:g} GiB, "
            f"read + written, median of {repeats})")


@dataclass(frozen=True)
class DecodeLimit:
    """The decode limit of one model and run: its config, how it reads the experts, its LoRA rank, and the copy rate
    measured on its GPU (bytes/s)."""

    config: object
    experts: str
    lora_rank: int
    rate: float

    def bytes(self, batch: int, mean_context: float) -> DecodeBytes:
        return decode_bytes(self.config, batch, mean_context, self.experts, self.lora_rank)

    def calls_seconds(self, calls) -> float:
        """The limit of generate calls given as (sequences, mean real prompt tokens, new tokens): each call's decode
        steps (new tokens - 1: the first comes from the prefill) at its mean cache length, prompt + new / 2."""
        return sum((new - 1) * self.bytes(batch, prompt + new / 2).seconds(self.rate)
                   for batch, prompt, new in calls if new > 1)
