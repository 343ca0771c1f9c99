"""graph_decode.py: the static-cache decode path gives transformers' tokens and log-probabilities, and its decode
step has nothing that would stop a CUDA graph capture (no host reads, no tensors off the model's device).

Small random gpt-oss models built here (4 layers, sliding window 8 so the ring wraps, 4 query heads on 2 key/value
heads); CPU float32, where both paths should agree to rounding.
"""

from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import GenerationConfig, GptOssConfig, GptOssForCausalLM

import train_grpo
from benchmarks.decode_compare import (
    decode_logprobs,
    draw_lora_b,
    full_forward_logprobs,
    prefill_shapes,
    trainer_logprobs,
    transformers_logprobs,
)
from data_reward import CompletionLog
from tes_grpo.layers.lora import causal_lm, lora_parts, merged_linear
from tes_grpo.model.model_loading import load_training_model, resolve_model_path
from tes_grpo.sampling import decode_cache, decode_math, graph_decode
from tes_grpo.sampling.sampler import Sampler, SamplerSpec
from tes_grpo.training.batch_layout import batch_layout

PAD, VOCAB = 5, 512
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny ops on a shared CPU: one thread is as fast


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


def grouped_prompts(order, pads=(0, 4, 9, 2), length=13):
    """Rows repeating distinct prompts (left-padded, different lengths) in the given order of prompt numbers: TRL's
    GRPO batches are each prompt's group of completions in a row, e.g. (0,0,0,0,1,1,1,1,...)."""
    ids, mask = left_padded_prompts(pads=pads, length=length)
    rows = torch.tensor(order)
    return ids[rows], mask[rows]


TRL_4X4 = (0,) * 4 + (1,) * 4 + (2,) * 4 + (3,) * 4  # 4 prompts x 16 generations, scaled down: TRL's layout
UNEVEN = (2, 0, 2, 1, 2, 0)  # not in a row, groups of 3, 2 and 1


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


@pytest.mark.parametrize("kernel", [None, "torch"])
def test_generate_passes_its_draw_kernel_to_every_draw(model, monkeypatch, kernel):
    # on a GPU "triton" draws with draw_kernel.py, "torch" (bench_generate.py's _torchdraw) with torch's ops
    real, seen = graph_decode.draw, []
    monkeypatch.setattr(graph_decode, "draw", lambda *args: seen.append(args[3]) or real(*args))
    ids, mask = left_padded_prompts()
    options = {} if kernel is None else {"draw_kernel": kernel}
    graph_decode.generate(model, ids, mask, trl_config(max_new_tokens=4, eos_token_id=[10_000]), **options)
    assert seen == [kernel or "triton"] * 4


def test_sampling_stops_with_every_row_ended_and_leaves_the_random_state_as_transformers_does(model):
    # the loop reads "every row ended" one token late (no GPU wait a token): the token drawn past the end is
    # dropped and its random numbers given back, so the next draw of the caller (the next GRPO step) is the same
    ids, mask = left_padded_prompts()
    torch.manual_seed(7)
    tokens = model.generate(input_ids=ids, attention_mask=mask, generation_config=trl_config())[:, ids.shape[1]:]
    config = trl_config(eos_token_id=[int(tokens[0, 3]), int(tokens[1, 5]), int(tokens[2, 6])])
    results = {}
    for name, sample in (("transformers", model.generate), ("graph_decode", graph_decode.generate)):
        torch.manual_seed(7)
        out = sample(model, ids, mask, config) if name == "graph_decode" else sample(
            input_ids=ids, attention_mask=mask, generation_config=config)
        results[name] = (out, torch.rand(4))
    assert results["transformers"][0].shape[1] < ids.shape[1] + config.max_new_tokens  # it stopped early
    assert torch.equal(results["graph_decode"][0], results["transformers"][0])
    assert torch.equal(results["graph_decode"][1], results["transformers"][1])


# --- shared prompts: each distinct row prefilled once ------------------------------------------------------------

@pytest.mark.parametrize("order, rows", [
    (TRL_4X4, 4),  # TRL's groups: 4 distinct prompts prefilled for 16 rows
    (UNEVEN, 4),  # 3 distinct prompts, anywhere in the batch: prefilled as 4 rows (a power of two)
    ((1,) * 5, 1),  # one prompt for every row
    ((0, 1, 2), 3),  # all distinct: nothing shared, the batch as it is
])
def test_greedy_tokens_equal_transformers_with_shared_prompts(model, order, rows):
    ids, mask = grouped_prompts(order)
    config = trl_config(do_sample=False)
    expected = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    with prefill_shapes(model) as shapes:
        got = graph_decode.generate(model, ids, mask, config)
    assert torch.equal(got, expected)
    assert [shape[0] for shape in shapes] == [rows]


