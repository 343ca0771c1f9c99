"""Every library patch, and every piece of the package's code that mirrors, overrides or relies on a library's
internals, with the library code concerned, the versions it was checked on and that code's fingerprints (see
tes_grpo/patches/__init__.py); tests/test_patches.py holds the installed libraries and the package to it.

    python -m tes_grpo.patches.registry                 # each patch's fingerprint on the installed libraries
    python -m tes_grpo.patches.registry UNPACKED_WHEEL  # the same from another version's files
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.metadata
import inspect
import io
import sys
import textwrap
import tokenize
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Patched:
    """One patch: `patch` is the project's code (relative to tes_grpo); `target` (module:qualified.name) the library
    code it mirrors, overrides, relies on or replaces; `checked` the (version of `library`, fingerprint of `target`
    there) pairs it was checked on. A patch relying on several pieces of library code has an entry for each."""

    patch: str
    library: str
    target: str
    checked: tuple[tuple[str, str], ...]


_GPT_OSS = "transformers.models.gpt_oss.modeling_gpt_oss:"
_GENERATE = "transformers.generation.utils:GenerationMixin."
_MOE = "transformers.integrations.moe:"
_GRPO = "trl.trainer.grpo_trainer:GRPOTrainer."
_LORA = "peft.tuners.lora.layer:Linear."

PATCHED = (  # patch, library, target, ((version, fingerprint), ...)
    # patches/: what replaces or wraps a library's code
    Patched("patches.torch_patches.saved_tensors_hooks_now", "torch",
            "torch._C._autograd:_top_saved_tensors_default_hooks",
            (("2.13.0", "111024718bb8"), ("2.11.0", "111024718bb8"))),
    Patched("patches.torch_patches.leave_process_group", "torch",
            "torch.distributed.distributed_c10d:destroy_process_group",
            (("2.13.0", "fdc2acfcea70"), ("2.11.0", "fdc2acfcea70"))),
    Patched("patches.transformers_patches.keep_grouped_mm_experts_for_decode", "transformers",
            "transformers.generation.utils:GenerationMixin._optimize_model_for_decode",
            (("5.24.0", "19ab4e651fd2"), ("5.17.0", "19ab4e651fd2"))),
    Patched("patches.transformers_patches.dequantized_experts_in_dtype", "transformers",
            "transformers.integrations.mxfp4:Mxfp4Dequantize.convert",
            (("5.24.0", "7f0c82749709"), ("5.17.0", "84b324c1894a"))),
    Patched("patches.transformers_patches.point_tensorboard", "transformers",
            "transformers.integrations.integration_utils:TensorBoardCallback._init_summary_writer",
            (("5.24.0", "8f51734bc71a"), ("5.17.0", "8f51734bc71a"))),
    Patched("patches.transformers_patches.flex_masks_with_padding_bounds", "transformers",
            "transformers.masking_utils:flex_attention_mask",
            (("5.24.0", "4f71cf65fad7"), ("5.17.0", "17c85ab8e856"))),
    Patched("patches.transformers_patches.flex_masks_with_padding_bounds", "transformers",
            "transformers.masking_utils:sliding_window_overlay",  # the window bounded_block_mask works out per block
            (("5.24.0", "6cc6cc7fc2e5"), ("5.17.0", "6cc6cc7fc2e5"))),
    Patched("patches.transformers_patches.flex_masks_with_padding_bounds", "transformers",
            "transformers.masking_utils:causal_mask_function",
            (("5.24.0", "71bbca9c4145"), ("5.17.0", "71bbca9c4145"))),
    Patched("patches.transformers_patches.flex_masks_with_padding_bounds", "torch",
            "torch.nn.attention.flex_attention:_convert_mask_to_block_mask",  # full and partial blocks, cut blocks
            (("2.13.0", "927ed8500d29"), ("2.11.0", "1bc38912edca"))),
    Patched("patches.transformers_patches.flex_masks_with_padding_bounds", "torch",
            "torch.nn.attention.flex_attention:_create_sparse_block_from_block_mask",  # called: block flags to lists
            (("2.13.0", "acc90be51062"), ("2.11.0", "59827f6d9cbc"))),
    Patched("patches.transformers_patches.rotary_embedding_in_training", "transformers",
            "transformers.models.gpt_oss.modeling_gpt_oss:GptOssAttention.forward",  # calls the patched name
            (("5.24.0", "3cdb5143b2e3"), ("5.17.0", "4c90f8c6cd75"))),
    Patched("patches.transformers_patches.rotary_embedding_in_training", "transformers",
            "transformers.models.gpt_oss.modeling_gpt_oss:apply_rotary_pos_emb",
            (("5.24.0", "01a839db2c8e"), ("5.17.0", "01a839db2c8e"))),
    Patched("patches.transformers_patches.flex_sinks_in_training", "transformers",
            "transformers.integrations.flex_attention:flex_attention_forward",
            (("5.24.0", "427e66caf9e5"), ("5.17.0", "427e66caf9e5"))),
    Patched("patches.trl_patches.score_only_completion_tokens_on_cpu", "trl",
            "trl.kernels.chunked_logprob:_use_triton",
            (("1.16.0", "41e2bdaf9a65"),)),
    Patched("patches.trl_patches.score_only_completion_tokens_on_cpu", "trl",
            "trl.trainer.utils:add_fused_lm_head",  # the call site of _use_triton the patch changes
            (("1.16.0", "2e2a772e2e61"),)),
    Patched("patches.trl_patches.quiet_all_rewards_none_warning", "trl",
            "trl.trainer.grpo_trainer:GRPOTrainer._calculate_rewards",
            (("1.16.0", "d5df91194300"),)),
    Patched("patches.transformers_patches.quiet_gradient_checkpointing_deprecation", "transformers",
            "transformers.modeling_utils:PreTrainedModel.is_gradient_checkpointing",  # the warning (5.17: none)
            (("5.24.0", "6c5d21dc1db4"), ("5.17.0", "9d800367be7d"))),
    Patched("patches.transformers_patches.quiet_gradient_checkpointing_deprecation", "trl",
            "trl.models.utils:_unwrap_model_for_generation",  # reads it around every generate() call
            (("1.16.0", "2b31cd6ad2f7"),)),
    Patched("patches.transformers_patches.quiet_gradient_checkpointing_deprecation", "peft",
            "peft.peft_model:PeftModel.__init__",  # reads it whenever a model is wrapped
            (("0.21.2", "980c72f95837"), ("0.21.0", "980c72f95837"))),
    Patched("patches.transformers_patches.quiet_mxfp4_fallback_warnings", "transformers",
            "transformers.quantizers.quantizer_mxfp4:Mxfp4HfQuantizer._process_model_before_weight_loading",
            (("5.24.0", "05277154ad76"), ("5.17.0", "fad9b02fa380"))),  # the CPU's warning, dequantize or not
    Patched("patches.transformers_patches.quiet_mxfp4_fallback_warnings", "transformers",
            "transformers.quantizers.quantizer_mxfp4:Mxfp4HfQuantizer.validate_environment",  # kernels, triton, GPU
            (("5.24.0", "1e081d3de839"), ("5.17.0", "9b1dc72faa98"))),
    Patched("patches.accelerate_patches.give_trainable_weights_storage", "accelerate",
            "accelerate.utils.fsdp_utils:fsdp2_switch_optimizer_parameters",
            (("1.15.0", "ef718eb8b1b5"),)),
    # code elsewhere in the package that overrides, mirrors or relies on a library's internals
    Patched("sampling.sampler.Sampler.generate", "transformers",
            "transformers.generation.utils:GenerationMixin.generate",  # synced_gpus, logits_processor, the output
            (("5.24.0", "5eb11517091e"), ("5.17.0", "89fe0eae9dc9"))),
    Patched("sampling.sampler.BaseWeightsKept", "trl",
            "trl.generation.vllm_generation:VLLMGeneration.sync_weights",
            (("1.16.0", "891eefcde1cb"),)),
    Patched("training.trainer.GptOssGRPOTrainer._generate_single_turn", "trl",
            "trl.trainer.grpo_trainer:GRPOTrainer._generate_single_turn",
            (("1.16.0", "00f3a766d295"),)),
    Patched("training.trainer.GptOssGRPOTrainer._compute_loss", "trl",
            "trl.trainer.grpo_trainer:GRPOTrainer._compute_loss",
            (("1.16.0", "24eeba60c27c"),)),
    Patched("training.trainer.GptOssGRPOTrainer._get_per_token_logps_and_entropies", "trl",
            "trl.trainer.grpo_trainer:GRPOTrainer._get_per_token_logps_and_entropies",
            (("1.16.0", "90405f3bc44e"),)),
    Patched("training.trainer.GptOssGRPOTrainer", "trl",
            _GRPO + "__init__",  # the attributes the class reads (use_vllm, vllm_generation, _last_loaded_step, ...)
            (("1.16.0", "46c8a60b9a3e"),)),
    Patched("training.trainer.GptOssGRPOTrainer._lengths_to_first_end", "trl",
            _GRPO + "_generate_single_turn",  # its completion mask: up to and including the first end token
            (("1.16.0", "00f3a766d295"),)),
    Patched("training.lm_head.full_logits_logps_and_entropies", "trl",
            "trl.trainer.utils:selective_log_softmax",
            (("1.16.0", "88ed89efac8f"),)),
    Patched("training.lm_head.full_logits_logps_and_entropies", "trl",
            "trl.trainer.utils:entropy_from_logits",
            (("1.16.0", "3dc42d16091d"),)),
    Patched("training.lm_head.full_logits_logps_and_entropies", "trl",
            _GRPO + "_get_per_token_logps_and_entropies",  # what it stands in for: logits_to_keep, temperature
            (("1.16.0", "90405f3bc44e"),)),
    Patched("training.lm_head.fused_head_tile", "trl",
            "trl.kernels.chunked_logprob:ChunkedLogProbFunction.forward",  # its tile of TOKEN_CHUNK_SIZE tokens
            (("1.16.0", "4a479a56a10a"),)),
    Patched("training.lm_head.fused_head_tile", "trl",
            "trl.trainer.utils:add_fused_lm_head",  # the vocabulary chunk it passes, _CHUNKED_LOGPROB_CHUNK_SIZE
            (("1.16.0", "2e2a772e2e61"),)),
    Patched("training.lm_head.uses_fused_lm_head", "trl",
            "trl.trainer.utils:add_fused_lm_head",  # binds _fused_forward to the instance
            (("1.16.0", "2e2a772e2e61"),)),
    Patched("sampling.decode_math.head_logits", "trl",
            "trl.kernels.chunked_logprob:ChunkedLogProbFunction.forward",
            (("1.16.0", "4a479a56a10a"),)),
    Patched("sampling.decode_math.head_logits", "trl",
            "trl.kernels.chunked_logprob:_addmm_fp32",
            (("1.16.0", "7e6c29e3aa0c"),)),
    Patched("sampling.decode_math.one_query_attention", "transformers",
            _GPT_OSS + "eager_attention_forward",
            (("5.24.0", "a442b7fb3b2f"), ("5.17.0", "a442b7fb3b2f"))),
    Patched("sampling.decode_math.decode_step", "transformers",
            _GPT_OSS + "GptOssForCausalLM.forward",
            (("5.24.0", "a5f53c0be37d"), ("5.17.0", "fde2dbb34f45"))),
    Patched("sampling.decode_math._decode_hidden", "transformers",
            _GPT_OSS + "GptOssModel.forward",
            (("5.24.0", "22642ad9f5d2"), ("5.17.0", "9cffb8936cab"))),
    Patched("sampling.decode_math._decode_hidden", "transformers",
            _GPT_OSS + "GptOssDecoderLayer.forward",
            (("5.24.0", "3f1744fa23e7"), ("5.17.0", "33a3662a39dc"))),
    Patched("sampling.decode_math._decode_hidden", "transformers",
            _GPT_OSS + "GptOssAttention.forward",
            (("5.24.0", "3cdb5143b2e3"), ("5.17.0", "4c90f8c6cd75"))),
    Patched("sampling.decode_math._decode_hidden", "transformers",
            _GPT_OSS + "GptOssMLP.forward",  # its output's first element
            (("5.24.0", "831c88d8dbb9"), ("5.17.0", "831c88d8dbb9"))),
    Patched("sampling.decode_math.flex_decode_kernel", "torch",
            "torch._inductor.kernel.flex.flex_decoding:create_flex_decoding_kernel",  # reads kernel_options' SPLIT_KV
            (("2.13.0", "902acda62e3e"), ("2.11.0", "656ea953f00c"))),
    Patched("sampling.decode_cache.keep_generator_registered", "torch",
            "torch.cuda.graphs:CUDAGraph.capture_begin",  # the capture whose generator registration it serves
            (("2.13.0", "269358b8d153"), ("2.11.0", "6ff7da3ad50c"))),
    Patched("sampling.decode_cache.StaticCache.fill", "transformers",
            "transformers.cache_utils:DynamicLayer.update",  # .keys / .values, the whole prompt
            (("5.24.0", "a7e8d331ff4f"), ("5.17.0", "a7e8d331ff4f"))),
    Patched("sampling.decode_cache.StaticCache.fill", "transformers",
            "transformers.cache_utils:DynamicSlidingWindowLayer.update",  # the last window - 1 positions kept
            (("5.24.0", "2cf5b821af6f"), ("5.17.0", "82c6fae934bb"))),
    Patched("sampling.decode_cache.StaticCache.masks", "transformers",
            "transformers.masking_utils:sliding_window_overlay",
            (("5.24.0", "6cc6cc7fc2e5"), ("5.17.0", "6cc6cc7fc2e5"))),
    Patched("sampling.decode_cache.StaticCache.masks", "transformers",
            "transformers.masking_utils:causal_mask_function",
            (("5.24.0", "71bbca9c4145"), ("5.17.0", "71bbca9c4145"))),
    Patched("sampling.decode_cache.prefill", "transformers",
            "transformers.cache_utils:DynamicCache.__init__",  # one layer per config layer, sliding where it slides
            (("5.24.0", "a8b427b9dbb5"), ("5.17.0", "0f6b40d10b24"))),
    Patched("sampling.decode_cache.prefill", "transformers",
            _GPT_OSS + "GptOssModel.forward",  # past_key_values (5.24 deprecates it for `cache`), position_ids
            (("5.24.0", "22642ad9f5d2"), ("5.17.0", "9cffb8936cab"))),
    Patched("sampling.decode_cache.checkpointing_off", "transformers",
            "transformers.modeling_layers:GradientCheckpointingLayer",  # drops the cache while gradient_checkpointing
            (("5.24.0", "40e0fb63a0b0"), ("5.17.0", "fd1155e9df61"))),
    Patched("sampling.token_sampling.logits_warpers", "transformers",
            _GENERATE + "_get_logits_processor",  # the warpers and their order
            (("5.24.0", "24134fe593fc"), ("5.17.0", "7e04698ccdb8"))),
    Patched("sampling.token_sampling.recording_blockers", "transformers",
            _GENERATE + "_get_logits_processor",  # the warpers logits_warpers leaves out
            (("5.24.0", "24134fe593fc"), ("5.17.0", "7e04698ccdb8"))),
    Patched("sampling.token_sampling.SampledLogprobs", "transformers",
            _GENERATE + "_get_logits_processor",  # custom processors before the warpers
            (("5.24.0", "24134fe593fc"), ("5.17.0", "7e04698ccdb8"))),
    Patched("sampling.token_sampling.SampledLogprobs", "transformers",
            _GENERATE + "_sample",  # processors called with (input_ids, scores), the chosen token appended
            (("5.24.0", "aaf97d4a469b"), ("5.17.0", "6bb07e363ba5"))),
    Patched("sampling.token_sampling.draw", "transformers",
            _GENERATE + "_sample",
            (("5.24.0", "aaf97d4a469b"), ("5.17.0", "6bb07e363ba5"))),
    Patched("sampling.graph_decode.generate", "transformers",
            _GENERATE + "_sample",
            (("5.24.0", "aaf97d4a469b"), ("5.17.0", "6bb07e363ba5"))),
    Patched("sampling.sampling_fidelity.importance_weights", "trl",
            _GRPO + "_generate_and_score_completions",  # vLLM's importance-sampling correction
            (("1.16.0", "7b910c5d3b65"),)),
    Patched("sampling.sampling_fidelity.GapMeter.measure", "trl",
            _GRPO + "_generate_and_score_completions",  # the micro-batch's keys
            (("1.16.0", "7b910c5d3b65"),)),
    Patched("sampling.sampling_fidelity.GapMeter.measure", "trl",
            _GRPO + "_compute_loss",  # completion and tool masks, [B] or [B, T] advantages
            (("1.16.0", "24eeba60c27c"),)),
    Patched("sampling.decode_linear.linear", "peft",
            _LORA + "forward",
            (("0.21.2", "d2be59d6c446"), ("0.21.0", "d2be59d6c446"))),
    Patched("layers.decode_glue.rms_norm", "transformers",
            _GPT_OSS + "GptOssRMSNorm.forward",
            (("5.24.0", "37184cecaff0"), ("5.17.0", "37184cecaff0"))),
    Patched("layers.decode_glue.residual_norm", "transformers",
            _GPT_OSS + "GptOssDecoderLayer.forward",
            (("5.24.0", "3f1744fa23e7"), ("5.17.0", "33a3662a39dc"))),
    Patched("layers.decode_glue.rope_qk", "transformers",
            _GPT_OSS + "apply_rotary_pos_emb",
            (("5.24.0", "01a839db2c8e"), ("5.17.0", "01a839db2c8e"))),
    Patched("layers.decode_glue.with_sinks", "transformers",
            "transformers.integrations.flex_attention:flex_attention_forward",
            (("5.24.0", "427e66caf9e5"), ("5.17.0", "427e66caf9e5"))),
    Patched("layers.decode_glue.add_lora", "peft",
            _LORA + "forward",
            (("0.21.2", "d2be59d6c446"), ("0.21.0", "d2be59d6c446"))),
    Patched("layers.train_glue.norm_training_forward", "transformers",
            _GPT_OSS + "GptOssRMSNorm.forward",
            (("5.24.0", "37184cecaff0"), ("5.17.0", "37184cecaff0"))),
    Patched("layers.train_glue.lora_training_forward", "peft",
            "peft.tuners.tuners_utils:BaseTunerLayer._cast_input_dtype",  # the cast it leaves out where exact
            (("0.21.2", "85da1d12a02e"), ("0.21.0", "85da1d12a02e"))),
    Patched("layers.train_glue.lora_training_forward", "peft",
            _LORA + "forward",
            (("0.21.2", "d2be59d6c446"), ("0.21.0", "d2be59d6c446"))),
    Patched("layers.train_glue.rms_norm", "transformers",
            _GPT_OSS + "GptOssRMSNorm.forward",
            (("5.24.0", "37184cecaff0"), ("5.17.0", "37184cecaff0"))),
    Patched("layers.train_glue.add_scaled", "peft",
            _LORA + "forward",
            (("0.21.2", "d2be59d6c446"), ("0.21.0", "d2be59d6c446"))),
    Patched("layers.train_glue.rope", "transformers",
            _GPT_OSS + "apply_rotary_pos_emb",
            (("5.24.0", "01a839db2c8e"), ("5.17.0", "01a839db2c8e"))),
    Patched("layers.train_glue.with_sinks", "transformers",
            "transformers.integrations.flex_attention:flex_attention_forward",
            (("5.24.0", "427e66caf9e5"), ("5.17.0", "427e66caf9e5"))),
    Patched("layers.train_glue.SinksInTraining", "transformers",
            "transformers.integrations.flex_attention:flex_attention_forward",  # (output, lse) without s_aux
            (("5.24.0", "427e66caf9e5"), ("5.17.0", "427e66caf9e5"))),
    Patched("layers.train_glue.SinksInTraining", "transformers",
            _GPT_OSS + "GptOssAttention.forward",  # how the attention function is called, s_aux the sinks
            (("5.24.0", "3cdb5143b2e3"), ("5.17.0", "4c90f8c6cd75"))),
    Patched("layers.lora.LowRank", "peft",
            _LORA + "forward",
            (("0.21.2", "d2be59d6c446"), ("0.21.0", "d2be59d6c446"))),
    Patched("layers.lora.lora_parts", "peft",
            _LORA + "forward",  # its branches: disabled, merged, active adapters, variants, dropout
            (("0.21.2", "d2be59d6c446"), ("0.21.0", "d2be59d6c446"))),
    Patched("layers.lora.merged_linear", "peft",
            _LORA + "get_delta_weight",
            (("0.21.2", "d72345fe5e39"), ("0.21.0", "d72345fe5e39"))),
    Patched("experts.fused_experts.fused_experts_forward", "transformers",
            _MOE + "grouped_mm_experts_forward",
            (("5.24.0", "715f1749627b"), ("5.17.0", "9c1959109fa6"))),
    Patched("experts.fused_experts.fused_experts_forward", "transformers",
            _MOE + "_grouped_linear",  # called: the grouped GEMMs and their CPU fallback
            (("5.24.0", "966c1d1469a7"), ("5.17.0", "966c1d1469a7"))),
    Patched("experts.fused_experts.bias_swiglu", "transformers",
            _GPT_OSS + "GptOssExperts._apply_gate",
            (("5.24.0", "cb87b1a3b116"), ("5.17.0", "cb87b1a3b116"))),
    Patched("experts.fused_experts.bias_weight_combine", "transformers",
            _MOE + "grouped_mm_experts_forward",
            (("5.24.0", "715f1749627b"), ("5.17.0", "9c1959109fa6"))),
    Patched("experts.fused_experts._training_forward", "transformers",
            _GPT_OSS + "GptOssExperts.forward",  # its signature, called for what the fused path does not take
            (("5.24.0", "b198a2438d28"), ("5.17.0", "b198a2438d28"))),
    Patched("experts.mxfp4.dequantize_mxfp4", "transformers",
            "transformers.integrations.mxfp4:convert_moe_packed_tensors",
            (("5.24.0", "d05d5b98542f"), ("5.17.0", "d05d5b98542f"))),
    Patched("experts.mxfp4_dequant.dequantize_experts", "transformers",
            "transformers.integrations.mxfp4:convert_moe_packed_tensors",
            (("5.24.0", "d05d5b98542f"), ("5.17.0", "d05d5b98542f"))),
    Patched("experts.mxfp4_experts.ResidentMxfp4Experts", "transformers",
            _MOE + "grouped_mm_experts_forward",  # reads gate_up_proj / down_proj once each within a call
            (("5.24.0", "715f1749627b"), ("5.17.0", "9c1959109fa6"))),
    Patched("experts.mxfp4_experts.ResidentMxfp4Experts", "torch",
            "torch.nn.modules.module:Module._apply",  # overridden: a private method, fn applied to each tensor
            (("2.13.0", "e5f2a605a906"), ("2.11.0", "e5f2a605a906"))),
    Patched("experts.mxfp4_decode.moe_forward", "transformers",
            _GPT_OSS + "GptOssMLP.forward",
            (("5.24.0", "831c88d8dbb9"), ("5.17.0", "831c88d8dbb9"))),
    Patched("experts.mxfp4_decode.moe_forward", "transformers",
            _GPT_OSS + "GptOssTopKRouter.forward",  # "fused" routing computes it: product, top-k, softmax
            (("5.24.0", "c688df3b8d7f"), ("5.17.0", "c688df3b8d7f"))),
    Patched("experts.mxfp4_decode.moe_forward", "transformers",
            _MOE + "grouped_mm_experts_forward",  # the roundings the kernel repeats, the float32 top-k sum
            (("5.24.0", "715f1749627b"), ("5.17.0", "9c1959109fa6"))),
    Patched("model.model_loading.resident_skeleton", "transformers",
            "transformers.modeling_utils:PreTrainedModel._init_weights",  # a rotary embedding's inv_freq
            (("5.24.0", "7d3b231777a7"), ("5.17.0", "20a0e65a9ca0"))),
    Patched("model.model_loading.resident_skeleton", "transformers",
            _GPT_OSS + "GptOssPreTrainedModel._init_weights",
            (("5.24.0", "ca07aa34136c"), ("5.17.0", "eaa1ffd5ee30"))),
    Patched("model.model_loading.load_resident_model", "transformers",
            "transformers.integrations.mxfp4:Mxfp4Dequantize.convert",  # what the dequantized load gives
            (("5.24.0", "7f0c82749709"), ("5.17.0", "84b324c1894a"))),
    Patched("model.gpt_oss_shapes._build_resident", "transformers",
            "transformers.modeling_utils:PreTrainedModel._init_weights",
            (("5.24.0", "7d3b231777a7"), ("5.17.0", "20a0e65a9ca0"))),
    Patched("model.gpt_oss_shapes._build_resident", "transformers",
            _GPT_OSS + "GptOssPreTrainedModel._init_weights",
            (("5.24.0", "ca07aa34136c"), ("5.17.0", "eaa1ffd5ee30"))),
    Patched("training.trainer.GptOssGRPOTrainer.prediction_step", "trl",  # evaluation without TRL's loss forward
            "trl.trainer.grpo_trainer:GRPOTrainer.prediction_step",
            (("1.16.0", "b4cf95fc8c3b"),)),
)


def resolve(target: str):
    """The object `module:qualified.name` names (a property's getter for a property), the library's own where a patch
    of this package has wrapped it (every wrapper here keeps the original as `wraps_original`)."""
    module_name, _, qualified = target.partition(":")
    obj = importlib.import_module(module_name)
    for part in qualified.split("."):
        found = inspect.getattr_static(obj, part) if inspect.isclass(obj) else getattr(obj, part)
        while hasattr(found, "wraps_original"):
            found = found.wraps_original
        obj = found.fget if isinstance(found, property) else getattr(found, "__func__", found)
    return obj


def _docstring_lines(tree: ast.AST) -> set[int]:
    """0-based line numbers of every module, class and function docstring in a parsed source."""
    lines = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            lines.update(range(body[0].lineno - 1, body[0].end_lineno))
    return lines


def code_fingerprint(source: str) -> str:
    """12 hex digits that change when the code in `source` changes, not its docstrings, comments or whitespace.
    Made from the text, not the syntax tree, so that every Python version gives the same digits for the same code
    (ast.dump differs between 3.11 and 3.12)."""
    source = textwrap.dedent(source)
    skip = _docstring_lines(ast.parse(source))
    lines = source.splitlines()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            row, col = token.start
            lines[row - 1] = lines[row - 1][:col]
    text = " ".join(" ".join(line for i, line in enumerate(lines) if i not in skip).split())
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def fingerprint(target: str) -> str:
    """code_fingerprint of `target`'s source; for a builtin without source, of its name and text signature."""
    obj = resolve(target)
    try:
        source = inspect.getsource(obj)
    except (OSError, TypeError):
        text = f"builtin {getattr(obj, '__qualname__', target)} {getattr(obj, '__text_signature__', None)}"
        return hashlib.sha256(text.encode()).hexdigest()[:12]
    return code_fingerprint(source)


def source_in_file(path, qualified: str) -> str | None:
    """The source of the function or class `qualified` (e.g. "Class.method") in a Python file, decorators included
    as inspect.getsource gives them, or None: how a library version that is not installed is fingerprinted from its
    files (a downloaded wheel, unpacked)."""
    text = Path(path).read_text(encoding="utf-8")
    scope = ast.parse(text).body
    node = None
    for part in qualified.split("."):
        # the last definition of a name is the one Python keeps (typing.overload stubs come before it)
        node = next((n for n in reversed(scope) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     and n.name == part), None)
        if node is None:
            return None
        scope = node.body
    first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
    return "\n".join(text.splitlines()[first - 1:node.end_lineno]) + "\n"


def fingerprint_in_folder(folder, target: str) -> str | None:
    """fingerprint of `target` as the package files under `folder` (an unpacked wheel) hold it, or None."""
    module, _, qualified = target.partition(":")
    base = Path(folder, *module.split("."))
    path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
    source = source_in_file(path, qualified) if path.is_file() else None
    return code_fingerprint(source) if source is not None else None


def main(argv: list[str]) -> int:
    """Prints each patch's fingerprint on the installed libraries, or, given a folder (an unpacked wheel of another
    version), on the files there."""
    if argv and not Path(argv[0]).is_dir():
        print(f"error: {argv[0]}: not a folder (give an unpacked wheel's folder, or nothing for the installed "
              "libraries)", file=sys.stderr)
        return 2
    for entry in PATCHED:
        if argv:
            print(f"{entry.patch}: {argv[0]} {entry.target} {fingerprint_in_folder(argv[0], entry.target)}")
        else:
            version = importlib.metadata.version(entry.library)
            print(f"{entry.patch}: {entry.library} {version} {entry.target} {fingerprint(entry.target)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
