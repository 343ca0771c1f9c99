"""gpt-oss models: loading them for training and evaluation, and the stand-ins the CPU and the benchmarks use.

- model_loading: device, dtype, attention, the experts' form, the tokenizer, the training and evaluation loaders
- tiny_model: the tiny MXFP4 gpt-oss the CPU runs and tests use
- gpt_oss_shapes: gpt-oss-20b's and -120b's shapes with random weights (benchmarks)
- llm_policy: base + adapter as the plant's operator: load, sample Harmony completions, read actions
"""
