"""The small steps between a decoder layer's products (norms, rotary embedding, attention sinks, LoRA adds), for the
decode step and the training forward, in the trainer's arithmetic.

- decode_glue: the decode step's norms, residual adds, rotary embedding, sink step and LoRA adds (DECODE_GLUE)
- train_glue: the training forward's norms, rotary embedding, sink step and LoRA adds, compiled on a GPU
- lora: LoRA's parts (A, B, scaling) read off a PEFT layer, batched for projections that share an input
"""
