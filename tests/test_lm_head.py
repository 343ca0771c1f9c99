"""The LM head in training (tes_grpo/training/lm_head.py): TRL 1.16's fused head gives the log-probabilities,
entropies and gradients of the full logits without ever building a micro-batch's [rows, tokens, vocabulary] logits.

Tolerances. float32 (the tiny model on the CPU) against the full logits' log-softmax in float64: TRL sums the
201,088 exponentials in float32 tiles into a running log-sum-exp; measured errors ~2e-6 for log-probabilities and
~6e-6 for entropies (log Z - E[z]), so 1e-5 and 2e-5 absolute are allowed (a float32 -sum p log p over the whole
vocabulary is itself off by up to 1.2e-4, which is why the reference is float64); gradients (TRL accumulates the
hidden states' gradient over tiles in float32) to 1e-4 of the largest. bfloat16 (the GPU's dtype): 8 significant bits,
one step is 2^-8 = 0.4 % of a value; TRL rounds each tile's logits once and its gradients once after a float32
sum, autograd rounds after every op, so the two agree to a few bf16 steps of the largest value: 2^-5 of it.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

VOCAB = 201088


class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op allocates (views of its inputs left out), forward
    and backward: on the CPU autograd runs the backward on the calling thread, inside the mode."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.untyped_storage().data_ptr() not in inputs:
                self.numel = max(self.numel, leaf.untyped_storage().nbytes() // leaf.element_size())
        return out


@pytest.fixture(scope="module")
def tiny_lora():
    """The tiny gpt-oss (real vocabulary) with train_grpo's LoRA, its B matrices random so every LoRA weight gets
    a gradient, and TRL's fused head added as GRPOTrainer adds it (temperature set per call)."""
    from peft import get_peft_model

    import train_grpo
    from tes_grpo.model.model_loading import load_training_model, resolve_model_path

    # PEFT draws the A matrices from torch's global generator: seeded here, so the gradients compared do not depend
    # on which tests ran before (some draws leave a gradient whose float32 sums cancel near the tolerance)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = get_peft_model(load_training_model(resolve_model_path("tiny"), say=lambda message: None),
                               train_grpo.build_lora_config(4, 8))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    model.train()
    return model


def batch(rows: int, prompt: int, completion: int, pad: int, seed: int = 0):
    """input ids [rows, prompt + completion], attention mask (every other row's prompt left-padded by `pad`, its
    completion right-padded by `pad`), completion mask, advantages."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 200_000, (rows, prompt + completion), generator=generator)
    mask = torch.ones_like(ids)
    mask[1::2, :pad] = 0
    mask[1::2, prompt + completion - pad:] = 0
    return ids, mask, mask[:, prompt:], torch.randn(rows, 1, generator=generator)


def trl_scores(model, ids, mask, completion: int, temperature: float):
    """TRL 1.16's own GRPOTrainer._get_per_token_logps_and_entropies on the fused head (a stand-in trainer with
    what the method reads: the accelerator's autocast, off here)."""
    from trl import GRPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    vars(model.get_base_model()).pop("forward", None)  # a previous case's head, else the heads would nest
    add_fused_lm_head(model.get_base_model(), temperature=temperature, outputs=("log_probs", "entropy"))
    trainer = SimpleNamespace(accelerator=SimpleNamespace(is_main_process=True, autocast=contextlib.nullcontext))
    logps, entropies, _ = GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, ids, mask, completion,
                                                                         compute_entropy=True)
    return logps, entropies


def exact_scores(model, ids, mask, completion: int, temperature: float):
    """The reference: the model's whole logits for the completion positions, log-softmax and entropy in float64."""
    logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=completion + 1).logits[:, :-1].double()
    log_softmax = (logits / temperature).log_softmax(-1)
    logps = log_softmax.gather(-1, ids[:, -completion:, None]).squeeze(-1)
    return logps, -(log_softmax.exp() * log_softmax).sum(-1)


def lora_grads(model, loss) -> dict:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}


# (rows, prompt tokens, completion tokens, padding, temperature, only completion positions scored, entropy weight)
CASES = [
    (2, 24, 12, 0, 1.0, True, 0.0),  # the recipe on a GPU: completion positions only, loss on log-probs only
    (3, 20, 10, 3, 1.0, True, 0.0),  # padded rows (TRL's left-padded prompts, right-padded completions)
    (2, 16, 8, 2, 0.7, True, 0.0),  # a temperature other than 1 divides the logits first
    (2, 16, 8, 2, 1.0, False, 0.0),  # TRL's CPU path without the workaround: every position scored, then masked
    (2, 16, 8, 0, 1.0, True, 0.1),  # entropy in the loss: the fused head's entropy gradient too
]