@pytest.mark.parametrize("order, changes", [
    (TRL_4X4, {}),  # TRL's defaults on TRL's layout
    (UNEVEN, {"temperature": 0.7, "top_k": 20}),  # uneven duplicates, with warpers
    (TRL_4X4, {"top_p": 0.9, "min_p": 0.05}),
])
def test_sampled_tokens_and_random_numbers_equal_transformers_with_shared_prompts(model, order, changes):
    # the prefill draws no random numbers, so the same seed gives the same tokens, and the generator ends in the same
    # state (the next GRPO step samples as it would have)
    ids, mask = grouped_prompts(order)
    config = trl_config(**changes)
    torch.manual_seed(11)
    expected = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    state_after_transformers = torch.get_rng_state()
    torch.manual_seed(11)
    got = graph_decode.generate(model, ids, mask, config)
    assert torch.equal(got, expected)
    assert torch.equal(torch.get_rng_state(), state_after_transformers)
    assert len({tuple(row) for row in got[:4, ids.shape[1]:].tolist()}) > 1  # a group's rows sample differently


def test_shared_prompt_logprobs_equal_a_full_forward(model):
    ids, mask = grouped_prompts(UNEVEN)
    torch.manual_seed(3)
    sampled = model.generate(input_ids=ids, attention_mask=mask, generation_config=trl_config(max_new_tokens=30))
    completion = sampled[:, ids.shape[1]:]
    with prefill_shapes(model) as shapes:
        ours = decode_logprobs(model, ids, mask, completion)
    torch.testing.assert_close(ours, full_forward_logprobs(model, ids, mask, completion), atol=1e-4, rtol=0)
    assert shapes[0][0] == 4  # shared


@pytest.mark.parametrize("ids, mask, expected", [
    # (rows to prefill, which of them each row copies) or None
    ([[1, 2], [1, 2], [3, 4], [3, 4]], [[1, 1]] * 4, ([0, 2], [0, 0, 1, 1])),  # TRL's groups in a row
    ([[3, 4], [1, 2], [3, 4], [5, 6], [3, 4], [1, 2]], [[1, 1]] * 6,
     ([0, 1, 3, 0], [0, 1, 0, 2, 0, 1])),  # groups by first appearance; 3 distinct padded to 4 with row 0
    ([[1, 2], [3, 4], [5, 6]], [[1, 1]] * 3, None),  # all distinct
    ([[1, 2], [3, 4], [5, 6], [1, 2]], [[1, 1]] * 4, None),  # 3 distinct round up to 4 = the batch: no gain
    ([[5, 2], [5, 2], [5, 2], [5, 2]], [[0, 1], [1, 1], [0, 1], [1, 1]],
     ([0, 1], [0, 1, 0, 1])),  # same ids, different masks: different prompts
])
def test_shared_prefill_rows(ids, mask, expected):
    plan = decode_cache.shared_prefill_rows(torch.tensor(ids), torch.tensor(mask))
    if expected is None:
        assert plan is None
    else:
        assert [plan[0].tolist(), plan[1].tolist()] == [expected[0], expected[1]]


# --- bucketed prompt length: few prefill shapes --------------------------------------------------------------------

@pytest.mark.parametrize("prompt_len, bucket, expected", [
    (13, 256, 256),  # a short prompt: one bucket
    (256, 256, 256),  # exactly a bucket: unchanged
    (1310, 256, 1536),  # a TES prompt
    (1310, 0, 1310),  # 0: no rounding
    (1310, 1, 1310),  # 1: no rounding
])
def test_prefill_length(prompt_len, bucket, expected):
    assert decode_cache.prefill_length(prompt_len, bucket) == expected


@pytest.mark.parametrize("bucket", [
    1,  # no extra padding: the prompts as TRL pads them
    16,  # prompts cross buckets within the test's lengths
    256,  # the default: 13-token prompts padded to 256
])
def test_bucketed_prefill_gives_transformers_tokens(model, bucket):
    ids, mask = grouped_prompts(UNEVEN)
    config = trl_config(do_sample=False)
    expected = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    got = graph_decode.generate(model, ids, mask, config, prefill_bucket=bucket)
    assert torch.equal(got, expected)
    completion = expected[:, ids.shape[1]:]
    torch.testing.assert_close(decode_logprobs(model, ids, mask, completion, prefill_bucket=bucket),
                               full_forward_logprobs(model, ids, mask, completion), atol=1e-4, rtol=0)


def test_bucketed_and_shared_prefill_fill_the_same_cache(model):
    # the extra padding and the sharing change the forward's inputs only: the cache, positions and logits it leaves
    # are those of the rows as given (the extra slots were masked padding and are not kept)
    ids, mask = grouped_prompts(UNEVEN)
    with torch.no_grad():
        plain_logits, plain = decode_cache.prefill(model, ids, mask, 4, share_prompts=False, bucket=1)
        logits, cache = decode_cache.prefill(model, ids, mask, 4, share_prompts=True, bucket=16)
    assert (cache.prompt_len, cache.total) == (plain.prompt_len, plain.total) == (13, 17)
    assert torch.equal(cache.valid, plain.valid)
    torch.testing.assert_close(logits, plain_logits, atol=1e-5, rtol=0)
    for layer in range(len(cache.keys)):
        torch.testing.assert_close(cache.keys[layer], plain.keys[layer], atol=1e-5, rtol=0)
        torch.testing.assert_close(cache.values[layer], plain.values[layer], atol=1e-5, rtol=0)


