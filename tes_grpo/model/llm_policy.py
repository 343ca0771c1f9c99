"""gpt-oss (+ an optional LoRA adapter) as the TES operator: load it, sample Harmony completions, read the actions.

Not a script: `test_lora_adapter.py`, `test_lora_adapter_quantized.py` and `evaluate_policy.py` import it.

- `load_policy_model(base_model_id, adapter_path, quantized, device, dtype, attn_implementation)`: the base
  loaded as training loads it (model_loading.load_for_inference: the MXFP4 experts resident as MXFP4, so a model
  evaluates on the GPU it trained on), with the adapter on top; quantized=True says when the experts could not stay
  MXFP4. The weights are loaded once: `generate(..., use_adapter=False)` runs the same model inside PEFT's
  `disable_adapter()`.
- `generate(...)`: `samples` completions per prompt, in batches, each batch seeded with `seed + batch index`, so
  the adapter pass and the base pass with the same batching draw from the same random streams. On a GPU, batches of
  GROUPED_MM_MIN_BATCH or more sequences keep the grouped_mm experts while decoding (measured faster; see there).
- A completion is cut after its first stop token (<|return|>, <|call|>, <|endoftext|>: the generation config's
  end tokens); one that hit `max_new_tokens` first is `truncated`. Actions come from `harmony.parse_action`
  (the last `[k]` in the final channel), None when invalid or truncated.
- `majority_vote(actions)`: the most frequent valid action (ties go to the lowest action), None when none is valid.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import sys
from pathlib import Path
from typing import Sequence

import torch
from peft import PeftModel
from tqdm import tqdm

from tes_grpo.layers.lora import causal_lm
from tes_grpo.model.model_loading import (
    dtype_name,
    load_for_inference,
    load_tokenizer_for,
    resolve_attention,
    resolve_device,
    resolve_dtype,
    resolve_model_path,
)
from tes_grpo.patches.transformers_patches import (
    grouped_mm_experts_for_decode,
    quiet_gradient_checkpointing_deprecation,
)
from tes_grpo.run.adapter_folder import adapter_base_model, adapter_expert_layers, lora_adapter_config
from tes_grpo.run.fileio import InputError
from tes_grpo.run.sources import check_model_id
from tes_grpo.task.harmony import HARMONY_GLOB, STOP_TOKEN_IDS, harmony_csv_files, parse_action

# From this many sequences per generate call on a GPU, the dequantized experts keep grouped_mm while decoding instead of
# transformers' switch to batched_mm, which was faster only below it (BENCHMARKS.md, "Generation alone: which experts
# implementation decodes").
GROUPED_MM_MIN_BATCH = 16


@dataclasses.dataclass(frozen=True)
class Completion:
    """One sampled completion, with the Harmony special tokens kept."""
    text: str  # decoded up to and including the first stop token (all of it when truncated)
    n_tokens: int  # generated tokens up to and including the stop token
    truncated: bool  # no stop token within max_new_tokens
    action: int | None  # data_reward.parse_action(text); None when invalid or truncated


@dataclasses.dataclass
class PolicyModel:
    """A loaded base model (a PeftModel when an adapter is on it) with its tokenizer and how it was loaded."""
    model: object
    tokenizer: object
    base_model_id: str
    adapter_path: str  # "" when no adapter
    device: str
    dtype: str
    attention: str
    experts: str  # how the MoE expert weights were loaded, in words
    experts_resident: bool  # True when the experts stay resident as MXFP4 (mxfp4_experts.py)
    stop_token_ids: frozenset

    @property
    def has_adapter(self) -> bool:
        return bool(self.adapter_path)


def prompt_files(path: str | Path) -> list[Path]:
    """A Harmony CSV, or every *_harmony.csv under a folder (sorted); InputError when there is none."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise InputError(path, "prompt file or folder does not exist")
    files = harmony_csv_files(path)
    if not files:
        raise InputError(path, f"no {HARMONY_GLOB} files in this folder (run the data pipeline first)")
    return files


def load_policy_model(base_model_id: str = "", adapter_path: str = "", quantized: bool = False,
                      device: str = "auto", dtype: str = "auto", attn_implementation: str = "auto") -> PolicyModel:
    """Base model (from the adapter's config when base_model_id is "") with the adapter on top, ready to generate.

    The base loads as training loaded it (model_loading.load_for_inference): an MXFP4 checkpoint keeps its experts
    resident as MXFP4 on any device, unless the adapter has LoRA on the expert weights, which PEFT applies to bf16
    experts only. quantized=True (test_lora_adapter_quantized.py) computes in bf16 and insists on MXFP4 experts:
    where they cannot stay MXFP4 it prints that it FELL BACK, and why.
    """
    if adapter_path:
        lora_adapter_config(adapter_path)  # a clear error before the (slow) base load
    if not base_model_id:
        if not adapter_path:
            raise ValueError("give BASE_MODEL_ID or ADAPTER_PATH")
        base_model_id = adapter_base_model(adapter_path)
        check_model_id(base_model_id, f"{adapter_path}'s base_model_name_or_path", "set BASE_MODEL_ID to the base "
                       "model's folder or Hub id")
    else:
        base_model_id = resolve_model_path(check_model_id(base_model_id, "BASE_MODEL_ID"))  # "tiny": its folder
    tokenizer = load_tokenizer_for(base_model_id)  # before the (slow) model: a missing tokenizer stops here
    device = resolve_device(device)
    torch_dtype = torch.bfloat16 if quantized else resolve_dtype(dtype, device)
    attention = resolve_attention(attn_implementation, device)
    expert_layers = adapter_expert_layers(adapter_path) if adapter_path else []
    model, experts, resident = load_for_inference(base_model_id, device, torch_dtype, attention,
                                                  expert_lora_layers=expert_layers)
    if quantized and not resident:
        experts = f"FELL BACK: the experts could not stay MXFP4 ({experts})"
        print(experts, file=sys.stderr)
    if adapter_path:
        quiet_gradient_checkpointing_deprecation()  # PEFT's wrap reads a property transformers 5.24 deprecated
        model = PeftModel.from_pretrained(model, adapter_path).eval()
    eos = model.generation_config.eos_token_id
    stop_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
    if not stop_ids:
        print(f"note: {base_model_id} has no generation-config end tokens; using gpt-oss's {sorted(STOP_TOKEN_IDS)}")
        stop_ids = STOP_TOKEN_IDS
    return PolicyModel(model=model, tokenizer=tokenizer, base_model_id=base_model_id, adapter_path=adapter_path or "",
                       device=device, dtype=dtype_name(torch_dtype), attention=attention, experts=experts,
                       experts_resident=resident, stop_token_ids=stop_ids)


