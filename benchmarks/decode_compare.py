"""Log-probabilities of the same completion tokens from each way of computing them, and the prefill shapes a model
saw: what the tests and bench_generate.py compare graph_decode.py with (helpers, not a script).

- transformers_logprobs: transformers' generate samples the completions and gives the log-probabilities it sampled
  them from (its float32 copy of the bf16 logits, after the warpers: TRL's temperature 1 has none);
- decode_logprobs: graph_decode's prefill and decode steps fed the same tokens (as if it had sampled them);
- trainer_logprobs: the trainer's computation: TRL 1.16's training forward (PEFT's layers, under the trainer's
  autocast, TRL's fused LM head, positions as TRL passes them: none, so the padded columns count);
- full_forward_logprobs: one plain forward over prompt + completion, positions as generate() sets them.
"""

from __future__ import annotations

import contextlib

import torch

from tes_grpo.layers.lora import causal_lm
from tes_grpo.sampling import decode_cache, decode_math


@torch.no_grad()
def decode_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_ids: torch.Tensor,
                    graphs: bool | None = None, share_prompts: bool | None = None, prefill_bucket: int | None = None,
                    experts: str = "model", lora: str = "peft", autocast: torch.dtype | None = None,
                    glue: str = "eager") -> torch.Tensor:
    """Log-probabilities [B, n] graph_decode's prefill and decode steps give the tokens of completion_ids [B, n] (fed
    in as if sampled; no warpers); glue: the decode step's glue, "eager" or "compiled" (decode_glue)."""
    lm = causal_lm(model)
    device = input_ids.device
    batch, prompt_len = input_ids.shape
    steps = completion_ids.shape[1]
    weights = decode_math.decode_weights(lm, experts, lora, autocast, glue=glue)
    logits, cache = decode_cache.prefill(lm, input_ids, attention_mask, steps, share_prompts=share_prompts,
                                         bucket=prefill_bucket, autocast=autocast)
    step = decode_cache.decode_steps(lm, cache, batch, device, graphs, weights)
    out = []
    for n in range(steps):
        token = completion_ids[:, n]
        out.append(torch.log_softmax(logits, dim=-1).gather(1, token[:, None]).squeeze(1))
        if n + 1 < steps:
            logits = step(token, prompt_len + n)
    return torch.stack(out, dim=1)


@torch.no_grad()
def transformers_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, new_tokens: int,
                          pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(completion ids [B, n], their log-probabilities [B, n]): transformers' generate samples n tokens per row (no
    end token: min_new_tokens) and the log-probabilities are those of its logits (float32 copies, as it samples)."""
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=True, use_cache=True, pad_token_id=pad_id,
                         output_logits=True, return_dict_in_generate=True)
    completion = out.sequences[:, input_ids.shape[1]:]
    logits = torch.stack(out.logits, dim=1).float()
    return completion, torch.log_softmax(logits, dim=-1).gather(2, completion[..., None]).squeeze(2)


@torch.no_grad()
def trainer_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_ids: torch.Tensor,
                     autocast: torch.dtype | None = None) -> torch.Tensor:
    """Log-probabilities [B, n] of completion_ids as TRL 1.16's GRPOTrainer computes them for the loss: its fused LM
    head on the model (added once, as the trainer adds it), input_ids and attention_mask only (no position ids),
    labels on the completion, under `autocast` (the accelerator's mixed precision: bf16 on GPUs)."""
    from trl.trainer.utils import add_fused_lm_head

    lm = causal_lm(model)
    if not getattr(lm, "_decode_compare_fused_head", False):
        add_fused_lm_head(lm, outputs=("log_probs",))
        lm._decode_compare_fused_head = True
    full_ids = torch.cat([input_ids, completion_ids], dim=1)
    full_mask = torch.cat([attention_mask, torch.ones_like(completion_ids)], dim=1)
    n = completion_ids.shape[1]
    labels = full_ids.masked_fill(full_mask == 0, -100)
    labels[:, :-n] = -100
    with decode_math.autocast_context(input_ids.device, autocast):
        out = model(input_ids=full_ids, attention_mask=full_mask, labels=labels, fused_lm_head=True)
    return out.log_probs[:, -n:].float()


@torch.no_grad()
def full_forward_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                          completion_ids: torch.Tensor) -> torch.Tensor:
    """Log-probabilities [B, n] of completion_ids from one forward over prompt + completion, positions as generate()
    sets them (real tokens counted only)."""
    full_ids = torch.cat([input_ids, completion_ids], dim=1)
    full_mask = torch.cat([attention_mask, torch.ones_like(completion_ids)], dim=1)
    positions = (full_mask.long().cumsum(-1) - 1).masked_fill(full_mask == 0, 0)
    logits = model(input_ids=full_ids, attention_mask=full_mask, position_ids=positions,
                   logits_to_keep=completion_ids.shape[1] + 1).logits[:, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(2, completion_ids[..., None]).squeeze(2)


@contextlib.contextmanager
def prefill_shapes(model):
    """Yields a list that collects the (rows, length) of every prefill forward of `model` while the block runs
    (graph_decode's prefill and transformers' own: each call of the model body with a KV cache and more than one
    position; a training forward has no cache)."""
    seen: list[tuple[int, int]] = []

    def record(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        cached = kwargs.get("past_key_values", kwargs.get("cache")) is not None
        if cached and ids is not None and ids.shape[1] > 1:
            seen.append(tuple(ids.shape))

    handle = causal_lm(model).model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


@torch.no_grad()
def draw_lora_b(model, rho: float = 0.0, b_std: float = 0.0) -> None:
    """Draws every LoRA layer's B (PEFT starts it at zero, where the adapter changes nothing): from N(0, b_std), or,
    with rho > 0, scaled so that the layer's delta (B A x scaling) is rho times its base weight in rms. A GRPO run at
    LR 5e-5 passes through rho from 1e-4 to 1e-2; the sampler's LoRA arithmetic matters in proportion to it."""
    for module in model.modules():
        if "default" not in getattr(module, "lora_B", {}):
            continue
        A, B = module.lora_A["default"].weight, module.lora_B["default"].weight
        B.normal_(0, b_std or 1.0)
        if rho:
            delta = (B.float() @ A.float()) * module.scaling["default"]
            B.mul_(rho * module.base_layer.weight.float().pow(2).mean().sqrt() / delta.pow(2).mean().sqrt())
