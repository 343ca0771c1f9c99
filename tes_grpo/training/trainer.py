"""The GRPO trainer: TRL's GRPOTrainer with this project's sampler, the sampler-trainer gap measured every step, the
fast paths and the library fixes, everything given at construction (train_grpo.build_trainer builds it).

What it changes of TRL 1.16's GRPOTrainer, each in a method overridden here (patches/registry.py lists the TRL
methods with the versions they were checked on and their fingerprints, tests/test_patches.py holds TRL to them):

- `_generate_single_turn`: transformers' path generates through the Sampler (graph_decode or transformers' generate,
  sampling/sampler.py) and returns the sampled tokens' log-probabilities, which TRL gives only for vLLM; vLLM's path
  syncs the weights with the frozen base kept bit for bit (sampler.BaseWeightsKept), then runs TRL's own.
- `_compute_loss` and `_get_per_token_logps_and_entropies`: each micro-batch's sampler log-probabilities are set
  beside the training forward's (sampling_fidelity.GapMeter: TRL's sampling/* metrics, every step, every path) and
  IMPORTANCE_SAMPLING's weights scale its advantages; with `full_logits` set the log-probabilities come from the whole
  logits instead of TRL's fused LM head (lm_head.py; the memory benchmark's variant, never training's). In
  evaluation, a forward TRL runs on the whole evaluation batch (old log-probabilities with GENERATION_STEPS > 1, the
  reference model's with BETA > 0) goes in passes of the training's micro-batch, which the memory plan counted.
- `prediction_step`: an evaluation generates, scores and logs (TRL's _prepare_inputs in eval mode) and computes no
  loss: the GRPO loss of on-policy samples says nothing about the policy, and TRL's forward for it would take the
  whole evaluation batch at once (run/evaluation.py says what is evaluated).
- `evaluate` (HF Trainer's): every evaluation samples from the same random numbers (torch seeded with SEED), and
  the training's random state is put back after it, so checkpoints are compared on the same draws and a run trains
  the same with evaluation on or off.

At construction, after TRL has wrapped the model in LoRA and decided on FSDP, it decides the fast paths once
(fast_paths.choose), installs the training side of them and the library fixes, and builds the sampler.
"""

from __future__ import annotations

import torch
import trl
from trl import GRPOTrainer
from trl.extras.profiling import profiling_context
from trl.models import unwrap_model_for_generation
from trl.trainer.utils import pad

from tes_grpo.patches import fixes
from tes_grpo.run.processes import SayOnce
from tes_grpo.sampling.sampler import BaseWeightsKept, Sampler
from tes_grpo.sampling.sampling_fidelity import Correction, GapMeter
from tes_grpo.training import fast_paths
from tes_grpo.training.lm_head import full_logits_logps_and_entropies

TRL_SERVED = "1.16"  # the TRL version whose private GRPOTrainer methods this class overrides
OVERRIDDEN = ("_generate_single_turn", "_compute_loss", "_get_per_token_logps_and_entropies", "prediction_step")


def sampler_problem(backend: str, use_vllm: bool, trl_correction: bool) -> str | None:
    """Why a sampler of `backend` cannot serve a trainer whose TRL config has `use_vllm` and TRL's own vLLM
    importance-sampling correction `trl_correction` (None: it can)."""
    if (backend == "vllm") != use_vllm:
        return f"sampler {backend!r}, but TRL's use_vllm is {use_vllm} (USE_VLLM and the trainer's config disagree)"
    if use_vllm and trl_correction:
        return ("TRL's own vLLM importance sampling is on; set vllm_importance_sampling_correction=False "
                "(IMPORTANCE_SAMPLING corrects every path)")
    return None


