"""How GRPO's completions are generated, and how closely they follow the policy being trained.

- sampler: the trainer's sampler: transformers' generate, graph_decode or vLLM, with the sampled log-probabilities
- graph_decode: sampling with a static KV cache and CUDA-graph decode steps, in the trainer's arithmetic
- decode_cache: graph_decode's static KV cache, its prefill and the CUDA-graph capture of decode steps
- decode_math: graph_decode's decode step: attention with sinks, LoRA in PEFT's order, MXFP4 experts, the LM head
- decode_attention: the decode step's one-query attention over the KV cache as one Triton kernel
- decode_linear: the decode step's attention projections, the adapter's output added in PEFT's order (Triton)
- token_sampling: one sampling step as transformers' generate takes it, and the recorder of its log-probabilities
- draw_kernel: a sampling step's draw and log-probability in three Triton launches, from torch.multinomial's numbers
- sampling_fidelity: the sampler-trainer gap measured every step, and IMPORTANCE_SAMPLING
"""
