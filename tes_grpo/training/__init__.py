"""Training with GRPO on one GPU (or several): the trainer, which fast paths a run takes, the LM head, the memory
plan.

- trainer: TRL's GRPOTrainer with the project's sampler, the sampler-trainer gap and the fast paths, given at
  construction
- fast_paths: which sampler and kernels a run takes, decided once
- lm_head: TRL's fused LM head, which never builds a micro-batch's logits
- memory_plan: completions a training pass and sequences a generate call from the GPU's memory; the batch layout
"""