def test_varied_prompt_lengths_give_few_prefill_shapes(model, monkeypatch):
    # transformers compiles flex attention per shape (GPU; recompile_limit 8, then an unfused fallback): 20 GRPO-like
    # batches with 20 different padded prompt lengths and 1-4 distinct prompts reach the model in 2 lengths x 3 row
    # counts
    monkeypatch.setattr(decode_cache, "PREFILL_BUCKET_TOKENS", 16)
    generator = torch.Generator().manual_seed(5)
    with prefill_shapes(model) as shapes:
        for length in range(13, 33):
            distinct = 1 + length % 4
            ids = torch.randint(10, VOCAB, (distinct, length), generator=generator)
            mask = torch.ones_like(ids)
            mask[0, :length % 5] = 0  # TRL pads the shorter prompts
            rows = torch.arange(distinct).repeat_interleave(4)
            graph_decode.generate(model, ids[rows], mask[rows], trl_config(max_new_tokens=2, do_sample=False))
    assert len({length for _, length in shapes}) == 2  # 16 and 32 tokens
    assert {rows for rows, _ in shapes} == {1, 2, 4}  # 3 distinct prompts prefill as 4 rows
    assert len(shapes) == 20


def test_logprobs_of_the_same_completions_equal_a_full_forward(model):
    ids, mask = left_padded_prompts()
    torch.manual_seed(3)
    sampled = model.generate(input_ids=ids, attention_mask=mask, generation_config=trl_config(max_new_tokens=30))
    completion = sampled[:, ids.shape[1]:]
    ours = decode_logprobs(model, ids, mask, completion)
    assert ours.shape == completion.shape
    reference = full_forward_logprobs(model, ids, mask, completion)
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=0)


def test_small_buckets_change_nothing(model, monkeypatch):
    # GPU prompts cross several 512-slot buckets per call; 4-slot buckets make these short prompts cross ~8
    monkeypatch.setattr(decode_cache, "BUCKET_TOKENS", 4)
    assert decode_cache.bucket_length(5, 100) == 8
    ids, mask = left_padded_prompts()
    config = trl_config(do_sample=False)
    expected = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    assert torch.equal(graph_decode.generate(model, ids, mask, config), expected)
    completion = expected[:, ids.shape[1]:]
    torch.testing.assert_close(decode_logprobs(model, ids, mask, completion),
                               full_forward_logprobs(model, ids, mask, completion), atol=1e-4, rtol=0)


def lora_model(dropout: float = 0.0):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    peft_model = get_peft_model(GptOssForCausalLM(small_config()).float().eval(),
                                LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=dropout))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)  # PEFT starts B at zero: make the adapter change the outputs
    return peft_model.eval()  # PEFT's new modules start in train mode


@pytest.mark.parametrize("order", [
    (0, 1, 2),  # distinct prompts
    TRL_4X4,  # TRL's groups, prefilled shared
])
def test_lora_model_decodes_like_transformers(order):
    peft_model = lora_model()
    ids, mask = grouped_prompts(order)
    config = trl_config(do_sample=False)
    expected = peft_model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    with peft_model.disable_adapter():
        without_lora = peft_model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    assert not torch.equal(expected, without_lora)  # the adapter matters for these tokens
    assert torch.equal(graph_decode.generate(peft_model, ids, mask, config), expected)


def lora_linear(change=None, **config):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(torch.nn.Sequential(torch.nn.Linear(16, 12)),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["0"], init_lora_weights=False, **config))
    model.eval()
    if change:
        change(model)
    return model, model.base_model.model[0]


# (what is done to a PEFT LoRA Linear, what merged_linear gives: "merged" new weight, "base" tensors, None = module)
MERGED_LINEAR_CASES = [
    (None, {}, "merged"),  # the adapter's delta added to a copy of the base weight
    (lambda m: m.disable_adapter_layers(), {}, "base"),  # adapters off: the base layer alone
    (lambda m: m.base_model.model[0].merge(), {}, "base"),  # PEFT merged it already: the base weight holds it
    (lambda m: (m.base_model.model[0].merge(), m.disable_adapter_layers()), {}, None),  # PEFT would unmerge
    (lambda m: m.train(), {"lora_dropout": 0.1}, None),  # dropout on: only the module draws it
    (None, {"lora_dropout": 0.1}, "merged"),  # eval mode: dropout off
    (None, {"use_dora": True}, None),  # DoRA rescales the columns: not a plain delta
]


@pytest.mark.parametrize("change, config, expected", MERGED_LINEAR_CASES)
def test_merged_linear(change, config, expected):
    model, layer = lora_linear(change, **config)
    base = layer.base_layer.weight.detach().clone()
    merged = merged_linear(layer)
    if expected is None:
        assert merged is None
        return
    assert (merged[0] is layer.base_layer.weight) == (expected == "base")
    x = torch.randn(5, 16)
    with torch.no_grad():
        torch.testing.assert_close(torch.nn.functional.linear(x, *merged), layer(x), atol=1e-5, rtol=1e-5)
    if expected == "merged":
        assert torch.equal(layer.base_layer.weight, base)  # the model is untouched
        assert not torch.allclose(merged[0], base)  # and the adapter changes the weight


