"""The helpers the top-level scripts import, grouped by concern; nothing here is run directly (the scripts at the
repo's top level are). Each sub-package's docstring lists its modules. From the bottom up: a part imports only the
parts listed before it (tests/test_lint.py holds the package to that order):

- triton_support: whether Triton is installed and whether kernels run under its interpreter (imports nothing)
- run: settings and --NAME=value overrides, the run folder, files, processes, callbacks, trackers
- patches: the library patches, each with the versions it was checked on and a fingerprint test
- task: the TES plant and its exact Q-values, the operator's prompt, gpt-oss's Harmony format
- experts: the MoE experts: the MXFP4 codec and checkpoint files, resident MXFP4 experts, their kernels
- layers: the decode step's and the training forward's glue (norms, rotary, sinks, LoRA adds), LoRA's parts
- model: loading gpt-oss for training and evaluation, the tiny model, random 20B/120B-shaped models, the policy
- sampling: how completions are generated: graph_decode's static cache and CUDA graphs, its kernels, the sampler,
  the sampler-trainer gap
- training: the GRPO trainer, which fast paths a run takes, the LM head, the memory plan and the batch layout
"""
