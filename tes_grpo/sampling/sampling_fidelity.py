"""How closely the completions were sampled from the policy being trained, measured every step, and an optional
correction (IMPORTANCE_SAMPLING). Library module: the trainer (training/trainer.py) hands each micro-batch to a
`GapMeter`.

Why: GRPO's gradient assumes the completions were drawn from the policy the trainer computes. The sampler computes
its own forward (graph_decode's decode steps, transformers' generate, or vLLM), with other kernels and other
roundings, so the two policies differ a little; TRL measures and corrects that only when vLLM generates. Here every
path does: for every completion token y_t of an optimizer step,

    delta_t = log pi_train(y_t) - log pi_sampler(y_t)

pi_sampler: the probability the sampler drew the token with, after temperature and the other warpers (the
distribution it actually sampled from); pi_train: the trainer's, from its forward before the update (TRL 1.16's
old_per_token_logps). Tokens outside the completion and tool masks, and tokens whose sampler log-probability is NaN
(vLLM could not score them), are left out. Logged per optimizer step through TRL's metrics (so into metrics.jsonl,
TensorBoard and REPORT_TO's trackers; the progress line shows the first), under TRL's names:

- sampling/sampling_logp_difference/mean, /max: the mean (over the step's tokens, all processes) and max of |delta|;
- sampling/importance_sampling_ratio/min, /mean, /max: of the per-token ratio exp(delta) = pi_train / pi_sampler;
  with IMPORTANCE_SAMPLING on, of the weights applied (after truncation or masking; one per sequence in the
  sequence modes), as TRL logs its vLLM correction;
- sampling/gen_kl_error: the token mean of exp(delta) - delta - 1. This is NeMo-RL's gen_kl_error (its
  ClippedPGLossFn: calculate_kl(generation_logprobs, prev_logprobs) with the "k3" estimator of Schulman's
  "Approximating KL divergence", masked mean over the step's valid tokens): with r = pi_train / pi_sampler at tokens
  drawn from pi_sampler, E[r - 1 - log r] = KL(pi_sampler || pi_train), per token, never negative. NeMo-RL's
  gpt-oss-20b release check requires it below 0.002.

Where the log-probabilities come from (training/trainer.py's GRPOTrainer subclass, TRL 1.16):
- the sampler's: vLLM returns them (TRL asks for them, after processing); graph_decode's sampling loop computes them
  (generate(logprobs=True)); transformers' generate gets SampledLogprobs as its last custom logits processor. The
  trainer's `_generate_single_turn` returns them to TRL, which then carries them as `sampling_per_token_logps` in
  each micro-batch, aligned with completion_ids (the path it uses for vLLM);
- the trainer's: the training forward of `_compute_loss`, read from `_get_per_token_logps_and_entropies` while it
  runs. With one generation per optimizer step and num_iterations 1 (this repo's settings) TRL uses that forward's
  detached log-probabilities as old_per_token_logps, so there is no extra forward; when TRL computed
  old_per_token_logps itself (generation not aligned with optimizer steps), those are used.

Cost: the sampler adds a logsumexp over [batch, vocab] per decode step (graph_decode: outside the captured graph,
next to the softmax it samples from); the trainer a few elementwise ops on [batch, completion] per micro-batch and
one reduction across processes per optimizer step.

IMPORTANCE_SAMPLING (TRL's vllm_importance_sampling_mode names, on any generation path): multiplies each token's
loss by w = exp(delta) truncated at IMPORTANCE_SAMPLING_CAP (token_truncate), or zeroed above it (token_mask), or the
same with delta summed over the sequence (sequence_truncate, sequence_mask), as TRL 1.16 corrects vLLM's samples.
Applied by scaling the micro-batch's advantages per token (TRL 1.16's _compute_loss takes [B, T] advantages): every
loss type but vespo is linear in a positive per-token weight, so that is TRL's per_token_loss * w.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tes_grpo.run.choices import IS_MODES

LOGP_MEAN = "sampling/sampling_logp_difference/mean"
LOGP_MAX = "sampling/sampling_logp_difference/max"
RATIO_MIN = "sampling/importance_sampling_ratio/min"
RATIO_MEAN = "sampling/importance_sampling_ratio/mean"
RATIO_MAX = "sampling/importance_sampling_ratio/max"
GEN_KL = "sampling/gen_kl_error"
METRICS = (LOGP_MEAN, LOGP_MAX, RATIO_MIN, RATIO_MEAN, RATIO_MAX, GEN_KL)


@dataclass(frozen=True)
class Correction:
    """IMPORTANCE_SAMPLING and IMPORTANCE_SAMPLING_CAP: mode in IS_MODES, cap = the ratio's upper bound."""

    mode: str = "off"
    cap: float = 3.0

    @property
    def on(self) -> bool:
        return self.mode != "off"

    @property
    def sequence_level(self) -> bool:
        return self.mode.startswith("sequence")


def correction_problem(mode: str, cap: float, loss_type: str) -> str | None:
    """Why IMPORTANCE_SAMPLING / IMPORTANCE_SAMPLING_CAP cannot work (None: they can); for the settings check."""
    if mode not in IS_MODES:
        return f"IMPORTANCE_SAMPLING={mode!r}: must be one of " + ", ".join(repr(m) for m in IS_MODES)
    if not (math.isfinite(cap) and cap > 0):
        return f"IMPORTANCE_SAMPLING_CAP={cap!r}: must be a finite number above 0"
    if mode != "off" and loss_type == "vespo":
        return ("IMPORTANCE_SAMPLING with LOSS_TYPE='vespo': vespo folds the correction into its own weights "
                "(TRL's vLLM path); use IMPORTANCE_SAMPLING=off")
    return None


