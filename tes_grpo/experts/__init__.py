"""gpt-oss's MoE experts: the MXFP4 format, the frozen experts kept resident in it, and the kernels that read it.

- mxfp4: the MXFP4 codec and the tile layouts its kernels read
- mxfp4_checkpoint: MXFP4 checkpoint files: the lazy reader, the writer, config.json and the tokenizer files
- mxfp4_experts: the frozen experts resident as MXFP4, for training and sampling (EXPERTS)
- mxfp4_dequant: MXFP4 expert weights dequantized to transformers' values, by the Triton kernel or torch's codec
- mxfp4_kernels: the MXFP4 experts' Triton kernels: decoding's experts product, training's dequantization
- mxfp4_decode: the MoE experts read as MXFP4 while decoding (Triton)
- moe_routing: the decode step's router top-k and its rows sorted by expert in one Triton program, as torch gives them
- fused_experts: the MoE experts' elementwise work fused for the training forward and backward
"""
