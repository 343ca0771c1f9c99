"""The helpers the top-level scripts import; nothing here is run directly (the scripts at the repo's top level are).

The task and its data:
- tes_env: the TES plant, its exact Q-values (QSolver), rule policies, the closed loop (simulate_batch)
- task_prompt: the operator's prompt for a state, and the two-part text the Q datasets store
- harmony: gpt-oss's Harmony format: the tokenizer, rendering prompts, reasoning effort, token ids, parse_action

Settings, files and runs:
- script_config: --NAME=value overrides resolved once into one Settings object; the settings table's choices
- presets: the MODEL_ID=tiny preset train_grpo.py and step_stream.py share
- fileio: the one CSV reader, atomic writes, input errors that name file, row, column and value
- run_folder: checkpoints, resume (torn files included), log trimming; the adapter check and the training run's
  settings that evaluation and export follow
- callbacks: metrics.jsonl, one progress line per step, zero-padded checkpoint names
- processes: rank-aware helpers for accelerate launch
- trackers: where the metrics go besides metrics.jsonl (REPORT_TO)
- oom: a run out of GPU memory: one message naming the step, the setting to lower and where --RESUME=1 continues

Models:
- model_loading: device, dtype, attention, the experts' form, the tokenizer, the training and evaluation loaders
- mxfp4: the MXFP4 codec and checkpoint writer
- mxfp4_experts: the frozen experts resident as MXFP4, for training and sampling (EXPERTS)
- tiny_model: the tiny MXFP4 gpt-oss the CPU runs and tests use
- gpt_oss_shapes: gpt-oss-20b's and -120b's shapes with random weights (benchmarks)
- llm_policy: base + adapter as the plant's operator: load, sample Harmony completions, read actions

Training on a GPU:
- memory_plan: completions a training pass and sequences a generate call from the GPU's memory; the batch layout
- fast_paths: which sampler and kernels a run takes, decided once
- choices: the training settings' fixed value sets, importable without torch
- sampler: the trainer's sampler, assembled in one function (backend, FSDP sync, log-prob recorder, vLLM guard)
- graph_decode: sampling with a static KV cache and CUDA-graph decode steps, in the trainer's arithmetic
- decode_cache: graph_decode's static KV cache, its prefill and the CUDA-graph capture of decode steps
- decode_glue: the decode step's norms, residual adds, rotary embedding, sink step and LoRA adds (DECODE_GLUE)
- decode_math: graph_decode's decode step: attention with sinks, LoRA in PEFT's order, MXFP4 experts, the LM head
- decode_attention: the decode step's one-query attention over the KV cache as one Triton kernel
- decode_linear: the decode step's attention projections, the adapter's output added in PEFT's order (Triton)
- token_sampling: one sampling step as transformers' generate takes it, and the recorder of its log-probabilities
- mxfp4_decode: the MoE experts read as MXFP4 while decoding (Triton)
- mxfp4_kernels: the MXFP4 experts' Triton kernels: decoding's experts product, training's dequantization
- moe_routing: the decode step's router top-k and its rows sorted by expert in one Triton program, as torch gives them
- fused_experts: the MoE experts' elementwise work fused for the training forward and backward
- train_glue: the training forward's norms, rotary embedding, sink step and LoRA adds, compiled on a GPU
- lm_head: TRL's fused LM head, which never builds a micro-batch's logits
- sampling_fidelity: the sampler-trainer gap measured every step, and IMPORTANCE_SAMPLING

Library patches (patches/, one module per library, each patch with the versions it was checked on):
- patches: torch_patches, transformers_patches, trl_patches, accelerate_patches
- patches.registry: every patch, the library function it relies on and that function's fingerprints
- patches.fixes: the corrections every run needs, in one call; the speed patches are fast_paths' choice
"""
