"""fast_paths.py: which sampler, decode experts and training experts a run takes, and why (table-driven; a small
random gpt-oss built on the spot, no checkpoint)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import GptOssConfig, GptOssForCausalLM

import train_grpo
from tes_grpo.run.script_config import SettingsError
from tes_grpo.sampling import sampler
from tes_grpo.sampling.sampler import Sampler, SamplerSpec
from tes_grpo.training import fast_paths


def small_model(experts: str = "grouped_mm", dropout: float = 0.0):
    config = GptOssConfig(
        vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], attention_dropout=dropout, attn_implementation="eager")
    config._experts_implementation = experts
    torch.manual_seed(0)
    return GptOssForCausalLM(config)


def settings(**overrides):
    return train_grpo.default_settings(**overrides)


# (DECODE_GRAPHS, USE_VLLM, cuda, FSDP, model's experts, used?, words of the reason)
DECODE_GRAPH_CASES = [
    ("auto", False, True, False, "grouped_mm", True, "DECODE_GRAPHS=auto: on"),  # the default on a GPU
    ("auto", False, False, False, "grouped_mm", False, "no CUDA device"),  # CPU: transformers' generate
    ("auto", True, True, False, "grouped_mm", False, "vLLM generates"),  # vLLM samples instead
    ("auto", False, True, True, "grouped_mm", False, "FSDP"),  # a captured step cannot gather sharded weights
    ("auto", False, True, False, "eager", False, "experts_implementation='eager'"),  # reads the host mid-step
    ("on", False, False, False, "grouped_mm", True, "steps run eagerly"),  # asked for on a CPU: eager steps
    ("on", False, True, False, "grouped_mm", True, "DECODE_GRAPHS=on"),
    ("off", False, True, False, "grouped_mm", False, "DECODE_GRAPHS=off"),
]


@pytest.mark.parametrize("value, vllm, cuda, fsdp, experts, used, words", DECODE_GRAPH_CASES)
def test_decode_graphs_choice(value, vllm, cuda, fsdp, experts, used, words):
    decided, why = fast_paths.decode_graphs_choice(settings(DECODE_GRAPHS=value, USE_VLLM=vllm), small_model(experts),
                                                   cuda, fsdp)
    assert decided is used and words in why, why


# DECODE_GRAPHS=on with something that blocks it is an error naming the blocker: (cuda, FSDP, model, words)
ON_BLOCKED_CASES = [
    (True, True, small_model(), "FSDP shards the weights"),
    (True, False, small_model("eager"), "experts_implementation='eager'"),
    (False, False, small_model(dropout=0.1), "attention_dropout=0.1"),  # GRPO samples in train mode
]


@pytest.mark.parametrize("cuda, fsdp, model, words", ON_BLOCKED_CASES)
def test_decode_graphs_on_refuses_what_blocks_it(cuda, fsdp, model, words):
    with pytest.raises(SettingsError, match=words):
        fast_paths.decode_graphs_choice(settings(DECODE_GRAPHS="on"), model, cuda, fsdp)


def pretend_triton_installed(monkeypatch, installed: bool) -> None:
    monkeypatch.setattr(fast_paths, "_triton", lambda: installed)


# (DECODE_EXPERTS, cuda, triton installed?, graph_decode's experts)
DECODE_EXPERTS_CASES = [
    ("auto", True, True, "mxfp4"),  # the default on a GPU: the MXFP4 kernel
    ("auto", False, True, "model"),  # CPU: no GPU kernel, the model's own experts (the reason is in the log line)
    ("auto", True, False, "model"),  # no triton
    ("mxfp4", False, True, "mxfp4"),  # asked for (runs only where Triton can: a GPU or its interpreter)
    ("grouped_mm", True, True, "model"),
    ("transformers", True, True, "model"),
]


@pytest.mark.parametrize("value, cuda, triton, experts", DECODE_EXPERTS_CASES)
def test_decode_experts_choice(value, cuda, triton, experts, monkeypatch):
    pretend_triton_installed(monkeypatch, triton)
    chosen, why = fast_paths.decode_experts_choice(settings(DECODE_EXPERTS=value), cuda)
    assert chosen == experts and f"DECODE_EXPERTS={value}" in why


# (TRAIN_EXPERTS, cuda, triton installed?, fused training experts?)
TRAIN_EXPERTS_CASES = [
    ("auto", True, True, True),  # the default on a GPU: fused_experts.py, compiled
    ("auto", False, True, False),  # CPU: transformers' grouped_mm
    ("auto", True, False, False),  # no triton for torch.compile
    ("fused", False, False, True),  # asked for: on a CPU its functions run eagerly
    ("transformers", True, True, False),
]


@pytest.mark.parametrize("value, cuda, triton, fused", TRAIN_EXPERTS_CASES)
def test_train_experts_choice(value, cuda, triton, fused, monkeypatch):
    pretend_triton_installed(monkeypatch, triton)
    chosen, why = fast_paths.train_experts_choice(settings(TRAIN_EXPERTS=value), cuda)
    assert chosen is fused and f"TRAIN_EXPERTS={value}" in why


# (TRAIN_GLUE, cuda, triton installed?, the training glue chosen)
TRAIN_GLUE_CASES = [
    ("auto", True, True, "compiled"),  # the default on a GPU: train_glue.py, compiled
    ("auto", False, True, "eager"),  # CPU: the libraries' forward
    ("auto", True, False, "eager"),  # no triton for torch.compile
    ("compiled", False, False, "compiled"),  # asked for: on a CPU its functions run eagerly
    ("eager", True, True, "eager"),
]


@pytest.mark.parametrize("value, cuda, triton, glue", TRAIN_GLUE_CASES)
def test_train_glue_choice(value, cuda, triton, glue, monkeypatch):
    pretend_triton_installed(monkeypatch, triton)
    chosen, why = fast_paths.train_glue_choice(settings(TRAIN_GLUE=value), cuda)
    assert chosen == glue and f"TRAIN_GLUE={value}" in why


# (spec, the path a call takes, what transformers' generate() is given besides the inputs and the recorder)
SAMPLERS = [
    (SamplerSpec("generate"), "transformers", {}),  # transformers' generate, recorded
    (SamplerSpec("generate", synced=True), "transformers", {"synced_gpus": True}),  # FSDP: processes step together
    (SamplerSpec("graph_decode", experts="mxfp4", max_batch=32, lora="merged", glue="compiled"), "graph_decode", {}),
    (SamplerSpec("graph_decode", synced=True), "graph_decode", {}),
]


@pytest.mark.parametrize("spec, path, extra", SAMPLERS)
def test_the_sampler_takes_each_call_with_its_settings(monkeypatch, spec, path, extra):
    from transformers import GenerationConfig

    from tes_grpo.sampling.token_sampling import SampledLogprobs

    calls = []

    def in_calls(model, input_ids, attention_mask, config, max_batch, logprobs, **options):
        calls.append(("graph_decode", max_batch, logprobs, options))
        return input_ids, torch.zeros(input_ids.shape[0], 0)

    class Model:
        generation_config = GenerationConfig(max_new_tokens=2, do_sample=True)

        def generate(self, **kwargs):
            calls.append(("transformers", kwargs))
            return kwargs["input_ids"]

    monkeypatch.setattr(sampler, "generate_in_calls", in_calls)
    ids = torch.ones(2, 3, dtype=torch.long)
    sequences, logprobs = Sampler(spec, say=lambda text: None).generate(Model(), ids, None, None)
    assert sequences is ids and logprobs.shape == (2, 0)  # recorded on either path
    assert [call[0] for call in calls] == [path]
    if path == "graph_decode":
        options = {name: calls[0][3][name] for name in ("experts", "lora", "glue", "autocast")}
        assert calls[0][1:3] == (spec.max_batch, True)
        assert options == {"experts": spec.experts, "lora": spec.lora, "glue": spec.glue, "autocast": spec.autocast}
    else:
        kwargs = calls[0][1]
        assert {name: kwargs[name] for name in extra} == extra and ("synced_gpus" in kwargs) == spec.synced
        assert [type(p) for p in kwargs["logits_processor"]] == [SampledLogprobs]


def fake_trainer(model, fsdp=False, batch=64, precision="bf16"):
    return SimpleNamespace(model=model, is_fsdp_enabled=fsdp, accelerator=SimpleNamespace(mixed_precision=precision),
                           args=SimpleNamespace(per_device_train_batch_size=batch, steps_per_generation=1))


# (settings, cuda, FSDP, processes, sequences a generate call may take, the SamplerSpec chosen)
CHOSEN = [
    ({}, True, False, 1, None,
     SamplerSpec("graph_decode", experts="mxfp4", glue="compiled", autocast=torch.bfloat16)),  # GPU default
    ({}, True, False, 1, 32,
     SamplerSpec("graph_decode", experts="mxfp4", glue="compiled", max_batch=32, autocast=torch.bfloat16)),
    ({}, True, False, 1, 64,
     SamplerSpec("graph_decode", experts="mxfp4", glue="compiled", autocast=torch.bfloat16)),  # fits: no split
    ({"DECODE_LORA": "merged"}, True, False, 1, None,
     SamplerSpec("graph_decode", experts="mxfp4", lora="merged", glue="compiled", autocast=torch.bfloat16)),
    ({"DECODE_GLUE": "eager"}, True, False, 1, None,
     SamplerSpec("graph_decode", experts="mxfp4", glue="eager", autocast=torch.bfloat16)),  # as the trainer
    ({"DECODE_GLUE": "compiled"}, True, False, 1, None,
     SamplerSpec("graph_decode", experts="mxfp4", glue="compiled", autocast=torch.bfloat16)),
    ({"DECODE_GRAPHS": "on"}, False, False, 1, None,
     SamplerSpec("graph_decode", experts="model", glue="eager", autocast=torch.bfloat16)),  # CPU: auto glue eager
    ({}, False, False, 1, None, SamplerSpec("generate", autocast=torch.bfloat16)),  # CPU: transformers' generate
    ({}, True, True, 2, None, SamplerSpec("generate", autocast=torch.bfloat16, synced=True)),  # FSDP: step together
    ({"USE_VLLM": True}, True, False, 1, None, SamplerSpec("vllm", autocast=torch.bfloat16)),
]


@pytest.mark.parametrize("overrides, cuda, fsdp, processes, sequences, expected", CHOSEN)
def test_choose_gives_the_sampler_its_settings(monkeypatch, overrides, cuda, fsdp, processes, sequences, expected):
    monkeypatch.setattr(fast_paths, "process_count", lambda: processes)
    monkeypatch.setattr(fast_paths, "_triton", lambda: True)
    paths = fast_paths.choose(settings(**overrides), fake_trainer(small_model(), fsdp=fsdp), cuda, sequences)
    assert paths.sampler == expected
    assert any(line.startswith("decoding: ") for line in paths.reasons)


@pytest.mark.parametrize("glue, cuda, triton, words", [
    ("compiled", True, True, "glue: DECODE_GLUE=compiled;"),  # graph_decode takes it
    ("compiled", False, True, "DECODE_GLUE=compiled unused: it is graph_decode's"),  # auto chose generate: said
    ("auto", True, True, "glue: DECODE_GLUE=auto: compiled (GPU with Triton)"),  # the GPU default
    ("auto", True, False, "glue: DECODE_GLUE=auto: eager (no triton"),  # nothing to compile with: said
    ("eager", True, True, "glue: DECODE_GLUE=eager; attention: decode_attention.py's kernel (GPU);"),  # kept
])
def test_the_decoding_line_says_what_becomes_of_decode_glue(monkeypatch, glue, cuda, triton, words):
    monkeypatch.setattr(fast_paths, "_triton", lambda: triton)
    paths = fast_paths.choose(settings(DECODE_GLUE=glue), fake_trainer(small_model()), cuda)
    assert any(line.startswith("decoding: ") and words in line for line in paths.reasons), paths.reasons


def test_the_decoding_line_says_a_cpu_attends_eagerly():
    paths = fast_paths.choose(settings(DECODE_GRAPHS="on"), fake_trainer(small_model()), False)
    assert any(line.startswith("decoding: graph_decode")
               and line.endswith("; attention: eager (no GPU); projections: F.linear (no GPU); "
                                 "draws: torch.multinomial (no GPU))")
               for line in paths.reasons), paths.reasons


DRAWS = "; draws: draw_kernel.py's kernels (GPU))"  # the decoding line's end on a GPU
KERNEL = "decode_linear.py's kernel (GPU; each layer whose weights and adapter are bf16)"


@pytest.mark.parametrize("lora, precision, words", [
    ("peft", "bf16", "projections: " + KERNEL + DRAWS),
    ("peft", "no", "projections: " + KERNEL + DRAWS),
    ("peft", "fp16", "projections: F.linear (autocast torch.float16, not bf16)" + DRAWS),  # the kernel is bf16's: said
    ("merged", "bf16", "projections: F.linear (merged weights)" + DRAWS),
])
def test_the_decoding_line_says_how_a_gpu_computes_the_projections(monkeypatch, lora, precision, words):
    monkeypatch.setattr(fast_paths, "_triton", lambda: True)
    paths = fast_paths.choose(settings(DECODE_LORA=lora), fake_trainer(small_model(), precision=precision), True)
    assert any(line.startswith("decoding: graph_decode") and line.endswith(words) for line in paths.reasons), \
        paths.reasons


def test_a_split_batch_without_graph_decode_is_refused(monkeypatch):
    with pytest.raises(SettingsError, match="only graph_decode splits a batch"):
        fast_paths.choose(settings(DECODE_GRAPHS="off"), fake_trainer(small_model()), True, 32)