def test_plain_linear_and_lora_model_projections():
    linear = torch.nn.Linear(4, 3)
    weight, bias, lora = lora_parts(linear)
    assert weight is linear.weight and bias is linear.bias and lora is None
    assert lora_parts(torch.nn.Identity()) is None
    peft_model = lora_model()
    lm = causal_lm(peft_model)
    for lora in ("peft", "merged"):
        layers = decode_math.attention_projections(lm, lora)
        assert len(layers) == lm.config.num_hidden_layers
        for projections, modules in zip(layers, lm.model.layers, strict=True):
            attn = modules.self_attn
            for (w, _), p in zip(projections.base, (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj), strict=True):
                assert (w is p.base_layer.weight) == (lora == "peft")  # PEFT's order reads the base; merged copies it
            if lora == "peft":  # one low-rank product for q, k, v (scaling 2: folded into B)
                assert projections.qkv.splits == (64, 32, 32) and projections.qkv.a.shape == (12, 64)
                assert projections.qkv.scale is None and projections.o.splits == (64,)
            else:
                assert projections.qkv is None and projections.o is None


RHOS = [1e-4, 1e-3, 1e-2]  # rms(LoRA delta) / rms(W): what a GRPO run at LR 5e-5 passes through
BF16 = torch.bfloat16


def rho_lora_model(rho: float):
    """The small model in bf16 with train_grpo's LoRA (r 4, alpha 8; PEFT keeps its factors in float32), B drawn so
    that each projection's delta is rho times its weight in rms; weights at unit-variance scale (logits of a few
    units), train mode (as GRPO generates)."""
    from peft import get_peft_model

    torch.manual_seed(0)
    base = GptOssForCausalLM(small_config())
    with torch.no_grad():
        for param in base.parameters():
            if param.dim() >= 2:
                param.normal_(0, param.shape[-1] ** -0.5)
    peft_model = get_peft_model(base.to(BF16), train_grpo.build_lora_config(4, 8))
    draw_lora_b(peft_model, rho)
    return peft_model.train()


@pytest.mark.parametrize("rho", RHOS)
def test_decode_projections_are_the_trainers(rho):
    # the trainer's computation: PEFT's LoRA layers under the trainer's bf16 autocast (base product rounded, then the
    # bf16 LoRA output added); the decode step's must be the same numbers, the merged copy's are not
    peft_model = rho_lora_model(rho)
    lm = causal_lm(peft_model)
    attn = lm.model.layers[1].self_attn
    g = torch.Generator().manual_seed(4)
    x, attended = (torch.randn(6, 1, 64, generator=g).to(BF16) for _ in range(2))
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
        expected = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x), attn.o_proj(attended)]
        outputs = {}
        for lora in ("peft", "merged"):
            projections = decode_math.attention_projections(lm, lora, BF16)[1]
            outputs[lora] = [*decode_math.qkv_projections(attn, projections, x),
                             decode_math.output_projection(attn, projections, attended)]
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(outputs["peft"], expected, strict=True))
    assert not all(torch.equal(ours, theirs) for ours, theirs in zip(outputs["merged"], expected, strict=True))


def test_the_gpus_projection_kernel_gives_the_trainers_projections(monkeypatch):
    # decode_linear's kernel (interpreted) where a GPU runs it, handed the layer's weights, biases and LoRA factors
    # by attention_projections: PEFT's numbers but where its float32 sums, in another order, move a bf16 rounding
    # (a weight, bias or adapter missed or misplaced would change most elements)
    pytest.importorskip("triton", reason="requirements-test.txt installs triton (its interpreter runs it on CPU)")
    from triton_interpreter import interpreted, loops_over_runtime_values

    if not loops_over_runtime_values():  # the kernel's range(0, K, ...): see there
        pytest.skip("this Triton's interpreter (< 3.7) cannot loop over a runtime value under NumPy >= 2.4; the "
                    "compiled kernel gives PEFT's rounding on CUDA in tests/gpu_cuda_test.py")

    peft_model = rho_lora_model(1e-2)
    lm = causal_lm(peft_model)
    attn = lm.model.layers[1].self_attn
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():  # the model's biases start at zero
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            bias = getattr(attn, name).base_layer.bias
            bias.copy_(torch.randn(bias.shape, generator=g))
    x, attended = (torch.randn(6, 1, 64, generator=g).to(BF16) for _ in range(2))
    with (interpreted("tes_grpo.sampling.decode_linear") as decode_linear, torch.no_grad(),
          torch.autocast("cpu", dtype=BF16)):
        expected = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x), attn.o_proj(attended)]
        chosen = []
        monkeypatch.setattr(decode_math, "projection_linear",
                            lambda parts, autocast, kernel: chosen.append(kernel) or decode_linear.linear)
        projections = decode_math.attention_projections(lm, "peft", BF16)[1]
        got = [*decode_math.qkv_projections(attn, projections, x),
               decode_math.output_projection(attn, projections, attended)]
        assert projections.linear is decode_linear.linear and set(chosen) == {"triton"}
    for ours, theirs in zip(got, expected, strict=True):
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
        unit = theirs.float().abs().max() * torch.finfo(BF16).eps
        assert float((ours.float() - theirs.float()).abs().max()) <= unit
        assert float((ours != theirs).float().mean()) < 0.05


def test_the_projection_kernel_is_the_gpus_only():
    # on the CPU, or for cuBLAS's products, decode_step keeps F.linear and LowRank; a kernel name not known is refused
    lm = causal_lm(rho_lora_model(1e-3))
    assert all(p.linear is None for p in decode_math.attention_projections(lm, "peft", BF16, kernel="triton"))
    with pytest.raises(ValueError, match="projection kernel must be one of"):
        decode_math.attention_projections(lm, "peft", BF16, kernel="cutlass")


