"""Sampling from gpt-oss with a static KV cache, each decode step replayed as one CUDA graph, in the trainer's
arithmetic: the GRPO sampler's fast backend (sampler.py calls it when fast_paths.py chooses it).

    python benchmarks/bench_generate.py --NUM_SEQS=64 --NEW_TOKENS=128 --VARIANTS=grouped_mm,graphs   # GPU machine

`generate` takes the place of transformers' generate() for the options TRL sets (temperature, top-k, top-p, min-p
with transformers' own warpers; end tokens; pad after the end): the prompt is prefilled into a static cache
(decode_cache.py), each new token is one decode step (decode_math.py; a CUDA graph replay on GPUs), and each
token is drawn as generate() draws it (token_sampling.py; on GPUs by draw_kernel.py's kernels from the same random
numbers), so the random numbers drawn are generate()'s.
sampler.py calls it (`generate_in_calls`) for the calls it supports and transformers' generate for the rest
(`unsupported_options` names why). `auto_decode_graphs` is the one check of whether a model can take this path at
all (`model_blockers`, `state_blockers`, `graph_blockers`).

Why it exists: through transformers' generate a decode step of the 20B model at 64 sequences is mostly Python and
thousands of kernel launches; a CUDA graph replays a step's kernels with one launch, but only if the step has fixed
shapes, fixed buffers and never waits for the GPU. The policy being trained is what it samples: GRPO's gradient
assumes the completions were drawn from the policy the trainer computes, so prefill and decode steps run under the
trainer's autocast, add LoRA to the rounded base products as PEFT does, use the trainer's positions and compute the
logits as TRL's fused LM head does. BENCHMARKS.md times it and measures its gap to the trainer
(benchmarks/bench_generate.py's COMPARE_SEQS); tests/test_graph_decode.py compares it with transformers' generate
and with the trainer on the CPU.

Inside GRPO (TRL 1.16) generate() runs with the model in train mode, gradient checkpointing switched off by TRL and
under torch.no_grad. This module leaves the mode as it finds it, as generate() does: at dropout 0 nothing in
gpt-oss's forward depends on it (`state_blockers` keeps a model with dropout left on off this path). The prefill
switches the layers' gradient checkpointing off for its forward if a caller left it on and back on after. It runs
under no_grad, not inference_mode: inference tensors returned to a caller that trains on them fail.
"""

from __future__ import annotations

import torch
import transformers

