"""graph_decode.py: the static-cache decode path gives transformers' tokens and log-probabilities, and its decode
step has nothing that would stop a CUDA graph capture (no host reads, no tensors off the model's device).

Small random gpt-oss models built here (4 layers, sliding window 8 so the ring wraps, 4 query heads on 2 key/value
heads); CPU float32, where both paths should agree to rounding.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import GenerationConfig, GptOssConfig, GptOssForCausalLM

from tes_grpo import graph_decode
import train_grpo

PAD, VOCAB = 5, 512


def small_config(experts: str = "grouped_mm") -> GptOssConfig:
    config = GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2, pad_token_id=PAD, eos_token_id=3, bos_token_id=1,
        attn_implementation="eager")
    config._experts_implementation = experts
    return config


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GptOssForCausalLM(small_config()).float().eval()


def left_padded_prompts(pads=(0, 4, 9), length=13, seed=1):
    """Prompts of different real lengths, left-padded as TRL pads them."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, VOCAB, (len(pads), length), generator=generator)
    mask = torch.ones_like(ids)
    for row, pad in enumerate(pads):
        mask[row, :pad] = 0
        ids[row, :pad] = PAD
    return ids, mask


def trl_config(**changes) -> GenerationConfig:
    """The generation config TRL 1.16's GRPOTrainer passes (its defaults), with changes."""
    settings = {"max_new_tokens": 20, "do_sample": True, "pad_token_id": PAD, "bos_token_id": 1, "eos_token_id": [3],
                "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": None, "repetition_penalty": 1.0,
                "cache_implementation": None, "use_cache": True, "disable_compile": True}
    return GenerationConfig(**{**settings, **changes})


# --- the same tokens as transformers' generate ----------------------------------------------------------------

@pytest.mark.parametrize("eos", [
    [3],  # (no row ends early) all rows run to max_new_tokens
    "first row ends at 8, second at 11",  # finished rows get pad, the others go on
    "every row ends",  # the loop stops once all have ended, before max_new_tokens
])
def test_greedy_tokens_equal_transformers(model, eos):
    ids, mask = left_padded_prompts()
    free = model.generate(input_ids=ids, attention_mask=mask, generation_config=trl_config(do_sample=False))
    tokens = free[:, ids.shape[1]:]
    if eos == "first row ends at 8, second at 11":
        eos = [int(tokens[0, 7]), int(tokens[1, 10])]
    elif eos == "every row ends":
        eos = [int(tokens[0, 3]), int(tokens[1, 5]), int(tokens[2, 6])]
    config = trl_config(do_sample=False, eos_token_id=eos)
    expected = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    got = graph_decode.generate(model, ids, mask, config)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("changes", [
    {},  # TRL's defaults: temperature 1, no top-k/top-p
    {"temperature": 0.7, "top_k": 20},  # temperature, then top-k
    {"top_p": 0.9, "min_p": 0.05},  # nucleus and min-p
])
def test_sampled_tokens_equal_transformers_with_the_same_seed(model, changes):
    ids, mask = left_padded_prompts()
    config = trl_config(**changes)
    torch.manual_seed(7)
    expected = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    torch.manual_seed(7)
    got = graph_decode.generate(model, ids, mask, config)
    assert torch.equal(got, expected)


def test_logprobs_of_the_same_completions_equal_a_full_forward(model):
    ids, mask = left_padded_prompts()
    torch.manual_seed(3)
    sampled = model.generate(input_ids=ids, attention_mask=mask, generation_config=trl_config(max_new_tokens=30))
    completion = sampled[:, ids.shape[1]:]
    ours = graph_decode.completion_logprobs(model, ids, mask, completion)
    assert ours.shape == completion.shape
    reference = graph_decode.full_forward_logprobs(model, ids, mask, completion)
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=0)