class GptOssGRPOTrainer(GRPOTrainer):
    """GRPOTrainer (TRL 1.16) for gpt-oss with LoRA: GRPOTrainer's arguments, and
    settings: train_grpo's Settings (the fast-path settings, IMPORTANCE_SAMPLING and its cap);
    generation_sequences: the most sequences a generate call may take (the memory plan's; None = a whole batch);
    tensorboard_dir, resume_step: where TensorBoard writes, and the step a resumed run restarts from;
    measure_gap: measure the sampler-trainer gap every step (False only to time what it costs: no sampled
    log-probabilities are recorded, and IMPORTANCE_SAMPLING must be off);
    say: where the log lines go.
    Attributes besides GRPOTrainer's: `sampler` (None under vLLM), `gap` (the GapMeter, None without measure_gap),
    `full_logits` (False: TRL's fused LM head scores)."""

    def __init__(self, *args, settings, generation_sequences: int | None = None, tensorboard_dir=None,
                 resume_step: int | None = None, measure_gap: bool = True, say=print, **kwargs):
        missing = [name for name in OVERRIDDEN if not hasattr(GRPOTrainer, name)]
        if missing:
            raise RuntimeError(f"GptOssGRPOTrainer: TRL {trl.__version__}'s GRPOTrainer has no {', '.join(missing)} "
                               f"(this class overrides TRL {TRL_SERVED}'s)")
        correction = Correction(settings.IMPORTANCE_SAMPLING, settings.IMPORTANCE_SAMPLING_CAP)
        if correction.on and not measure_gap:
            raise ValueError("IMPORTANCE_SAMPLING needs the gap measured (measure_gap=True)")
        fixes.quiet_library_warnings()  # TRL warns from its constructor on
        super().__init__(*args, **kwargs)
        if not trl.__version__.startswith(TRL_SERVED + "."):
            say(f"note: GptOssGRPOTrainer overrides TRL {TRL_SERVED}'s private GRPOTrainer methods; this is TRL "
                f"{trl.__version__} (they exist: check that sampling/* are logged)")
        self.say, self.full_logits, self._scored_batch = say, False, None
        self._say_once = SayOnce(say)
        paths = fast_paths.choose(settings, self, self.accelerator.device.type == "cuda", generation_sequences)
        problem = sampler_problem(paths.sampler.backend, bool(self.use_vllm),
                                  bool(getattr(self, "vllm_importance_sampling_correction", False)))
        if problem:
            raise ValueError(f"GptOssGRPOTrainer: {problem}")
        for line in fixes.install(self, tensorboard_dir, resume_step) + fast_paths.install(self, paths):
            say(line)
        self.gap = GapMeter(correction) if measure_gap else None
        self.sampler = None if self.use_vllm else Sampler(paths.sampler, record=measure_gap, say=say)
        self._base_weights_kept = BaseWeightsKept(self.model) if self.use_vllm else None
        if self.use_vllm:
            say("vLLM: the base weights are copied before each weight sync and restored after it (TRL merges the "
                "adapter into them in place; sampler.BaseWeightsKept)")
        spec = paths.sampler
        say("sampling metrics: " + ("off (measure_gap=False)" if not measure_gap else
            "the sampler's log-probabilities against the trainer's every step (sampling/*, "
            + ("vLLM's" if spec.backend == "vllm" else "recorded while generating")
            + f"); IMPORTANCE_SAMPLING={correction.mode}" + (f" (cap {correction.cap})" if correction.on else ""))
            + (f"; graph_decode decodes under the trainer's autocast ({spec.autocast})"
               if spec.backend == "graph_decode" and spec.autocast else ""))

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """TRL 1.16's _generate_single_turn: (completion ids per prompt row, sampled log-probabilities or None)."""
        if self.use_vllm:
            if self.state.global_step != self._last_loaded_step:  # TRL's own sync, with the frozen base kept
                with profiling_context(self, "sync_weights"):
                    self._base_weights_kept(self.vllm_generation.sync_weights)
                self._last_loaded_step = self.state.global_step
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                 has_tool_images)
        if images is not None or multimodal_fields or has_tool_images or self.use_transformers_continuous_batching:
            raise ValueError("GptOssGRPOTrainer generates from text prompts with generate() only (no images, no "
                             "continuous batching)")
        # TRL 1.16's regular generation path, the sampler in place of the model's generate()
        prompts = [torch.tensor(ids) for ids in prompt_ids]
        inputs = super(GRPOTrainer, self)._prepare_inputs({  # as TRL's: the Trainer's, which moves them to the device
            "input_ids": pad(prompts, padding_value=self._tokenizer.pad_token_id, padding_side="left",
                             pad_to_multiple_of=self.pad_to_multiple_of),
            "attention_mask": pad([torch.ones_like(t) for t in prompts], padding_value=0, padding_side="left",
                                  pad_to_multiple_of=self.pad_to_multiple_of)})
        with (profiling_context(self, "transformers.generate"),
              unwrap_model_for_generation(self.model_wrapped, self.accelerator,
                                          gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                                          generation_kwargs=self.generation_kwargs,
                                          gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs)
              as unwrapped_model,
              torch.no_grad(),
              self._dist.summon_full_params(self.model_wrapped, recurse=False)):
            sequences, sampled = self.sampler.generate(unwrapped_model, inputs["input_ids"], inputs["attention_mask"],
                                                       self.generation_config)
        completions = sequences[:, inputs["input_ids"].size(1):]
        completion_ids = [row[:length].tolist() for row, length in
                          zip(completions.cpu(), self._lengths_to_first_end(completions).cpu(), strict=True)]
        return completion_ids, self._per_completion(sampled, completion_ids)

    def _lengths_to_first_end(self, completions: torch.Tensor) -> torch.Tensor:
        """Each row's tokens up to and including its first end token (all of them without one), as TRL 1.16 masks."""
        is_end = torch.isin(completions, torch.tensor(self.eos_token_ids, device=completions.device))
        ended = is_end.any(dim=1)
        return torch.where(ended, is_end.int().argmax(dim=1) + 1, completions.size(1))

    def _per_completion(self, sampled: torch.Tensor | None, completion_ids: list[list[int]]) -> list | None:
        """The sampled log-probabilities cut to each completion as its ids were (None: not recorded, said once)."""
        if sampled is None:
            if self.gap is not None:
                self._say_once("sampling metrics: this generation path gave no sampled log-probabilities; "
                               "sampling/* are not logged" + (" and IMPORTANCE_SAMPLING is not applied"
                                                              if self.gap.correction.on else ""))
            return None
        rows = sampled.float().cpu()
        if rows.shape[0] != len(completion_ids) or any(len(ids) > rows.shape[1] for ids in completion_ids):
            raise RuntimeError(f"sampling metrics: {tuple(rows.shape)} log-probabilities for {len(completion_ids)} "
                               f"completions of up to {max(map(len, completion_ids), default=0)} tokens")
        return [rows[i, :len(ids)].tolist() for i, ids in enumerate(completion_ids)]

    def _compute_loss(self, model, inputs):
        """TRL 1.16's _compute_loss on a copy of the micro-batch (the gap measurement may scale its advantages)."""
        self._scored_batch = dict(inputs)
        try:
            return super()._compute_loss(model, self._scored_batch)
        finally:
            self._scored_batch = None

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **kwargs):
        """TRL 1.16's (log-probabilities, entropies, aux loss); inside _compute_loss also measures (and corrects) the
        sampler-trainer gap of the micro-batch."""
        if batch_size is not None and not self.model.training:  # evaluation: in the training's passes
            batch_size = min(batch_size, self.args.per_device_train_batch_size)
        if self.full_logits:
            if compute_aux_loss or any(value is not None for value in kwargs.values()):
                raise ValueError("full_logits covers text-only batches without the MoE aux loss")
            with self.accelerator.autocast():
                logps, entropies = full_logits_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                                   self.temperature, compute_entropy)
            aux_loss = None
        else:
            logps, entropies, aux_loss = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                **kwargs)
        batch, self._scored_batch = self._scored_batch, None  # only _compute_loss's own call, once
        if self.gap is not None and batch is not None and batch.get("sampling_per_token_logps") is not None:
            mode = "train" if self.model.training else "eval"
            totals = self.gap.measure(batch, logps, mode, mode == "eval" or self.accelerator.sync_gradients,
                                      self.accelerator)
            for name, value in (totals or {}).items():
                self._metrics[mode][name].append(value)
        return logps, entropies, aux_loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """TRL 1.16's prediction_step without its loss: generates, scores and logs the evaluation batch (TRL's
        _prepare_inputs in eval mode); returns no loss, logits or labels."""
        self._prepare_inputs(inputs)
        return None, None, None

    def evaluate(self, *args, **kwargs):
        """HF Trainer's evaluate (TRL's evaluation loop) from the same random numbers every time, the training's own
        random state restored after it."""
        cuda = self.accelerator.device.type == "cuda"
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if cuda else []):
            torch.manual_seed(self.args.seed)
            return super().evaluate(*args, **kwargs)
