"""The LM head in training: TRL's fused head, which never builds a micro-batch's logits, and what it replaces.

Library module, not a script. gpt-oss's vocabulary has 201,088 entries: a micro-batch of 8 x 4,871 tokens would
hold 14.6 GiB of bf16 logits and twice that as float32 log-softmax. TRL 1.16 never builds them (paths below are
in site-packages/trl/):

- trainer/grpo_trainer.py 1066-1077: GRPOTrainer.__init__ calls `add_fused_lm_head` on the model (the PEFT base
  model under LoRA) with outputs ("log_probs", "entropy"): the entropy feeds TRL's `entropy` metric.
- trainer/grpo_trainer.py 1419-1510, `_get_per_token_logps_and_entropies`: for each `batch_size` rows (the whole
  micro-batch in `_compute_loss`) it masks the labels to the completion positions and calls
  `model(..., labels=labels, fused_lm_head=True)` (line 1498), taking `outputs.log_probs` and `outputs.entropy`.
- trainer/utils.py 1599-1698, `_fused_forward`: runs the backbone only (no logits), then, when
  `_use_triton(device)` (line 1642: CUDA or XPU with Triton), passes only the completion positions'
  hidden states (`hidden_states[mask]`) to `ChunkedLogProbFunction` with a vocabulary chunk of
  `_CHUNKED_LOGPROB_CHUNK_SIZE` = 32,768 (line 1506). Without Triton (the CPU) it passes every position, still
  tiled; patches.trl_patches.score_only_completion_tokens_on_cpu makes the CPU score completion positions too.
- kernels/chunked_logprob.py 299-465, `ChunkedLogProbFunction`: the projection runs into one
  [min(N, TOKEN_CHUNK_SIZE = 4,096), 32,768] buffer in the compute dtype (256 MiB in bf16), folded into running
  log-sum-exp, entropy and target-logit statistics (a Triton kernel; torch ops on the CPU); the backward recomputes
  each tile, turns it into the logits' gradient in place and accumulates the hidden states' gradient in float32.
  So the head's extra memory is one tile plus per completion token its hidden state (saved) and float32 gradient.
- trainer/grpo_trainer.py 1049-1064: `use_liger_kernel=True` is deprecated (FutureWarning) and forces
  liger's fused linear cross-entropy off (it would replace the fused head); only liger's layer kernels remain.
  TRL 1.16 has no `use_liger_loss`: liger's fused linear GRPO loss is not wired in.

Nothing here changes TRL. `fused_head_tile` reads the tile from the installed TRL (None when it has no such head,
and the memory plan then counts full logits), `describe_lm_head` says at startup what the trained model does,
and `full_logits_logps_and_entropies` is the unfused computation (TRL before its fused head), the reference the
tests compare the fused head with and the benchmark's "full" variant (the trainer's `full_logits`).
"""

from __future__ import annotations

import importlib

import trl
import trl.trainer.utils as trl_utils
from trl.trainer.utils import entropy_from_logits, selective_log_softmax

from tes_grpo.layers.lora import causal_lm

# TRL 1.16's tile: (kernels/chunked_logprob.TOKEN_CHUNK_SIZE, _CHUNKED_LOGPROB_CHUNK_SIZE). fused_head_tile() reads
# the installed TRL instead; this is what the memory estimate assumes where it was not asked.
TRL_1_16_HEAD_TILE = (4096, 32768)


def fused_head_tile() -> tuple[int, int] | None:
    """(tokens, vocabulary entries) of the installed TRL's fused LM head tile: (4096, 32768) in TRL 1.16; None when
    this TRL has no `ChunkedLogProbFunction` / `_CHUNKED_LOGPROB_CHUNK_SIZE` (another version)."""
    try:
        kernels = importlib.import_module("trl.kernels.chunked_logprob")
    except ImportError:
        return None
    tokens = getattr(kernels, "TOKEN_CHUNK_SIZE", None)
    vocab = getattr(trl_utils, "_CHUNKED_LOGPROB_CHUNK_SIZE", None)
    if not (isinstance(tokens, int) and isinstance(vocab, int)):
        return None
    return tokens, vocab


def uses_fused_lm_head(model) -> bool:
    """Whether TRL's add_fused_lm_head has patched this model's forward (TRL 1.16 binds `_fused_forward` to the
    instance; functools.wraps gives it the class forward's name, so the code object tells)."""
    forward = vars(causal_lm(model)).get("forward")
    code = getattr(getattr(forward, "__func__", None), "__code__", None)
    return code is not None and code.co_name == "_fused_forward" and "trl" in code.co_filename


def describe_lm_head(model) -> str:
    """One log line: whether the trained model's LM head is TRL's fused head, and its tile."""
    tile = fused_head_tile()
    vocab = causal_lm(model).config.get_text_config().vocab_size
    if uses_fused_lm_head(model) and tile is not None:
        return (f"LM head: TRL {trl.__version__}'s fused head, completion positions in tiles of {tile[0]:,} tokens "
                f"x {tile[1]:,} of the {vocab:,}-entry vocabulary, forward and backward (no micro-batch logits)")
    return (f"LM head: not TRL's fused head (TRL {trl.__version__}): each micro-batch builds [rows, tokens, "
            f"{vocab:,}] logits; the memory plan counts them")


def full_logits_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep: int, temperature: float,
                                    compute_entropy: bool = True):
    """(log-probs [B, logits_to_keep], entropies or None) of the last logits_to_keep tokens from the model's
    ordinary forward: the whole [B, logits_to_keep, V] logits, scaled by 1 / temperature, through TRL's own
    selective_log_softmax and entropy_from_logits (what TRL did before its fused head; TRL 1.16's functions, in place
    of its _get_per_token_logps_and_entropies)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=logits_to_keep + 1,
                   use_cache=False).logits
    logits = logits[:, :-1, :] / temperature
    logps = selective_log_softmax(logits, input_ids[:, -logits_to_keep:])
    return logps, entropy_from_logits(logits) if compute_entropy else None