@pytest.mark.parametrize("device, autocast, kernel, expected", [
    ("cuda", BF16, "triton", None),                                  # the GPU under the trainer's bf16 autocast
    ("cuda", None, "triton", None),                                  # no autocast: the layers' own dtypes decide
    ("cuda", torch.float16, "triton", "autocast torch.float16, not bf16"),  # the trainer's products are fp16
    ("cpu", BF16, "triton", "no GPU"),
    ("cuda", BF16, "cublas", "the projection kernel 'cublas' chosen"),
])
def test_projection_kernel_blocker(device, autocast, kernel, expected):
    assert decode_math.projection_kernel_blocker(device, autocast, kernel) == expected


def _parts(weight=BF16, biases=(BF16,) * 4, factors=BF16, contiguous=True, adapters=(True,) * 4):
    weight_t = torch.zeros(8, 8, dtype=weight) if contiguous else torch.zeros(8, 8, dtype=weight).T
    return [(weight_t, None if b is None else torch.zeros(8, dtype=b),
             (torch.zeros(4, 8, dtype=factors), torch.zeros(8, 4, dtype=factors), 2.0) if a else None)
            for b, a in zip(biases, adapters, strict=True)]


@pytest.mark.parametrize("parts, autocast, expected", [
    (_parts(), BF16, True),                                            # bf16 weights, biases, adapter under autocast
    (_parts(factors=torch.float32), BF16, True),                       # PEFT's float32 factors: autocast makes bf16
    (_parts(factors=torch.float32), None, False),                      # no autocast: the adapter computes in float32
    (_parts(factors=BF16), None, True),                                # no autocast, bf16 factors
    (_parts(adapters=(False,) * 4, factors=torch.float32), None, True),  # no adapter at all
    (_parts(weight=torch.float32), BF16, False),                       # float32 weights
    (_parts(contiguous=False), BF16, False),                           # a transposed weight
    (_parts(biases=(BF16, None, BF16, BF16)), BF16, False),            # one bias missing
    (_parts(biases=(None,) * 4), BF16, True),                          # no biases
    (_parts(biases=(torch.float32,) * 4), BF16, False),                # float32 biases
])
def test_projection_parts_fit(parts, autocast, expected):
    assert decode_math.projection_parts_fit(parts, autocast) is expected


@pytest.mark.parametrize("rho", RHOS)
def test_decode_samples_the_policy_being_trained(rho):
    # log-probabilities of the same sampled tokens, left-padded prompts, bf16 weights as on the GPU: graph_decode's
    # (under the trainer's autocast, trainer positions, float32 head) against the trainer's forward (TRL's fused head,
    # autocast), next to transformers' generate. Measured: graph_decode 5e-7 nats (mean |diff|), transformers'
    # generate and the merged adapter 1e-2 to 1e-1 (a random model: every rounding is amplified)
    peft_model = rho_lora_model(rho)
    ids, mask = grouped_prompts((0, 1, 2, 3))
    torch.manual_seed(3)
    completion, transformers = transformers_logprobs(peft_model, ids, mask, 16, PAD)
    trainer = trainer_logprobs(peft_model, ids, mask, completion, autocast=BF16)
    ours = (decode_logprobs(peft_model, ids, mask, completion, autocast=BF16) - trainer).abs().mean()
    merged = (decode_logprobs(peft_model, ids, mask, completion, lora="merged", autocast=BF16) - trainer).abs().mean()
    theirs = (transformers - trainer).abs().mean()
    assert ours <= theirs and ours < 1e-4, (ours, theirs)
    assert merged > 10 * ours


@pytest.mark.parametrize("changes", [
    {},  # TRL's defaults: the raw logits
    {"temperature": 0.7, "top_k": 20},  # the distribution after temperature and top-k
    {"top_p": 0.9, "min_p": 0.05},
])
def test_generate_returns_the_sampled_tokens_logprobs(model, changes):
    ids, mask = left_padded_prompts()
    config = trl_config(**changes)
    torch.manual_seed(7)
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config, output_scores=True,
                         return_dict_in_generate=True)
    torch.manual_seed(7)
    got, logprobs = graph_decode.generate(model, ids, mask, config, logprobs=True)
    assert torch.equal(got, out.sequences)
    new = out.sequences[:, ids.shape[1]:]
    expected = torch.log_softmax(torch.stack(out.scores, dim=1), dim=-1).gather(2, new[..., None]).squeeze(2)
    ended_before = (new == 3).long().cumsum(dim=1) - (new == 3).long() > 0  # after the row's end token: padding
    torch.testing.assert_close(logprobs[~ended_before], expected[~ended_before], atol=1e-5, rtol=0)
    assert (logprobs[ended_before] == 0).all()