def test_small_buckets_change_nothing(model, monkeypatch):
    # GPU prompts cross several 512-slot buckets per call; 4-slot buckets make these short prompts cross ~8
    monkeypatch.setattr(graph_decode, "BUCKET_TOKENS", 4)
    assert graph_decode.bucket_length(5, 100) == 8
    ids, mask = left_padded_prompts()
    config = trl_config(do_sample=False)
    expected = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    assert torch.equal(graph_decode.generate(model, ids, mask, config), expected)
    completion = expected[:, ids.shape[1]:]
    torch.testing.assert_close(graph_decode.completion_logprobs(model, ids, mask, completion),
                               graph_decode.full_forward_logprobs(model, ids, mask, completion), atol=1e-4, rtol=0)


def test_lora_model_decodes_like_transformers():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    peft_model = get_peft_model(GptOssForCausalLM(small_config()).float().eval(),
                                LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)  # PEFT starts B at zero: make the adapter change the outputs
    ids, mask = left_padded_prompts()
    config = trl_config(do_sample=False)
    expected = peft_model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    with peft_model.disable_adapter():
        without_lora = peft_model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    assert not torch.equal(expected, without_lora)  # the adapter matters for these tokens
    assert torch.equal(graph_decode.generate(peft_model, ids, mask, config), expected)


# --- capturable as a CUDA graph -------------------------------------------------------------------------------

# aten ops that read a tensor's values on the host (a device sync; illegal while capturing a CUDA graph)
HOST_READS = {"_local_scalar_dense", "item", "is_nonzero", "nonzero", "masked_select", "bincount", "equal",
              "_unique2", "unique_dim", "unique_consecutive", "repeat_interleave"}


class HostReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.found = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in HOST_READS:
            self.found.append(name)
        return func(*args, **(kwargs or {}))


def one_step(model, config, device="cpu", dtype=torch.float32):
    cache = graph_decode.StaticCache(config, torch.ones(2, 10, dtype=torch.long, device=device), 5, dtype)
    tokens = torch.ones(2, 1, dtype=torch.long, device=device)
    with torch.no_grad():
        return graph_decode.decode_step(model, cache, tokens, torch.tensor(10, device=device), 16)


@pytest.mark.parametrize("experts, host_reads", [
    ("grouped_mm", False),  # transformers' default on GPUs: offsets by histc, no sync
    ("batched_mm", False),  # its small-batch decode path: gathers weights, no sync
    ("eager", True),  # loops over the experts hit (nonzero, .item()): not capturable (and the detector sees it)
])
def test_decode_step_reads_nothing_on_the_host(experts, host_reads):
    torch.manual_seed(0)
    config = small_config(experts)
    model = GptOssForCausalLM(config).float().eval()
    with HostReads() as watch:
        one_step(model, config)
    assert bool(watch.found) == host_reads, watch.found
    assert bool(graph_decode.graph_blockers(model)) == host_reads


def test_decode_step_runs_on_the_meta_device():
    # meta tensors have no values: a host read fails, and so does any tensor made on the CPU mid-step (which on a
    # GPU would be a host-to-device copy inside the graph)
    config = small_config()
    with torch.device("meta"):
        model = GptOssForCausalLM(config).to(torch.bfloat16).eval()  # grouped_mm's meta kernel wants bf16
    logits = one_step(model, config, device="meta", dtype=torch.bfloat16)
    assert logits.shape == (2, VOCAB) and logits.device.type == "meta"


# --- which calls it takes ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("changes, kwargs, reason", [
    ({}, {}, None),  # TRL's defaults: supported
    ({"temperature": 0.8, "top_k": 50, "top_p": 0.95, "min_p": 0.1}, {}, None),  # all sampling warpers TRL sets
    ({"repetition_penalty": 1.2}, {}, "repetition_penalty=1.2"),  # needs the history: not implemented
    ({"num_beams": 2, "do_sample": False}, {}, "num_beams=2"),  # beam search
    ({"output_scores": True, "return_dict_in_generate": True}, {}, "output_scores=True"),  # a dict, not ids
    ({}, {"synced_gpus": True}, "synced_gpus"),  # FSDP's lock-step generation
    ({"suppress_tokens": [7]}, {}, "suppress_tokens=[7]"),  # a processor it does not run
])
def test_unsupported_options(changes, kwargs, reason):
    reasons = graph_decode.unsupported_options(trl_config(**changes), kwargs)
    assert (reasons == []) if reason is None else any(r.startswith(reason) for r in reasons), reasons


