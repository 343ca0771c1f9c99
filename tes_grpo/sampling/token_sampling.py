"""One sampling step, as transformers' generate() takes it, shared by every generation path.

`logits_warpers` builds transformers' own warpers for a generation config (temperature, top-k, top-p, min-p, in
generate()'s order); `draw` picks each row's next token from the warped scores and, when asked, the log-probability
it was drawn with (graph_decode's loop); `SampledLogprobs` is the recorder of those log-probabilities that
transformers' generate() is handed as a logits processor (sampler.py), fed every step's scores.
"""

from __future__ import annotations

import torch
from transformers import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

# what generate() warps that SampledLogprobs does not repeat (logits_warpers covers the rest)
_UNMIRRORED = {"typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "top_h": None,
               "watermarking_config": None, "num_beams": 1}

def logits_warpers(generation_config):
    """transformers' sampling warpers for the config, in generate()'s order (temperature, top-k, top-p, min-p: as
    transformers 5.17-5.24's GenerationMixin._get_logits_processor appends them)."""
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


DRAW_KERNELS = ("triton", "torch")  # draw's kernels on CUDA: draw_kernel.py's three launches, or torch's ops


def draw(scores: torch.Tensor, do_sample: bool, logprobs: bool,
         kernel: str = "triton") -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's next token from warped scores [B, vocab] (one torch.multinomial over all rows when sampling, as
    transformers 5.17-5.24's GenerationMixin._sample draws; argmax otherwise) and, when `logprobs`, its
    log-probability under the distribution it was drawn from (log_softmax of the scores at the chosen token), else
    None. kernel: how a sampling draw runs on CUDA, "triton" (draw_kernel.draw: the same random numbers and
    distribution in three launches; its docstring says where a token can differ) or "torch" (these ops, to time
    against it); elsewhere torch's ops, whatever `kernel` says."""
    if kernel not in DRAW_KERNELS:
        raise ValueError(f"token_sampling.draw: kernel must be one of {DRAW_KERNELS}, got {kernel!r}")
    if do_sample and kernel == "triton" and scores.is_cuda:
        from tes_grpo.sampling import draw_kernel  # Triton: only where a GPU samples

        chosen, picked = draw_kernel.draw(scores)
        return chosen, (picked if logprobs else None)
    if do_sample:
        chosen = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
    else:
        chosen = scores.argmax(dim=-1)
    if not logprobs:
        return chosen, None
    return chosen, scores.gather(1, chosen[:, None]).squeeze(1) - torch.logsumexp(scores, dim=-1)


class SampledLogprobs:
    """Records the log-probability of each token a generate() call samples, under the distribution it samples from.

    transformers 5.17-5.24's generate: passed as the last custom logits processor, it sees each step's scores after
    the other processors but before the sampling warpers (_get_logits_processor appends those after custom ones),
    so it applies the warpers itself (`warpers`: logits_warpers of the call's config, the same classes in the same
    order; each returns a new tensor, so generate's own pass is untouched); the token chosen from a step is read at
    the next step (the last column of input_ids) and the last one from the returned sequences (`result`).
    """

    def __init__(self, warpers=None):
        self.warpers = warpers
        self.steps: list[torch.Tensor] = []
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self._close(input_ids[:, -1])
        warped = self.warpers(input_ids, scores) if self.warpers else scores
        self.pending = (warped, warped.float().logsumexp(dim=-1))
        return scores

    def _close(self, chosen: torch.Tensor) -> None:
        if self.pending is not None:
            warped, total = self.pending
            self.steps.append(warped.gather(1, chosen[:, None]).squeeze(1).float() - total)
            self.pending = None

    def result(self, sequences: torch.Tensor, prompt_len: int) -> torch.Tensor:
        """[B, n] float32 log-probabilities of sequences[:, prompt_len:] (n new tokens)."""
        self._close(sequences[:, -1])
        new = sequences.shape[1] - prompt_len
        if len(self.steps) != new:
            raise RuntimeError(f"SampledLogprobs: generate called it {len(self.steps)} times for {new} new tokens")
        return torch.stack(self.steps, dim=1) if self.steps else sequences.new_zeros((sequences.shape[0], 0),
                                                                                       dtype=torch.float32)


def recording_blockers(config) -> list[str]:
    """Options of a generate() call under which SampledLogprobs would not see the distribution sampled from: the
    warpers transformers 5.17-5.24's _get_logits_processor adds besides logits_warpers' (and beam search)."""
    return [f"{name}={getattr(config, name, None)!r}" for name, neutral in _UNMIRRORED.items()
            if getattr(config, name, neutral) not in (neutral, None)]