@pytest.mark.parametrize("rows, prompt, completion, pad, temperature, compact, entropy_weight", CASES)
def test_fused_head_matches_full_logits(tiny_lora, monkeypatch, one_torch_thread, rows, prompt, completion, pad,
                                        temperature, compact, entropy_weight):
    import trl.trainer.utils as trl_utils

    monkeypatch.setattr(trl_utils, "_use_triton", lambda device: compact)
    ids, mask, completion_mask, advantages = batch(rows, prompt, completion, pad)
    keep = completion_mask.bool()

    def loss(logps, entropies):  # dr_grpo's policy term at ratio 1 (beta 0), plus an optional entropy term
        return -((logps * advantages + entropy_weight * entropies) * completion_mask).sum() / logps.numel()

    logps, entropies = trl_scores(tiny_lora, ids, mask, completion, temperature)
    fused = lora_grads(tiny_lora, loss(logps, entropies))
    ref_logps, ref_entropies = exact_scores(tiny_lora, ids, mask, completion, temperature)
    full = lora_grads(tiny_lora, loss(ref_logps, ref_entropies))

    torch.testing.assert_close(logps[keep].double(), ref_logps[keep], rtol=0.0, atol=1e-5)
    torch.testing.assert_close(entropies[keep].double(), ref_entropies[keep], rtol=0.0, atol=2e-5)
    assert (logps[~keep] == 0).all()  # padding positions: TRL leaves zeros, the loss masks them anyway
    assert sorted(fused) == sorted(full) and len(fused) == 16  # q/k/v/o A and B of both layers
    for name in fused:
        scale = full[name].abs().max()
        assert scale > 0, name
        # float32 sums in another order: an element that cancels to ~1e-3 of the gradient's largest can differ by
        # ~2e-4 of that largest (torch 2.11's CPU kernels, the GPU machine's: 1.7e-4 in 1 of 256; 5e-4 leaves 3x);
        # a wrong head (a chunk dropped, the temperature missed) differs by the gradient's own size
        torch.testing.assert_close(fused[name], full[name], rtol=1e-4, atol=5e-4 * scale.item(),
                                   msg=lambda detail, name=name: f"{name}: {detail}")


# (path, rows, prompt tokens, completion tokens, only completion positions scored, builds the logits?)
MATERIALISE = [
    ("fused", 2, 24, 12, True, False),  # the recipe's path: one tile, never [rows, tokens, vocabulary]
    ("fused", 2, 24, 12, False, False),  # every position scored (TRL's CPU default): still tiled
    ("full", 2, 24, 12, True, True),  # the unfused reference builds them: shows the probe can see it
]


@pytest.mark.parametrize("path, rows, prompt, completion, compact, builds_logits", MATERIALISE)
def test_no_micro_batch_logits(tiny_lora, monkeypatch, one_torch_thread, path, rows, prompt, completion, compact,
                               builds_logits):
    import trl.trainer.utils as trl_utils

    from tes_grpo.training.lm_head import full_logits_logps_and_entropies, fused_head_tile

    monkeypatch.setattr(trl_utils, "_use_triton", lambda device: compact)
    ids, mask, completion_mask, advantages = batch(rows, prompt, completion, 0)
    probe = LargestTensor()
    with probe:
        if path == "fused":
            logps, _ = trl_scores(tiny_lora, ids, mask, completion, 1.0)
        else:
            logps, _ = full_logits_logps_and_entropies(tiny_lora, ids, mask, completion, 1.0)
        (logps * advantages * completion_mask).sum().backward()
    tiny_lora.zero_grad(set_to_none=True)
    logits = rows * completion * VOCAB
    assert (probe.numel >= logits) == builds_logits, probe.numel
    if not builds_logits:
        tokens, vocab = fused_head_tile()
        scored = rows * completion if compact else rows * (prompt + completion - 1)
        assert probe.numel <= min(scored, tokens) * vocab


# (tokens, hidden, vocabulary, token tile, vocabulary tile, dtype, temperature)
SYNTHETIC = [
    (37, 16, 1000, 8, 256, torch.float32, 1.0),  # ragged tiles both ways: 5 token tiles, 4 vocabulary tiles
    (37, 16, 1000, 64, 2048, torch.float32, 1.0),  # one tile holds everything
    (20, 16, 777, 7, 100, torch.float32, 0.6),  # temperature, odd sizes
    (37, 32, 1000, 8, 256, torch.bfloat16, 1.0),  # the GPU's dtype: tiles rounded to bf16, sums in float32
]


@pytest.mark.parametrize("tokens, hidden, vocab, token_tile, vocab_tile, dtype, temperature", SYNTHETIC)
def test_tiled_head_matches_full_head(monkeypatch, tokens, hidden, vocab, token_tile, vocab_tile, dtype, temperature):
    import trl.kernels.chunked_logprob as kernels

    monkeypatch.setattr(kernels, "TOKEN_CHUNK_SIZE", token_tile)
    generator = torch.Generator().manual_seed(1)
    h = torch.randn(tokens, hidden, generator=generator).to(dtype)
    w = (torch.randn(vocab, hidden, generator=generator) * 0.5).to(dtype)
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    g_logp, g_entropy = torch.randn(tokens, generator=generator), torch.randn(tokens, generator=generator)

    def run(tiled: bool):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        if tiled:
            logp, entropy, *_ = kernels.ChunkedLogProbFunction.apply(hh, ww, None, targets, temperature, vocab_tile,
                                                                     None, 1.0, ("log_probs", "entropy"))
        else:
            logits = (hh @ ww.t()).float() / temperature
            log_softmax = logits.log_softmax(-1)
            logp = log_softmax.gather(-1, targets[:, None]).squeeze(-1)
            entropy = -(log_softmax.exp() * log_softmax).sum(-1)
        ((logp * g_logp).sum() + (entropy * g_entropy).sum()).backward()
        return logp.detach(), entropy.detach(), hh.grad.float(), ww.grad.float()

    tolerance = 1e-5 if dtype == torch.float32 else 2**-5
    for got, want in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance * want.abs().max())


def test_describe_lm_head_says_whether_the_head_is_fused(tiny_lora):
    from trl.trainer.utils import add_fused_lm_head

    from tes_grpo.training.lm_head import describe_lm_head, fused_head_tile, uses_fused_lm_head

    assert fused_head_tile() == (4096, 32768)  # TRL 1.16; another TRL: recheck lm_head.py's notes
    add_fused_lm_head(tiny_lora.get_base_model(), outputs=("log_probs", "entropy"))
    assert uses_fused_lm_head(tiny_lora) and "fused head" in describe_lm_head(tiny_lora)
    del tiny_lora.get_base_model().forward  # back to the class's forward
    assert not uses_fused_lm_head(tiny_lora) and "not TRL's fused head" in describe_lm_head(tiny_lora)