@pytest.mark.parametrize("slot, total, expected", [
    (0, 2000, 512),  # first slot: one bucket
    (511, 2000, 512),  # last slot of the first bucket
    (512, 2000, 1024),  # next bucket
    (1999, 2000, 2000),  # never past the cache
])
def test_bucket_length(slot, total, expected):
    assert graph_decode.bucket_length(slot, total) == expected


def test_wrapper_uses_transformers_for_unsupported_calls_and_says_so(model):
    calls, said = [], []
    wrapper = graph_decode.GraphDecodeGenerate(model, lambda **kw: calls.append(kw) or "transformers", say=said.append)
    ids, mask = left_padded_prompts()
    for _ in range(2):
        assert wrapper(input_ids=ids, attention_mask=mask, generation_config=trl_config(repetition_penalty=1.3)) \
            == "transformers"
    assert len(calls) == 2 and len(said) == 1 and "repetition_penalty=1.3" in said[0]
    out = wrapper(input_ids=ids, attention_mask=mask, generation_config=trl_config(do_sample=False))
    assert len(calls) == 2 and out.shape[0] == 3  # supported: decoded here


# --- train_grpo wiring ------------------------------------------------------------------------------------------

def test_train_grpo_routes_generate_through_graph_decode(model):
    original = model.generate
    try:
        assert train_grpo.apply_decode_graphs(model, True, cuda=False)
        assert isinstance(model.generate, graph_decode.GraphDecodeGenerate)
        assert not train_grpo.apply_decode_graphs(model, False, cuda=False)
        with pytest.raises(train_grpo.SettingsError, match="FSDP"):
            train_grpo.apply_decode_graphs(model, True, cuda=True, sharded=True)
    finally:
        model.generate = original


def test_decode_graphs_and_vllm_exclude_each_other():
    settings = train_grpo.default_settings(DECODE_GRAPHS=True, USE_VLLM=True)
    with pytest.raises(train_grpo.SettingsError, match="DECODE_GRAPHS and USE_VLLM"):
        train_grpo.check_settings(settings)


def test_grpo_step_samples_the_same_completions_with_decode_graphs(tmp_path, tokenizer, monkeypatch):
    # the wiring: one GRPO step on the tiny model, same seed, with and without DECODE_GRAPHS. TRL's sampling draws the
    # same random numbers on both paths, so equal log-probabilities give equal completions (the tiny model's answers
    # are too sure of themselves to expose small errors: the tests above check the arithmetic)
    import pandas as pd

    from grpo_fixtures import write_fixture_data

    data = write_fixture_data(tmp_path, tokenizer)
    decoded = []
    real_generate = graph_decode.generate
    monkeypatch.setattr(graph_decode, "generate", lambda *a, **k: decoded.append(1) or real_generate(*a, **k))
    completions = {}
    for graphs in (False, True):
        settings = train_grpo.default_settings(
            MODEL_ID="tiny", DATA_DIR=str(data), EVAL_DIR=str(data / "eval"), OUT=str(tmp_path / f"run-{graphs}"),
            TOTAL_STEPS=1, NUM_GENERATIONS=4, GRADIENT_ACCUMULATION_STEPS=1, MAX_COMPLETION_LEN=32,
            GRADIENT_CHECKPOINTING=False, DECODE_GRAPHS=graphs)
        frame = train_grpo.load_training_data(settings, tokenizer)
        log = tmp_path / f"completions-{graphs}.csv"
        dataset = train_grpo.build_train_dataset(frame, settings)
        trainer = train_grpo.build_trainer(settings, train_grpo.load_policy_model("tiny"), tokenizer, dataset,
                                           completion_log_path=str(log))
        trainer.train()
        completions[graphs] = pd.read_csv(log, keep_default_na=False)["completion"].tolist()
    assert decoded == [1]  # the DECODE_GRAPHS run generated through graph_decode, the other did not
    assert len(completions[True]) == 4 and completions[True] == completions[False]