@pytest.mark.parametrize("checkpointing", [
    False,  # as TRL 1.16 calls generate(): unwrap_model_for_generation switched checkpointing off
    True,  # a caller that left it on: checkpointed layers would drop the prefill's KV cache
])
def test_decodes_in_the_state_grpo_leaves_the_model(checkpointing):
    # TRL's GRPOTrainer generates in train mode (Trainer.training_step called model.train()), under no_grad, with
    # PEFT's input-require-grads hook on the embeddings (it calls enable_input_require_grads with checkpointing)
    peft_model = lora_model()
    ids, mask = grouped_prompts(TRL_4X4)
    config = trl_config()
    torch.manual_seed(2)
    expected = peft_model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    peft_model.train()
    peft_model.enable_input_require_grads()
    if checkpointing:
        peft_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    flags = {name: m.gradient_checkpointing for name, m in peft_model.named_modules()
             if hasattr(m, "gradient_checkpointing")}
    assert graph_decode.state_blockers(peft_model) == []
    torch.manual_seed(2)
    with torch.no_grad():
        got = graph_decode.generate(peft_model, ids, mask, config)
    assert torch.equal(got, expected)
    assert not got.requires_grad and not got.is_inference()  # fit for TRL's training forward
    assert peft_model.training  # the mode it came in with
    assert flags == {name: m.gradient_checkpointing for name, m in peft_model.named_modules()
                     if hasattr(m, "gradient_checkpointing")}
    assert any(flags.values()) == checkpointing


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


def one_step(model, config, device="cpu", dtype=torch.float32, weights=None):
    cache = decode_cache.StaticCache(config, torch.ones(2, 10, dtype=torch.long, device=device), 5, dtype)
    tokens = torch.ones(2, 1, dtype=torch.long, device=device)
    with torch.no_grad():
        return decode_math.decode_step(causal_lm(model), cache, tokens, torch.tensor(10, device=device),
                                        16, weights)


def test_decode_step_with_lora_under_autocast_reads_nothing_on_the_host():
    # what a GPU run decodes with: LoRA added in PEFT's order, the trainer's bf16 autocast, the float32 head
    peft_model = rho_lora_model(1e-3)
    weights = decode_math.decode_weights(causal_lm(peft_model), autocast=BF16)
    with HostReads() as watch:
        logits = one_step(peft_model, small_config(), dtype=BF16, weights=weights)
    assert watch.found == [] and logits.dtype == torch.float32


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
    from peft import get_peft_model

    with torch.device("meta"):  # and through the LoRA projections (one low-rank product for q, k, v)
        peft_model = get_peft_model(model, train_grpo.build_lora_config(4, 8))
    weights = decode_math.decode_weights(causal_lm(peft_model), lora="peft")
    assert weights.attention[0].qkv is not None
    logits = one_step(peft_model, config, device="meta", dtype=torch.bfloat16, weights=weights)
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
    assert decode_cache.bucket_length(slot, total) == expected