def split_at_stop(ids: Sequence[int], stop_ids) -> tuple[list[int], bool]:
    """(ids up to and including the first stop token, truncated?); truncated when no stop token appears."""
    for index, token in enumerate(ids):
        if token in stop_ids:
            return list(ids[:index + 1]), False
    return list(ids), True


def completion_from_ids(tokenizer, ids: Sequence[int], stop_ids) -> Completion:
    kept, truncated = split_at_stop(ids, stop_ids)
    text = tokenizer.decode(kept, skip_special_tokens=False)
    return Completion(text=text, n_tokens=len(kept), truncated=truncated,
                      action=None if truncated else parse_action(text))


def adapter_switch(policy: PolicyModel, use_adapter: bool):
    """Context in which the model runs with (or, via PEFT's disable_adapter, without) its adapter."""
    if use_adapter or not policy.has_adapter:
        return contextlib.nullcontext()
    return policy.model.disable_adapter()


def decode_experts_context(policy: PolicyModel, batch_len: int):
    """Keeps grouped_mm experts while decoding for large GPU batches (see GROUPED_MM_MIN_BATCH); else no change."""
    if policy.device == "cuda" and batch_len >= GROUPED_MM_MIN_BATCH:
        return grouped_mm_experts_for_decode(causal_lm(policy.model), say=print)
    return contextlib.nullcontext()


def generate(policy: PolicyModel, prompts: Sequence[str], samples: int = 1, seed: int = 0, max_new_tokens: int = 1024,
             temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, batch_size: int = 16,
             use_adapter: bool = True, progress: bool = True, desc: str = "generating") -> list[list[Completion]]:
    """`samples` completions for each Harmony prompt (which already ends with `<|start|>assistant`).

    The prompt x sample pairs are generated `batch_size` at a time; batch b is seeded with `seed + b`, so two calls
    with the same prompts, samples, seed and batch_size (e.g. adapter and base) use the same random streams.
    temperature 0 decodes greedily. Returns one list of `samples` Completions per prompt.
    """
    if samples < 1 or batch_size < 1:
        raise ValueError("samples and batch_size must be >= 1")
    jobs = [(p, s) for p in range(len(prompts)) for s in range(samples)]
    results: list[list[Completion | None]] = [[None] * samples for _ in prompts]
    tokenizer = policy.tokenizer
    sampling = ({"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": top_k} if temperature > 0
                else {"do_sample": False})
    with adapter_switch(policy, use_adapter), torch.inference_mode(), \
            tqdm(total=len(jobs), desc=desc, unit="completion", disable=not progress) as bar:
        for batch_index, start in enumerate(range(0, len(jobs), batch_size)):
            batch = jobs[start:start + batch_size]
            # the Harmony prompt holds every special token itself (a BOS would change it); left padding, so every
            # prompt ends where its generation starts
            inputs = tokenizer([prompts[p] for p, _ in batch], return_tensors="pt", padding=True, padding_side="left",
                               add_special_tokens=False).to(policy.device)
            torch.manual_seed(seed + batch_index)
            with decode_experts_context(policy, len(batch)):
                output = policy.model.generate(**inputs, max_new_tokens=max_new_tokens,
                                               pad_token_id=tokenizer.pad_token_id, **sampling)
            generated = output[:, inputs["input_ids"].shape[1]:].tolist()
            for (p, s), ids in zip(batch, generated, strict=True):
                results[p][s] = completion_from_ids(tokenizer, ids, policy.stop_token_ids)
            bar.update(len(batch))
    return results


def majority_vote(actions: Sequence[int | None]) -> int | None:
    """The most frequent valid action; ties go to the lowest action; None when no action is valid."""
    counts = collections.Counter(a for a in actions if a is not None)
    if not counts:
        return None
    top = max(counts.values())
    return min(a for a, n in counts.items() if n == top)


__all__ = ["Completion", "PolicyModel", "completion_from_ids", "generate", "load_policy_model", "majority_vote",
           "prompt_files", "split_at_stop"]
