"""The trainer's sampler: how GRPO's completions are generated, in one object (`Sampler`).

training/fast_paths.py decides a SamplerSpec once per run; the trainer (training/trainer.py) builds the Sampler it
names and calls `Sampler.generate` where TRL would call the model's generate():

- graph_decode (graph_decode.py's static KV cache and CUDA-graph decode steps), for the calls whose options it
  implements, in calls of at most `max_batch` sequences when the memory plan splits a generation batch;
- transformers' generate() for the rest, with `synced_gpus=True` under FSDP (every process keeps stepping until all
  are done) and token_sampling.SampledLogprobs as its last logits processor;
- under vLLM the trainer calls TRL's own generation (vLLM returns the log-probabilities itself), and
  `BaseWeightsKept` keeps the frozen base weights as they are across TRL's weight sync.

Each call returns the sampled tokens' log-probabilities with the sequences, which the trainer sets beside the
trainer's own every step (sampling_fidelity.py). What a call cannot record or graph_decode cannot take is said once.
The sampler reads generate()'s options and transformers' generate itself; patches/registry.py lists the library
code this mirrors with the versions it was checked on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from transformers import LogitsProcessorList

from tes_grpo.layers.lora import causal_lm
from tes_grpo.run.processes import SayOnce
from tes_grpo.sampling.graph_decode import generate_in_calls, unsupported_options
from tes_grpo.sampling.token_sampling import SampledLogprobs, logits_warpers, recording_blockers

BACKENDS = ("graph_decode", "generate", "vllm")


@dataclass(frozen=True)
class SamplerSpec:
    """What the sampler is: backend (one of BACKENDS); for graph_decode, its experts ("model" or "mxfp4"), lora
    ("peft" or "merged"), glue ("eager" or "compiled": decode_glue) and max_batch (rows a generate call takes at
    most; None = the whole batch); autocast: the dtype the trainer's forward runs under autocast in (graph_decode
    decodes under it; None = none); synced: FSDP shards the weights over several processes, which must step
    together."""

    backend: str
    experts: str = "model"
    lora: str = "peft"
    glue: str = "eager"
    max_batch: int | None = None
    autocast: torch.dtype | None = None
    synced: bool = False

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"SamplerSpec: backend must be one of {BACKENDS}, got {self.backend!r}")


def training_autocast(trainer) -> torch.dtype | None:
    """The dtype the trainer's forward runs under autocast in (accelerate's mixed precision), or None."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(trainer.accelerator.mixed_precision))


class Sampler:
    """Generates completions as `spec` says (not for vLLM, whose generation TRL runs): `generate` returns the prompt +
    completion ids [B, prompt + n], as transformers' generate() returns them, and the log-probability [B, n]
    (float32) of each sampled token under the distribution it was drawn from, or None where it was not recorded
    (`record` off, or options SampledLogprobs cannot follow, said once). `say` says what a call falls back to."""

    def __init__(self, spec: SamplerSpec, record: bool = True, say=print):
        if spec.backend == "vllm":
            raise ValueError("Sampler: vLLM generates through TRL's own VLLMGeneration, not a Sampler")
        self.spec, self.record, self.say = spec, record, say
        self.say_once = SayOnce(say)

    def generate(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 generation_config) -> tuple[torch.Tensor, torch.Tensor | None]:
        """model: what TRL unwraps for generation (the PEFT model under LoRA); generation_config: the trainer's.
        transformers 5.17-5.24's generate() takes the calls graph_decode does not: with synced_gpus under FSDP (every
        process steps until all are done; transformers sets it itself only for its own FSDP integration, not
        accelerate's) and SampledLogprobs as its last logits processor, returning the ids tensor."""
        config = generation_config if generation_config is not None else causal_lm(model).generation_config
        blockers = recording_blockers(config) if self.record else []
        if blockers:
            self.say_once(f"sampling metrics: not recorded for this generate call ({', '.join(blockers)})")
        record = self.record and not blockers
        if self.spec.backend == "graph_decode":
            reasons = unsupported_options(config, {}) + ([] if input_ids is not None else ["no input_ids"])
            if not reasons:
                return generate_in_calls(causal_lm(model), input_ids, attention_mask, config, self.spec.max_batch,
                                         record, experts=self.spec.experts, lora=self.spec.lora,
                                         autocast=self.spec.autocast, glue=self.spec.glue, say=self.say)
            self.say_once(f"DECODE_GRAPHS: this generate call uses transformers' generate ({', '.join(reasons)} "
                          "not supported)")
        recorder = SampledLogprobs(logits_warpers(config)) if record else None
        options = {"synced_gpus": True} if self.spec.synced else {}
        if recorder is not None:
            options["logits_processor"] = LogitsProcessorList([recorder])
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=generation_config,
                             **options)
        sequences = out if isinstance(out, torch.Tensor) else out.sequences
        return sequences, recorder.result(sequences, input_ids.shape[1]) if recorder is not None else None


def adapter_base_parameters(model) -> list:
    """The frozen parameters of every PEFT adapter layer's base layer (what PEFT's merge_adapter writes into):
    nn.Linear weights and biases under LoRA, the experts' tensors under target_parameters."""
    found = {}
    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            for param in module.get_base_layer().parameters(recurse=False):
                if not param.requires_grad:
                    found[id(param)] = param
    return list(found.values())


class BaseWeightsKept:
    """TRL 1.16 (trl/generation/vllm_generation.py, VLLMGeneration.sync_weights): keeps the frozen base weights bit
    for bit across every weight sync to vLLM: `kept(sync)` copies the adapter layers' base weights, runs the sync and
    writes them back.

    To send vLLM the adapted weights, TRL calls PEFT's merge_adapter() (W += delta, in place, in the trainer's own
    bf16 base weights), reads them, then unmerge_adapter() (W -= delta). In bf16, W + delta - delta is not W: each
    sync moves some base elements by an ulp, and the frozen base, the policy's starting point, drifts a little more
    every step (tests/test_sampling_fidelity.py measures it). vLLM still gets the merged weights; the trainer's base
    never changes. The copies live on the CPU (pinned when the weights are on a GPU, so the copies are fast) and are
    kept between syncs: a copy of the attention projections' weights to pinned CPU memory and back per sync.
    """

    def __init__(self, model):
        self.model = model
        self.saved: list | None = None

    def __call__(self, sync):
        if self.saved is None:
            params = adapter_base_parameters(self.model)
            self.saved = [(p, torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=p.is_cuda))
                          for p in params]
        with torch.no_grad():
            for param, copy in self.saved:
                copy.copy_(param.detach())
        try:
            return sync()
        finally:
            with torch.no_grad():
                for param, copy in self.saved:
                    param.data.copy_(copy)