class CountingGenerate:
    """A LoRA-wrapped model's stand-in for the sampler: graph_decode decodes `model` (its get_base_model), and each
    call of transformers' generate() is counted, returning the prompts."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def get_base_model(self):
        return self.model

    def generate(self, **kwargs):
        self.calls.append(kwargs)
        return kwargs["input_ids"]


def test_the_sampler_uses_transformers_for_unsupported_calls_and_says_so(model):
    said = []
    counting = CountingGenerate(model)
    sampler = Sampler(SamplerSpec("graph_decode"), say=said.append)
    ids, mask = left_padded_prompts()
    for _ in range(2):
        sequences, _ = sampler.generate(counting, ids, mask, trl_config(repetition_penalty=1.3))
        assert sequences is ids
    assert len(counting.calls) == 2 and len(said) == 1 and "repetition_penalty=1.3" in said[0]
    out, logprobs = sampler.generate(counting, ids, mask, trl_config(do_sample=False))
    assert len(counting.calls) == 2 and out.shape[0] == 3 and logprobs.shape == (3, out.shape[1] - ids.shape[1])


@pytest.mark.parametrize("glue, words", [
    ("eager", "decode glue (norms, residual adds, rotary embedding, sinks, LoRA adds): eager"),
    ("compiled", "eager (DECODE_GLUE=compiled compiles only on CUDA; this is cpu)"),  # reached, and said why not
])
def test_the_sampler_passes_its_glue_setting_to_the_decode_step(model, monkeypatch, glue, words):
    from tes_grpo.layers import decode_glue

    monkeypatch.setattr(decode_glue, "_DECIDED", {})
    said = []
    ids, mask = left_padded_prompts()
    Sampler(SamplerSpec("graph_decode", glue=glue), say=said.append).generate(model, ids, mask,
                                                                                trl_config(do_sample=False))
    assert any(line.startswith("decode glue (") and words in line for line in said), said
    assert list(decode_glue._DECIDED) == [("cpu", glue)]


@pytest.mark.parametrize("max_batch", [1, 2])  # three rows: one a call, or two then one
def test_a_batch_split_by_the_memory_plan_gives_the_same_tokens_and_logprobs(model, max_batch):
    """Greedy decoding depends on no random draw, so rows generated in several calls equal rows generated at once;
    the calls end at different lengths and are padded as generate() pads a finished row."""
    ids, mask = left_padded_prompts()
    config = trl_config(do_sample=False, eos_token_id=[int(ids[0, -1])])  # some row may end early
    runs = {size: graph_decode.generate_in_calls(model, ids, mask, config, size, logprobs=True, say=print)
            for size in (None, max_batch)}
    (whole, whole_lp), (split, split_lp) = runs[None], runs[max_batch]
    assert whole.shape[0] == split.shape[0] == 3
    width = min(whole.shape[1], split.shape[1])
    assert torch.equal(whole[:, :width], split[:, :width])
    assert torch.equal(whole[:, width:], torch.full_like(whole[:, width:], PAD))
    assert torch.equal(split[:, width:], torch.full_like(split[:, width:], PAD))
    assert torch.allclose(whole_lp[:, :width - ids.shape[1]], split_lp[:, :width - ids.shape[1]], atol=1e-6)


def test_dropout_left_on_is_refused_once_at_install():
    peft_model = lora_model(dropout=0.1)
    assert graph_decode.state_blockers(peft_model) == []  # eval mode: dropout off
    on, why = graph_decode.auto_decode_graphs(peft_model, cuda=True)  # but GRPO will generate in train mode
    assert not on and "dropout p=[0.1] in train mode" in why
    peft_model.train()
    assert graph_decode.state_blockers(peft_model) == ["dropout p=[0.1] in train mode"]


def test_the_sampler_checks_only_the_call_options(model, monkeypatch):
    # the model's blockers are auto_decode_graphs' (once, when the trainer is built); a call checks its options only
    def checked(*args, **kwargs):
        raise AssertionError("blockers checked on a generate call")

    for name in ("graph_blockers", "model_blockers", "state_blockers"):
        monkeypatch.setattr(graph_decode, name, checked)
    ids, mask = left_padded_prompts()
    sequences, _ = Sampler(SamplerSpec("graph_decode"), say=print).generate(model, ids, mask,
                                                                            trl_config(do_sample=False))
    assert sequences.shape[0] == 3


class NotGptOss(torch.nn.Module):
    """A model of another architecture (only its config is read)."""

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(model_type="llama", _experts_implementation="grouped_mm", attention_dropout=0.0)


@pytest.mark.parametrize("experts, cuda, sharded, on, reason", [
    ("grouped_mm", True, False, True, "on: CUDA"),  # what a GPU run has: on
    ("batched_mm", True, False, True, "on: CUDA"),  # also capturable
    ("grouped_mm", False, False, False, "no CUDA device"),  # CPU: transformers' loop
    ("grouped_mm", True, True, False, "FSDP"),  # sharded weights
    ("eager", True, False, False, "experts_implementation='eager'"),  # reads the host mid-step
    ("not gpt-oss", True, False, False, "model_type='llama'"),  # another architecture
])
def test_auto_decode_graphs(experts, cuda, sharded, on, reason):
    if experts == "not gpt-oss":
        model = NotGptOss()
    else:
        model = GptOssForCausalLM(small_config(experts))
    decided, why = graph_decode.auto_decode_graphs(model, cuda=cuda, sharded=sharded)
    assert decided == on and reason in why and why.startswith("on" if on else "off"), why


# --- train_grpo wiring ------------------------------------------------------------------------------------------

@pytest.mark.slow
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
            MODEL_ID="tiny", DATA_DIR=str(data), EVAL_DIR=str(data / "eval"), OUT_DIR=str(tmp_path / f"run-{graphs}"),
            TOTAL_STEPS=1, NUM_GENERATIONS=4, GRADIENT_ACCUMULATION_STEPS=1, MAX_COMPLETION_LEN=32,
            GRADIENT_CHECKPOINTING=False, DECODE_GRAPHS="on" if graphs else "off")
        frame = train_grpo.load_training_data(settings, tokenizer)
        log = tmp_path / f"completions-{graphs}.csv"
        dataset = train_grpo.build_stream(frame, settings).to_iterable_dataset()
        layout = batch_layout(settings, int(frame["prompt_tokens"].max()))
        model = load_training_model(resolve_model_path("tiny"))
        trainer = train_grpo.build_trainer(settings, model, tokenizer, dataset, layout, CompletionLog(log))
        with prefill_shapes(model) as shapes:
            trainer.train()
        completions[graphs] = pd.read_csv(log, keep_default_na=False)["completion"].tolist()
    assert decoded == [1]  # the DECODE_GRAPHS run generated through graph_decode, the other did not
    assert [rows for rows, _ in shapes] == [1]  # TRL passed the prompt 4 times: prefilled once
    assert len(completions[True]) == 4 and completions[True] == completions[False]


# --- the benchmark's GRPO-shaped batches ---------------------------------------------------------------------------

def test_bench_generate_compares_shared_and_unshared_prefill(model, monkeypatch, capsys):
    # the GPU benchmark on the small CPU model: TRL-shaped batches, both prefills, both LoRA orders at a given rho in
    # the LoRA train-mode state, the compile count, the samplers against the trainer, and the tables last
    import benchmarks.bench_generate as bench

    monkeypatch.setattr(bench, "build_random_model", lambda attn_implementation: GptOssForCausalLM(small_config()))
    for name in ("synchronize", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 0)
    assert bench.main(["--NUM_SEQS=8", "--NUM_PROMPTS=2", "--PROMPT_LEN=20", "--PROMPT_LEN_SPREAD=6",
                       "--NEW_TOKENS=4", "--VARIANTS=static_unshared,static,static_merged,grouped_mm",
                       "--PREFILL_BUCKET=16", "--LORA_R=4", "--LORA_RHO=1e-2", "--RECOMPILE_LENGTHS=3",
                       "--COMPARE_SEQS=2", "--COMPARE_TOKENS=3", "--AUTOCAST=none"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("8 sequences = 2 distinct prompts x 4"):].splitlines()
    assert "rho 0.01" in table[0]
    assert [line.split()[0] for line in table[2:6]] == ["static_unshared", "static", "static_merged", "grouped_mm"]
    assert "prefill shapes (rows x length): 2x16, 2x32" in out  # shared: 2 rows; lengths 20 and 17-20 -> 32, 10 -> 16
    gaps = table[table.index(next(line for line in table if line.startswith("log-probabilities of 2 x 3"))):]
    assert [line.split("mean")[0].strip() for line in gaps[1:4]] == [
        "transformers generate", "graph_decode model peft", "graph_decode model merged"]
    assert float(gaps[2].split("mean |diff|")[1].split()[0]) < 1e-4  # float32 on the CPU: the trainer's numbers
    assert bench.main(["--VARIANTS=graphs_mxfp4_merged,graphs_fast"]) == 2  # an unknown flag is refused first
    ids, mask = bench.grpo_prompts(8, 2, 20, 6, model, 0)
    assert torch.equal(ids[:4], ids[:1].expand(4, -1)) and not torch.equal(ids[0], ids[4])  # groups in a row
    assert mask[0].all() and (mask.sum(1) >= 14).all()  # the first is longest; the others left-padded by <= 6


# (dtype, cache length, share of slots masked): attention_with_sinks through flex attention against the float64
# one_query_attention (decode_attention's kernel: tests/test_decode_attention.py)
FLEX_CASES = [
    (torch.float32, 40, 0.2),  # float32: equal to rounding
    (torch.float32, 1, 0.0),  # a single key
    (torch.bfloat16, 40, 0.2),  # bf16, the model's dtype
    (torch.bfloat16, 300, 0.5),  # a longer cache, half of it padding
]


def flex_inputs(dtype, length, masked):
    g = torch.Generator().manual_seed(length)
    sinks = torch.randn(8, generator=g).to(dtype)
    query = torch.randn(3, 8, 1, 16, generator=g).to(dtype)
    keys, values = (torch.randn(3, 2, length, 16, generator=g).to(dtype) for _ in range(2))
    mask = torch.where(torch.rand(3, length, generator=g) < masked, torch.finfo(torch.float32).min, 0.0)
    mask[:, 0] = 0.0  # every row attends to something, as the prompt's last token always is
    return query, keys, values, mask, sinks


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("dtype, length, masked", FLEX_CASES)
def test_flex_attention_with_sinks_matches_the_reference(dtype, length, masked):
    query, keys, values, mask, sinks = flex_inputs(dtype, length, masked)
    exact = decode_math.one_query_attention(*(t.double() for t in (query, keys, values, mask, sinks)), 0.25)
    flex = decode_math.attention_with_sinks(query, keys, values, mask, sinks, 0.25)
    assert flex.shape == exact.shape == (3, 1, 8 * 16) and flex.dtype == dtype
    error = (flex.double() - exact).abs()
    if dtype == torch.float32:
        assert error.max() < 1e-6
    else:  # bf16: the trainer's roundings (scores in float32, the log-sum-exp and the output in bf16)
        assert error.max() <= exact.abs().max() * 2 ** -5


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_sinks_are_applied_as_the_training_forward_applies_them():
    # transformers' flex attention (the GPU's training attention) cannot run sinks on a CPU, so its sink step is
    # repeated here from its source (integrations/flex_attention.py, 5.17-5.24), which must still contain it
    import inspect

    from torch.nn.attention.flex_attention import AuxRequest, flex_attention
    from transformers.integrations import flex_attention as hf_flex

    source = inspect.getsource(hf_flex.flex_attention_forward)
    for line in ("lse = lse.to(value.dtype)", "sinks = s_aux.view(1, -1, 1, 1).expand(",
                 "torch.logsumexp(torch.cat([lse_expanded, sinks], dim=-1), dim=-1, keepdim=True)",
                 "renorm_factor = torch.exp(lse_expanded - combined_lse)",
                 "attention_output = attention_output * renorm_factor"):
        assert line in source, line
    query, keys, values, mask, sinks = flex_inputs(torch.bfloat16, 300, 0.5)
    out, aux = flex_attention(query, keys, values, score_mod=lambda s, b, h, q, k: s + mask[b, k], scale=0.25,
                              enable_gqa=True, return_aux=AuxRequest(lse=True))
    lse = aux.lse.to(values.dtype).unsqueeze(-1)
    combined = torch.logsumexp(torch.cat([lse, sinks.view(1, -1, 1, 1).expand(3, 8, 1, 1)], dim=-1), dim=-1,
                               keepdim=True)
    expected = (out * torch.exp(lse - combined)).to(query.dtype).transpose(1, 2).reshape(3, 1, -1)
    ours = decode_math.attention_with_sinks(query, keys, values, mask, sinks, 0.25)
    assert torch.equal(ours, expected)
    float_sinks = (out.float() * torch.sigmoid(aux.lse - sinks.float().view(1, -1, 1)).unsqueeze(-1)).to(query.dtype)
    assert not torch.equal(ours, float_sinks.transpose(1, 2).reshape(3, 1, -1))  # float32 sinks would round elsewhere