from tes_grpo.layers.lora import causal_lm
from tes_grpo.sampling.decode_cache import decode_steps, prefill
from tes_grpo.sampling.decode_math import decode_weights
from tes_grpo.sampling.token_sampling import draw, logits_warpers

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


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, generation_config,
             graphs: bool | None = None, share_prompts: bool | None = None, prefill_bucket: int | None = None,
             experts: str = "model", say=print, lora: str = "peft", autocast: torch.dtype | None = None,
             logprobs: bool = False, glue: str = "eager", attention_kernel: str = "triton",
             projection_kernel: str = "triton", draw_kernel: str = "triton"):
    """Prompt + sampled completion ids [B, prompt + n], as transformers' generate() returns them (n <= max_new_tokens;
    finished rows padded with pad_token_id; stops when every row has emitted an end token). logprobs=True: also the
    log-probability [B, n] (float32) of each sampled token under the distribution it was drawn from (log_softmax of
    the warped scores at the chosen token; 0 after a row's end), returned as (ids, logprobs).

    graphs: replay CUDA graphs (default: when the model is on CUDA; on CPU the steps run eagerly); whether this model
    can be captured is checked once, when the caller installs the path (auto_decode_graphs). share_prompts,
    prefill_bucket: see prefill (defaults SHARE_PROMPTS, PREFILL_BUCKET_TOKENS). experts: "model" (the model's MLP) or
    "mxfp4" (see expert_packs; what cannot be packed is said through `say`). lora: "peft" (the adapter added to the
    base products as PEFT's forward does) or "merged" (see attention_projections). autocast: the dtype the trainer's
    forward runs under autocast in (decode_step). glue: "eager" or "compiled" (the decode step's glue compiled on
    CUDA: decode_glue.glue_for; how it runs is said once through `say`). attention_kernel: the GPU's attention kernel,
    "triton" (decode_attention.py) or "flex" (flex attention's, to time against it; decode_math.attention_function).
    projection_kernel: the GPU's attention projections, "triton" (decode_linear.py) or "cublas" (cuBLAS's products,
    to time against it; decode_math.projection_linear). draw_kernel: how the GPU draws each token, "triton"
    (draw_kernel.py) or "torch" (torch's ops, to time against it; token_sampling.draw).
    The random numbers drawn are generate()'s: one torch.multinomial's over all rows per step, nothing in the prefill.
    The loop is transformers 5.17-5.24's GenerationMixin._sample: warpers, draw, pad after a row's end, stop when every
    row has ended.
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
    weights = decode_weights(lm, experts, lora, autocast, say, glue, attention_kernel, projection_kernel)
    logits, cache = prefill(lm, input_ids, attention_mask, max_new, pad, share_prompts, prefill_bucket, autocast)
    step = decode_steps(lm, cache, batch, device, graphs, weights)
    unfinished = torch.ones(batch, dtype=torch.long, device=device)
    ends = EndFlags(max_new, device)
    new_tokens, new_logprobs = [], []
    for n in range(max_new):
        before_draw = random_state(device)
        chosen, picked = draw(warpers(input_ids, logits), g.do_sample, logprobs, draw_kernel)
        if n > 0 and ends.ended(n - 1):
            # every row had ended at the token before: this draw and the step before it ran ahead of the check,
            # so drop the token and give back its random numbers, as if the loop had stopped there
            set_random_state(device, before_draw)
            break
        if logprobs:
            new_logprobs.append(picked * unfinished)
        chosen = chosen * unfinished + pad * (1 - unfinished)
        new_tokens.append(chosen)
        unfinished = unfinished & ~torch.isin(chosen, eos)
        if n + 1 == max_new:
            break
        ends.note(n, unfinished)
        logits = step(chosen, prompt_len + n)
    ids = torch.cat([input_ids, torch.stack(new_tokens, dim=1)], dim=1)
    return (ids, torch.stack(new_logprobs, dim=1)) if logprobs else ids


class EndFlags:
    """Whether every row has ended after token n, read one token late. Reading it at once would make the host wait
    for the GPU every token, leaving the GPU idle while the host launches the next step; read after the next step
    is queued, the GPU always has work. `generate` undoes what ran ahead: one token's draw (dropped, its random
    numbers given back); its decode step only wrote cache slots no row reads, though when that step is the first in
    a new cache bucket it is captured first (decode_cache's DecodeGraphs), once a generate call at most."""

    def __init__(self, steps: int, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.flags = torch.empty(max(steps, 1), dtype=torch.long, pin_memory=self.cuda)
        self.events: dict[int, torch.cuda.Event] = {}

    def note(self, n: int, unfinished: torch.Tensor) -> None:
        """Copies `unfinished.max()` after token n to the host without waiting for it."""
        self.flags[n].copy_(unfinished.max(), non_blocking=self.cuda)
        if self.cuda:  # on the stream of the tensors' GPU, which ran the copy (the current GPU may be another)
            self.events[n] = torch.cuda.Event()
            self.events[n].record(torch.cuda.current_stream(self.device))

    def ended(self, n: int) -> bool:
        """Whether no row was unfinished after token n (waits for that copy only)."""
        event = self.events.pop(n, None)
        if event is not None:
            event.synchronize()
        return int(self.flags[n]) == 0


def random_state(device: torch.device) -> torch.Tensor:
    """The state of the generator torch.multinomial draws from on `device` (a host copy; no GPU wait)."""
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    if device.type == "cpu":
        return torch.get_rng_state()
    raise ValueError(f"graph_decode: sampling on {device} is not supported (CUDA or CPU)")


def set_random_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def graph_blockers(model) -> list[str]:
    """Why decode steps of this model could not be captured as CUDA graphs ([] = none known)."""
    experts = getattr(causal_lm(model).config, "_experts_implementation", None)
    if experts not in ("grouped_mm", "batched_mm"):
        return [f"experts_implementation={experts!r} (only grouped_mm and batched_mm are known to read nothing on the "
                "host; eager loops over the experts hit)"]
    return []


def model_blockers(model) -> list[str]:
    """Why this path cannot decode this model at all ([] = it can): it is written for gpt-oss on transformers 5."""
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
    model, its state and its capturability: the sampler does not repeat it on each call.

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


def generate_in_calls(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, generation_config,
                      max_batch: int | None = None, logprobs: bool = False, **options):
    """`generate` over a batch in consecutive calls of at most `max_batch` rows (as the memory plan allows; None = all
    at once), the rows of the calls joined as one batch: (ids, log-probabilities or None when `logprobs` is off).
    options: generate's (experts, lora, autocast, glue, say, ...)."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    size = max_batch or input_ids.shape[0]
    parts = [generate(model, input_ids[i:i + size], attention_mask[i:i + size], generation_config, logprobs=logprobs,
                      **options)
             for i in range(0, input_ids.shape[0], size)]
    pad = generation_config.pad_token_id
    pad = pad if pad is not None else first_end_token(generation_config)
    if not logprobs:
        return joined_rows(parts, pad), None
    return joined_rows([p[0] for p in parts], pad), joined_rows([p[1] for p in parts], 0.0)