def importance_weights(delta: torch.Tensor, mask: torch.Tensor, correction: Correction) -> torch.Tensor:
    """TRL 1.16's vLLM importance-sampling weights from delta = old - sampler log-probs [B, T]: [B, T] (token modes)
    or [B, 1] (sequence modes). Masked and NaN positions count as delta 0 (ratio 1), as TRL's do."""
    diff = torch.nan_to_num(delta * mask, nan=0.0)
    if correction.sequence_level:
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if correction.mode.endswith("truncate"):
        return ratio.clamp(max=correction.cap)
    return ratio.masked_fill(ratio > correction.cap, 0.0)


class GapWindow:
    """Sums of an optimizer step's token gaps (on the device, no host reads until `totals`)."""

    def __init__(self):
        self.parts: list[torch.Tensor] = []

    def add(self, delta: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor | None, sequence_level: bool):
        if delta.numel() == 0:
            return
        valid = mask.bool() & ~torch.isnan(delta)
        d = delta.double().masked_fill(~valid, 0.0)  # float64: e^d - d - 1 of a 1e-7 gap is 5e-15
        if weights is None:  # the ratio itself, per token
            values, keep = d.exp(), valid
        elif sequence_level:  # the weights applied, one per sequence
            values, keep = weights.double().flatten(), torch.ones(weights.numel(), dtype=torch.bool,
                                                                   device=weights.device)
        else:  # the weights applied, per token of the completion (NaN tokens have weight 1)
            values, keep = weights.double(), mask.bool()
        inf = torch.tensor(math.inf, device=d.device)
        self.parts.append(torch.stack([
            valid.sum().double(), d.abs().sum(), (d.exp() - d - 1).sum(), d.abs().amax(),
            keep.sum().double(), torch.where(keep, values, 0.0).sum(), torch.where(keep, values, inf).amin(),
            torch.where(keep, values, -inf).amax()]))

    def totals(self, accelerator) -> dict | None:
        """The step's metrics over every process (a collective: every process calls it at the same step), or None
        when nothing was added. Empties the window."""
        if not self.parts:
            return None
        parts, self.parts = torch.stack(self.parts), []
        local = torch.stack([parts[:, 0].sum(), parts[:, 1].sum(), parts[:, 2].sum(), parts[:, 4].sum(),
                             parts[:, 5].sum()])
        count, abs_sum, kl_sum, ratio_count, ratio_sum = accelerator.reduce(local, reduction="sum").tolist()
        highs = accelerator.gather(torch.stack([parts[:, 3].amax(), parts[:, 7].amax()])[None]).amax(dim=0).tolist()
        low = accelerator.gather(parts[:, 6].amin()[None]).amin().item()
        tokens, ratios = max(count, 1.0), max(ratio_count, 1.0)
        return {LOGP_MEAN: abs_sum / tokens, LOGP_MAX: highs[0] if count else 0.0,
                RATIO_MIN: low if ratio_count else 0.0, RATIO_MEAN: ratio_sum / ratios if ratio_count else 0.0,
                RATIO_MAX: highs[1] if ratio_count else 0.0, GEN_KL: kl_sum / tokens}


class GapMeter:
    """The sampler-trainer gap of each optimizer step, and IMPORTANCE_SAMPLING's weights (the module docstring): the
    trainer hands it each micro-batch that carries the sampler's log-probabilities (`measure`); `latest` holds the
    metrics of the latest step (benchmarks read it)."""

    def __init__(self, correction: Correction | None = None):
        self.correction = correction or Correction()
        self.windows = {"train": GapWindow(), "eval": GapWindow()}
        self.latest: dict = {}

    def measure(self, batch: dict, logps: torch.Tensor, mode: str, step_ends: bool, accelerator) -> dict | None:
        """Adds a micro-batch's gaps (batch: TRL 1.16's micro-batch inputs; logps: the trainer's log-probabilities of
        its completion tokens) to the window of `mode` ("train" or "eval") and, with the correction on, scales the
        batch's advantages by the weights. At the step's last micro-batch (`step_ends`: a collective, every process
        calls it at the same micro-batch) returns the step's metrics, else None."""
        mask = batch["completion_mask"] if "tool_mask" not in batch else batch["completion_mask"] * batch["tool_mask"]
        old = batch.get("old_per_token_logps")
        old = logps.detach() if old is None else old
        delta = old - batch["sampling_per_token_logps"]
        weights = importance_weights(delta, mask, self.correction) if self.correction.on else None
        if weights is not None:
            advantages = batch["advantages"]
            batch["advantages"] = (advantages.unsqueeze(1) if advantages.dim() == 1 else advantages) * weights
        self.windows[mode].add(delta, mask, weights, self.correction.sequence_level)
        if not step_ends:
            return None
        totals = self.windows[mode].totals(accelerator)
        if totals is not None:
            self.latest = totals
        return totals


def gap_summary(records: list[dict]) -> str | None:
    """One line on the sampler-trainer gap over a run's logged steps (metrics.jsonl's records, e.g. from
    run_folder.read_metrics), for the completion log's summary; None when no step logged it."""
    steps = [r for r in records if r.get(LOGP_MEAN) is not None]
    if not steps:
        return None
    kl = [r[GEN_KL] for r in steps if r.get(GEN_KL) is not None]
    gap = _mean(r[LOGP_MEAN] for r in steps)
    return (f"sampler vs trainer over {len(steps)} logged steps: mean |log p| gap {gap:.3g}"
            f" (last step {steps[-1][LOGP_MEAN]:.3g}), largest {max(r.get(LOGP_MAX) or 0.0 for r in steps):.3g}"
            + (f"; gen KL {_mean(kl):.3g} on average, {max(kl):.3g} at most (NeMo-RL's gpt-oss-20b check: < 0.002)"
               if kl else ""))


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)
