"""The helpers the top-level scripts import: the TES plant and its exact Q-values (tes_env), settings (script_config),
file writing (fileio), model loading (model_loading), library workarounds (workarounds), the tiny gpt-oss
(tiny_model), MXFP4 (mxfp4), static-cache CUDA-graph decoding (graph_decode), the LLM as the plant's operator
(llm_policy), several processes (processes), the tokenizer (gpt_oss_tokenizer) and gpt-oss-20b shapes (gpt_oss_shapes).

Nothing here is run directly; the scripts at the repo's top level are.
"""
