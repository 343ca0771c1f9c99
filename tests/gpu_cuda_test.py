"""CUDA variants of CPU tests: what only a GPU runs (compiled Triton kernels, CUDA graphs). Skipped without CUDA;
tests/gpu_suite.sh runs them on the GPU machine with the rest of the suite (TESTING.md). The training step's bit
for bit check on CUDA is test_mxfp4_experts.py's own (it runs on the GPU when there is one)."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig, GptOssConfig, GptOssForCausalLM
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

from tes_grpo.experts.mxfp4 import fake_quantize_expert_param

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="CUDA only: compiled Triton kernels and CUDA graphs need a GPU (the CPU tests "
                                       "run the same code under Triton's interpreter or without graphs)")


def test_triton_dequantization_equals_torchs_codec_bit_for_bit():
    pytest.importorskip("triton", reason="requirements-gpu.txt installs triton")
    from tes_grpo.experts.mxfp4_dequant import dequantize_with_torch, dequantize_with_triton

    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (4, 96, 5, 16), dtype=torch.uint8, generator=generator).cuda()
    scales = torch.randint(100, 140, (4, 96, 5), dtype=torch.uint8, generator=generator).cuda()
    for dtype in (torch.bfloat16, torch.float32):
        assert torch.equal(dequantize_with_triton(blocks, scales, dtype), dequantize_with_torch(blocks, scales, dtype))


# (weight [E, out, in] or "every" (every byte at every scale, 0 and 255 among them), program or None: DEQUANT_HOPPER)
HOPPER_DEQUANTIZE_CASES = [
    ("every", None),
    ((4, 96, 160), None),  # partial tiles both ways
    ((1, 384, 128), (256, 128, 8)),  # the second row program reaches past the padded weight: its loads masked
    ((2, 256, 256), (256, 128, 8)),
]


@pytest.mark.parametrize("shape, program", HOPPER_DEQUANTIZE_CASES)
def test_triton_dequantization_from_the_hopper_layout_equals_torchs_codec_bit_for_bit(shape, program):
    """What a resident layer runs on the GPU: the compiled kernel on the Hopper layout, bf16 and float32."""
    pytest.importorskip("triton", reason="requirements-gpu.txt installs triton")
    from tes_grpo.experts.mxfp4 import to_hopper_layout
    from tes_grpo.experts.mxfp4_dequant import dequantize_with_torch, dequantize_with_triton

    generator = torch.Generator().manual_seed(0)
    if shape == "every":
        blocks = torch.arange(256, dtype=torch.uint8).repeat(256).view(1, 256, 16, 16)
        scales = torch.arange(256, dtype=torch.uint8).view(1, 256, 1).expand(1, 256, 16).contiguous()
    else:
        experts, rows, cols = shape
        blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), dtype=torch.uint8, generator=generator)
        scales = torch.randint(100, 140, (experts, rows, cols // 32), dtype=torch.uint8, generator=generator)
    size = (blocks.shape[1], blocks.shape[2] * 32)
    stored = to_hopper_layout(blocks.cuda(), "blocks"), to_hopper_layout(scales.cuda(), "scales")
    for dtype, as_bits in ((torch.bfloat16, torch.int16), (torch.float32, torch.int32)):  # signed zeros, infs
        ours = dequantize_with_triton(*stored, dtype, program, size=size)
        codec = dequantize_with_torch(blocks.cuda(), scales.cuda(), dtype)
        assert torch.equal(ours.view(as_bits), codec.view(as_bits))


def test_bits_upcast_equals_the_codec_on_cuda():
    """mxfp4_decode's own upcast (Tiles.upcast="bits") compiled: every byte times every scale 1..254, bit for bit
    against the codec. The CPU test checks the arithmetic; this one the GPU's bf16 multiplies (the code 0.5 passes
    through a bf16 subnormal, which a multiply that flushed subnormals would turn into 0)."""
    pytest.importorskip("triton", reason="requirements-gpu.txt installs triton")
    from tes_grpo.experts import mxfp4_decode as md
    from tes_grpo.experts.mxfp4 import dequantize_mxfp4

    blocks = torch.arange(256, dtype=torch.uint8, device="cuda").reshape(1, 16, 16).expand(16, 16, 16).contiguous()
    for first in range(1, 255, 16):  # a row: all 256 bytes under one scale
        scales = (first + torch.arange(16, device="cuda")).clamp(max=254).to(torch.uint8)[:, None].expand(16, 16)
        ours = md.upcast_mxfp4(blocks, scales.contiguous())
        assert torch.equal(ours.view(torch.int16), dequantize_mxfp4(blocks, scales, torch.bfloat16).view(torch.int16))


def exact_mxfp4_mlp(hidden: int, intermediate: int, seed: int) -> GptOssMLP:
    """A gpt-oss MLP of 8 experts (top 4) on the GPU in bf16, its expert weights exactly MXFP4 (as loaded from a
    checkpoint), frozen."""
    config = GptOssConfig(hidden_size=hidden, intermediate_size=intermediate, num_local_experts=8,
                          num_experts_per_tok=4)
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(seed)
    mlp = GptOssMLP(config)
    with torch.no_grad():
        for name, param in mlp.named_parameters():
            param.normal_(0.0, 0.5 if "bias" in name else 0.1)
        mlp = mlp.to(torch.bfloat16)
        for name in ("gate_up_proj", "down_proj"):
            getattr(mlp.experts, name).copy_(fake_quantize_expert_param(getattr(mlp.experts, name)))
    return mlp.to("cuda").requires_grad_(False)


@pytest.mark.parametrize("variant", [{}, {"ptx": False}, {"block_k": 256}, {"upcast": "dot_scaled", "swap": False},
                                     {"upcast": "bits", "swap": False}, {"upcast": "bits"},
                                     {"upcast": "bits", "block_m": 8},
                                     {"upcast": "bits", "block_n": 128, "block_k": 64},
                                     {"upcast": "bits", "block_n": 64, "block_k": 64}],
                         ids=["hopper", "hopper-bitops", "hopper-256", "dot_scaled", "bits", "bits-swap-16",
                              "bits-swap-8", "tiles-128-64", "tiles-64-64"])
@pytest.mark.parametrize("routing", ["torch", "triton", "fused"])
@pytest.mark.parametrize("tokens", [1, 37])
def test_mxfp4_decode_kernel_matches_the_mlp_on_cuda(tokens, routing, variant):
    """The compiled kernel (each variant of mxfp4_decode.Tiles), its rows routed by torch or by moe_routing's
    program, against transformers' own MLP on the same GPU. Tensor-core sums run in another order than cuBLAS's, so
    this is to bf16 rounding, not bit for bit (the CPU test is bit for bit, interpreted)."""
    pytest.importorskip("triton", reason="requirements-gpu.txt installs triton")
    from tes_grpo.experts import mxfp4_decode as md

    mlp = exact_mxfp4_mlp(96, 160, seed=0)
    x = torch.randn(1, tokens, 96, device="cuda").to(torch.bfloat16)
    pack = md.retiled(md.pack_experts(mlp.experts), md.Tiles(**variant))  # a copy for another layout or tile
    ours = md.moe_forward(mlp, pack, x, routing=routing).float()
    reference = mlp(x)[0].float()
    torch.testing.assert_close(ours, reference, rtol=2e-2, atol=2e-2 * float(reference.abs().max()))


def test_the_hopper_unpackings_equal_the_bits_upcast_bit_for_bit_on_cuda():
    """The default kernel (the Hopper layout, unpacked by triton_kernels' PTX on Hopper, which the CPU tests'
    interpreter never runs), the same unpacked by Triton's bit operations (as on older GPUs), and the bits upcast on
    a tile-order copy give the same output bit for bit: the same bf16 weights, the same sums."""
    pytest.importorskip("triton", reason="requirements-gpu.txt installs triton")
    from tes_grpo.experts import mxfp4_decode as md

    mlp = exact_mxfp4_mlp(256, 384, seed=1)
    with torch.no_grad():
        x = torch.randn(1, 64, 256, device="cuda").to(torch.bfloat16)
        pack = md.pack_experts(mlp.experts)
        default = md.moe_forward(mlp, pack, x)
        bitops = md.moe_forward(mlp, md.retiled(pack, md.Tiles(ptx=False)), x)
        bits = md.moe_forward(mlp, md.retiled(pack, md.Tiles(upcast="bits", num_stages=3)), x)
    assert torch.equal(bitops, default) and torch.equal(bits, default)


@pytest.mark.parametrize("tokens, top_k, experts", [
    (64, 4, 32),  # a 20B decode step at 64 sequences
    (256, 4, 32),  # MAX_ROWS routed rows
    (16, 4, 128),  # the 120B's experts
    (1, 4, 32),  # one sequence: most experts get no row
])
def test_routing_kernel_equals_torch_on_cuda(tokens, top_k, experts):
    pytest.importorskip("triton", reason="requirements-gpu.txt installs triton")
    from tes_grpo.experts.moe_routing import route_with_torch, route_with_triton

    generator = torch.Generator().manual_seed(tokens)
    indices = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)]).cuda()
    for ours, theirs in zip(route_with_triton(indices, experts), route_with_torch(indices, experts), strict=True):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)


@pytest.mark.parametrize("tokens, experts", [
    (64, 32),  # a 20B decode step at 64 sequences
    (256, 32),  # MAX_ROWS routed rows
    (64, 128),  # the 120B's experts
    (1, 32),  # one sequence
])
def test_fused_top_k_and_routing_equal_torch_on_cuda(tokens, experts):
    """moe_routing's one program against torch.topk on CUDA and route_with_torch, on bf16 logits as the router gives
    them (ties among a token's largest happen there). Values always equal; a token whose top-k+1 logits are distinct
    gets the same experts in the same order; a token with ties the same experts in some order, unless the tie is at
    the k-th place (then which of the equal ones is picked is each implementation's own)."""
    pytest.importorskip("triton", reason="requirements-gpu.txt installs triton")
    from tes_grpo.experts.moe_routing import route_with_torch, top_k_route_with_triton

    generator = torch.Generator(device="cuda").manual_seed(tokens + experts)
    logits = torch.randn(tokens, experts, generator=generator, device="cuda").to(torch.bfloat16)
    values, indices, order, offsets, token_rows = top_k_route_with_triton(logits, 4)
    torch_values, torch_indices = torch.topk(logits, 4)
    assert torch.equal(values, torch_values)
    top = logits.float().topk(5).values
    distinct = (top[:, :-1] > top[:, 1:]).all(dim=1)
    assert torch.equal(indices[distinct], torch_indices[distinct])
    kth_tie = top[:, 3] == top[:, 4]
    same_set = (indices.sort(dim=1).values == torch_indices.sort(dim=1).values).all(dim=1)
    assert same_set[~kth_tie].all()
    for ours, theirs in zip((order, offsets, token_rows), route_with_torch(indices, experts), strict=True):
        assert torch.equal(ours, theirs)


PAD = 5


def small_cuda_model(experts_mxfp4: bool = False) -> GptOssForCausalLM:
    """A small gpt-oss in bf16 on CUDA, as models load on a GPU (float32 grouped_mm on CUDA copies through the host in
    torch 2.11, which a graph capture refuses; train_grpo never runs it); experts_mxfp4: expert weights exactly
    MXFP4, as loaded from a checkpoint, so graph_decode can decode them with the MXFP4 kernel."""
    config = GptOssConfig(
        vocab_size=512, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2, pad_token_id=PAD, eos_token_id=3, bos_token_id=1,
        attn_implementation="eager")
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    model = GptOssForCausalLM(config).to("cuda", torch.bfloat16).eval()
    if experts_mxfp4:
        model.requires_grad_(False)  # frozen as under LoRA: graph_decode packs no weight that training changes
        with torch.no_grad():
            for layer in model.model.layers:
                for name in ("gate_up_proj", "down_proj"):
                    getattr(layer.mlp.experts, name).copy_(fake_quantize_expert_param(getattr(layer.mlp.experts, name)))
    return model


def left_padded_ids() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(10, 512, (3, 13), generator=generator)
    mask = torch.ones_like(ids)
    for row, pads in enumerate((0, 4, 9)):  # left-padded as TRL pads them
        mask[row, :pads] = 0
        ids[row, :pads] = PAD
    return ids.cuda(), mask.cuda()


def generation_config(**changes) -> GenerationConfig:
    settings = {"max_new_tokens": 20, "do_sample": False, "pad_token_id": PAD, "bos_token_id": 1, "eos_token_id": [3],
                "use_cache": True, "disable_compile": True}
    return GenerationConfig(**{**settings, **changes})


# (sequences, cache length, slots seen): the compiled kernel at gpt-oss's heads against float64 and flex attention
@pytest.mark.parametrize("batch, length, seen", [
    (64, 2048, 1500),  # the recipe's 64 sequences over a full layer's bucket: one part each
    (2, 2048, 700),  # 2 sequences: each one's slots cut into parts and combined
    (64, 128, None),  # a sliding layer's ring, every slot seen
])
def test_decode_attention_kernel_matches_float64_and_flex_on_cuda(batch, length, seen):
    pytest.importorskip("triton", reason="requirements-gpu.txt installs triton")
    from tes_grpo.sampling import decode_attention, decode_math

    g = torch.Generator(device="cuda").manual_seed(0)
    query = torch.randn(batch, 64, 1, 64, generator=g, device="cuda").to(torch.bfloat16)
    keys, values = (torch.randn(batch, 8, length + 64, 64, generator=g, device="cuda").to(torch.bfloat16)[:, :, :length]
                    for _ in range(2))
    mask = torch.zeros(batch, length, device="cuda")
    mask[1::2, :40] = torch.finfo(torch.float32).min  # left padding
    if seen is not None:
        mask[:, seen:] = torch.finfo(torch.float32).min
    seen_t = None if seen is None else torch.tensor(seen, device="cuda")
    out, lse = decode_attention.attention(query, keys, values, mask, 0.125, seen_t)
    scores = (query.double() @ keys.double().repeat_interleave(8, 1).transpose(-1, -2)) * 0.125 \
        + mask.double()[:, None, None, :]
    exact = torch.softmax(scores, -1) @ values.double().repeat_interleave(8, 1)
    assert (lse.double() - torch.logsumexp(scores, -1)).abs().max() < 1e-4
    flex_out, _ = torch.compile(decode_math.flex_decode_kernel, fullgraph=True)(query, keys, values, mask, 0.125)
    error, flex_error = ((o.double() - exact).abs() for o in (out, flex_out))
    assert error.max() <= 2 * flex_error.max() and error.mean() <= 1.5 * flex_error.mean(), \
        (error.max(), flex_error.max(), error.mean(), flex_error.mean())
    if seen is not None:  # nothing past `seen` is read
        keys[:, :, seen:] = float("nan")
        values[:, :, seen:] = float("nan")
        again = decode_attention.attention(query, keys, values, mask, 0.125, seen_t)
        assert torch.equal(again[0], out) and torch.equal(again[1], lse)


# (rows, which product): gpt-oss-20b's q, k, v with LoRA, its o_proj with LoRA, a product without an adapter
@pytest.mark.parametrize("rows, product", [(64, "qkv"), (1, "qkv"), (37, "o"), (64, "router")])
def test_decode_linear_rounds_as_peft_and_no_further_from_exact_than_cublas_on_cuda(rows, product):
    """decode_linear's kernel against the float64 sums rounded where PEFT's forward under the trainer's bf16
    autocast rounds (the bias added before the base product's rounding, as cuBLAS's bias epilogue adds it): only
    float32 sums in another order may move a bf16 rounding, by one unit in the last place of the result's largest
    element, on a few elements (a skipped rounding or the bias added after it moves a quarter of them); and no more
    elements off than what decode_math computed before with cuBLAS (F.linear with the bias, LowRank, the LoRA add),
    which at o_proj's shape sums less exactly."""
    pytest.importorskip("triton", reason="requirements-gpu.txt installs triton")
    from tes_grpo.layers import decode_glue
    from tes_grpo.layers.lora import low_rank
    from tes_grpo.sampling import decode_linear

    g = torch.Generator(device="cuda").manual_seed(0)
    sizes, k = {"qkv": ((4096, 512, 512), 2880), "o": ((2880,), 4096), "router": ((32,), 2880)}[product]

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)

    x = randn(rows, 1, k)
    weights = [randn(n, k, scale=k ** -0.5) for n in sizes]
    biases = [randn(n, scale=0.1) for n in sizes]
    low = None if product == "router" else low_rank(
        [(randn(4, k, scale=k ** -0.5), randn(n, 4, scale=0.05), 2.0) for n in sizes], torch.bfloat16)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
        outs = [torch.nn.functional.linear(x, w, b) for w, b in zip(weights, biases, strict=True)]
        cublas = torch.cat(outs if low is None else decode_glue.EAGER.add_lora(outs, list(low(x))), dim=-1)
        ours = decode_linear.linear(x, weights, torch.cat(biases), None if low is None else (low.a, low.b, low.scale))
    exact = decode_linear.reference(x, weights, torch.cat(biases), None if low is None else (low.a, low.b, low.scale))
    unit = exact.float().abs().max() * torch.finfo(torch.bfloat16).eps
    assert ours.shape == exact.shape and ours.dtype == torch.bfloat16
    assert float((ours.float() - exact.float()).abs().max()) <= unit
    off, cublas_off = (float((t != exact).float().mean()) for t in (ours, cublas))
    assert off <= 0.005 and off <= cublas_off + 0.002, (off, cublas_off)


@pytest.mark.parametrize("seed", [5, 6, 7])
def test_the_draw_kernel_draws_torchs_tokens_from_torchs_random_numbers_on_cuda(seed):
    """draw_kernel.py on gpt-oss's vocabulary at GRPO's 64 rows (a top-k warper's -inf in one row): the tokens
    torch.multinomial draws from the same seed (a near tie could flip one, about once in millions of draws), the
    generator left where torch.multinomial leaves it, and log_softmax's log-probabilities to float32 sums."""
    from tes_grpo.sampling import token_sampling

    g = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.randn(64, 201088, device="cuda", generator=g) * 3
    scores[1, ::3] = float("-inf")
    results = {}
    for kernel in token_sampling.DRAW_KERNELS:
        torch.manual_seed(seed)
        chosen, logprob = token_sampling.draw(scores, True, True, kernel=kernel)
        results[kernel] = chosen, logprob, torch.cuda.get_rng_state()
    (ours, our_logprob, our_state), (theirs, their_logprob, their_state) = results["triton"], results["torch"]
    assert torch.equal(ours, theirs)
    assert torch.equal(our_state, their_state)
    assert (our_logprob - their_logprob).abs().max() < 1e-4
    assert ours[1] % 3 != 0


@pytest.mark.parametrize("experts", ["model", "mxfp4"])
def test_graph_decode_replays_its_steps_as_cuda_graphs_from_the_models_best_first_token(experts):
    """The captured steps must give the tokens the same steps give eagerly for the first 10 tokens of every row (a
    stale cache or a wrong position diverges at once; after that, bf16 sums in another order may flip a near tie:
    seen once, at token 20), with the model's experts and with the MXFP4 kernel (its routing as a decode step of up
    to 256 rows takes it on CUDA: moe_routing's program, inside the graph). Against transformers: the first token
    (from graph_decode's prefill, left padding included) must be one the model's own forward rates within bf16
    rounding of its best; a bf16 near tie made it differ from generate's pick once. The CPU tests compare
    graph_decode's steps with generate's token for token in float32."""
    from tes_grpo.sampling import graph_decode

    model = small_cuda_model(experts_mxfp4=experts != "model")
    ids, mask = left_padded_ids()
    generation = generation_config()
    said = []
    replayed = graph_decode.generate(model, ids, mask, generation, graphs=True, experts=experts, say=said.append)
    eager = graph_decode.generate(model, ids, mask, generation, graphs=False, experts=experts, say=said.append)
    if experts != "model":
        assert any("packed 4 layers' experts as MXFP4" in line for line in said), said
    agree = ids.shape[1] + 10
    assert torch.equal(replayed[:, :agree], eager[:, :agree])
    with torch.no_grad():  # positions as generate gives them to left-padded rows
        logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    logprobs = logits[:, -1].float().log_softmax(-1)
    first = replayed[:, ids.shape[1]]
    shortfall = logprobs.max(-1).values - logprobs.gather(1, first[:, None]).squeeze(1)
    assert (shortfall < 0.05).all(), shortfall  # a near tie in bf16, not another distribution


def test_graph_decode_stops_when_every_row_ended_and_draws_no_random_numbers_past_it():
    """The loop reads "every row ended" one token late on CUDA (a pinned copy and an event), so the step after the
    end has run and drawn before the loop sees it: that token must be dropped and its random numbers given back.
    Sampled with graphs: once without end tokens, then with end tokens taken from that run so every row ends early;
    the tokens must be the first run's up to each row's end, and the random state the one that exactly as many
    draws leave (a run of that many tokens with no end token)."""
    from tes_grpo.sampling import graph_decode

    model = small_cuda_model()
    ids, mask = left_padded_ids()
    quiet = {"graphs": True, "say": lambda line: None}
    torch.manual_seed(7)
    free = graph_decode.generate(model, ids, mask, generation_config(do_sample=True, eos_token_id=[10_000]),
                                 **quiet)  # 10,000: outside the vocabulary, so no row ends
    tokens = free[:, ids.shape[1]:]
    ends = [3, 5, 6]  # each row's last token
    config = generation_config(do_sample=True, eos_token_id=[int(tokens[row, end]) for row, end in enumerate(ends)])
    torch.manual_seed(7)
    stopped = graph_decode.generate(model, ids, mask, config, **quiet)
    after_stop = torch.cuda.get_rng_state()
    new = stopped.shape[1] - ids.shape[1]
    assert new <= max(ends) + 1 < config.max_new_tokens  # every row ended before max_new_tokens
    for row in range(3):
        end = int(torch.isin(stopped[row, ids.shape[1]:], torch.tensor(config.eos_token_id, device="cuda"))
                  .nonzero()[0])
        assert torch.equal(stopped[row, ids.shape[1]:ids.shape[1] + end + 1], tokens[row, :end + 1])
        assert (stopped[row, ids.shape[1] + end + 1:] == PAD).all()
    torch.manual_seed(7)
    unstopped = generation_config(do_sample=True, eos_token_id=[10_000], max_new_tokens=new)  # no token ends a row
    graph_decode.generate(model, ids, mask, unstopped, **quiet)
    assert torch.equal(after_stop, torch.cuda.get_rng_state())


def test_mxfp4_codec_on_cuda_gives_the_cpus_codes():
    """quantize_mxfp4 packs a non-resident layer for the decode kernel on the GPU (mxfp4_decode.pack_experts): its
    codes and scales must be the CPU's, and exactly MXFP4 weights must come back bit for bit."""
    from tes_grpo.experts.mxfp4 import dequantize_mxfp4, quantize_mxfp4

    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(8, 160, 96, generator=generator) * 0.1).to(torch.bfloat16)  # [E, in, out]
    weight[0, :32, 0] = 0.0  # an all-zero block
    # the packed layout: [E, out, in], blocks of 32 inputs (as mxfp4_decode._pack_param quantizes)
    exact = fake_quantize_expert_param(weight).transpose(1, 2).contiguous()
    weight = weight.transpose(1, 2).contiguous()
    for w in (weight, exact):
        cpu_blocks, cpu_scales = quantize_mxfp4(w)
        blocks, scales = quantize_mxfp4(w.cuda())
        assert torch.equal(blocks.cpu(), cpu_blocks) and torch.equal(scales.cpu(), cpu_scales)
    blocks, scales = quantize_mxfp4(exact.cuda())
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.bfloat16).cpu(), exact)


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units in the last place of bf16, elementwise (from the bit patterns: consecutive bf16 values of one
    sign have consecutive patterns; values of opposite signs count as far apart)."""
    ints = [t.contiguous().view(torch.int16).int() for t in (a, b)]
    return torch.where((ints[0] < 0) == (ints[1] < 0), (ints[0] - ints[1]).abs(), 1 << 16)


def glue_inputs(name: str, rows: int = 64):
    """Inputs of a glue function at a 20B decode step's shapes (64 rows, hidden 2880, 64 query and 8 key/value heads
    of 64), in bf16 as the model runs, with the query laid out as the decode step's (a transposed view)."""
    g = torch.Generator().manual_seed(len(name))

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).to(torch.bfloat16).cuda()

    if name in ("rms_norm", "residual_norm"):
        weight = (1 + 0.3 * torch.randn(2880, generator=g)).to(torch.bfloat16).cuda()
        residual = randn(rows, 1, 2880, scale=20.0)
        if name == "rms_norm":
            return residual, weight, 1e-5
        return residual, randn(rows, 1, 2880), weight, 1e-5
    if name == "rope_qk":
        angle = torch.rand(1, 1, 32, generator=g) * 6.3  # gpt-oss rotates the two halves of a head: D / 2 angles
        cos, sin = (f(angle).to(torch.bfloat16).cuda() for f in (torch.cos, torch.sin))
        return randn(rows, 1, 64, 64).transpose(1, 2), randn(rows, 8, 1, 64), cos, sin
    if name == "with_sinks":
        lse = (10 + 3 * torch.randn(rows, 64, 1, generator=g)).cuda()  # flex attention's float32 log-sum-exp
        return randn(rows, 64, 1, 64), lse, randn(64)
    if name == "add_lora":
        sizes = (4096, 512, 512)  # q, k, v
        return [randn(rows, 1, n) for n in sizes], [randn(rows, 1, n, scale=1e-2) for n in sizes]
    raise ValueError(name)


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])  # decode steps run under the trainer's autocast
@pytest.mark.parametrize("name", ["rms_norm", "residual_norm", "rope_qk", "with_sinks", "add_lora"])
def test_compiled_glue_equals_the_eager_glue_on_cuda(name, autocast):
    """Each glue function compiled as a GPU decode step runs it (decode_glue.decide_glue: inductor with
    emulate_precision_casts) against itself run eagerly, on the same inputs. The rotary embedding and the LoRA add
    are bf16 multiplications and additions, each rounded where eager rounds: bit for bit. The residual add too.
    The RMSNorm's float32 mean of squares is a reduction another kernel sums in another order, and the sink step's
    float32 exp and log come from Triton's math library, not CUDA's: a float32 result may differ in its last bits,
    which moves the bf16 rounding after it by one unit in the last place where it lies near a rounding boundary: at
    most 1 ulp, on at most 1 % of the elements (a float32 ulp moves a bf16 rounding on ~2^-16 of values; 1 % leaves
    room for a whole row's mean moving at once, and still fails if a bf16 rounding were skipped, which moves far more
    elements). Without autocast the compiled glue's sink step is the eager one (decode_glue.SinksUnderAutocast)."""
    from tes_grpo.layers import decode_glue

    compiled = getattr(decode_glue.decide_glue("cuda", "compiled"), name)
    eager = getattr(decode_glue.EAGER, name)
    args = glue_inputs(name)
    with torch.no_grad(), torch.autocast("cuda", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        expected, got = eager(*args), compiled(*args)
    expected = list(expected) if isinstance(expected, (list, tuple)) else [expected]
    got = list(got) if isinstance(got, (list, tuple)) else [got]
    if name == "residual_norm":  # the sum itself is exact bf16 arithmetic
        assert torch.equal(got.pop(0), expected.pop(0))
    for ours, theirs in zip(got, expected, strict=True):
        assert ours.dtype == theirs.dtype == torch.bfloat16 and ours.shape == theirs.shape
        if name in ("rope_qk", "add_lora"):
            assert torch.equal(ours, theirs)
            continue
        ulps = bf16_ulps(ours, theirs)
        assert int(ulps.max()) <= 1, int(ulps.max())
        assert float((ulps > 0).float().mean()) <= 0.01, float((ulps > 0).float().mean())


def test_a_compiled_glue_function_takes_more_batch_sizes_than_dynamos_default_limit():
    """Each batch size is one more graph of a compiled glue function (fixed shapes); dynamo's default limit of 8 would
    fail a fullgraph function at the ninth (decode_glue.GRAPHS_PER_FUNCTION raises it)."""
    from tes_grpo.layers import decode_glue

    rms_norm = decode_glue.compiled(decode_glue.rms_norm)
    weight = torch.ones(64, dtype=torch.bfloat16, device="cuda")
    for rows in range(1, 12):
        hidden = torch.randn(rows, 1, 64, device="cuda").to(torch.bfloat16)
        assert rms_norm(hidden, weight, 1e-5).shape == hidden.shape


def test_compiled_glue_decodes_the_eager_glues_tokens_on_cuda():
    """graph_decode with the glue compiled (DECODE_GLUE=compiled) against the glue run eagerly, both replaying CUDA
    graphs, under the trainer's bf16 autocast: the same tokens for the first 10 of every row (the compiled norm and
    sink step may differ by one bf16 ulp on a few elements, see above, which can flip a bf16 near tie later on), and
    each said how its glue ran."""
    from tes_grpo.layers import decode_glue
    from tes_grpo.sampling import graph_decode

    model = small_cuda_model()
    ids, mask = left_padded_ids()
    runs, said = {}, []
    decode_glue._DECIDED.clear()  # each mode decided (and said) in this test
    for glue in ("compiled", "eager"):
        runs[glue] = graph_decode.generate(model, ids, mask, generation_config(), graphs=True, say=said.append,
                                           autocast=torch.bfloat16, glue=glue)
    agree = ids.shape[1] + 10
    assert torch.equal(runs["compiled"][:, :agree], runs["eager"][:, :agree])
    assert any(line.startswith("decode glue (") and ": compiled (torch.compile" in line for line in said), said
    assert any(line.startswith("decode glue (") and line.endswith(": eager") for line in said), said


def train_glue_inputs(name: str, rows: int, length: int):
    """Inputs of a training glue function at the 20B's training shapes ([rows, length] tokens), in bf16 as training
    runs them under autocast, the query laid out as the attention makes it (a transposed view), each to take a
    gradient."""
    g = torch.Generator().manual_seed(len(name) + length)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).to(torch.bfloat16).cuda()

    if name == "norm":
        weight = (1 + 0.3 * torch.randn(2880, generator=g)).to(torch.bfloat16).cuda()
        return [randn(rows, length, 2880, scale=20.0)], (weight, 1e-5)
    if name == "rotary":
        angle = torch.rand(rows, length, 32, generator=g) * 6.3  # gpt-oss rotates two halves: D / 2 angles
        cos, sin = (f(angle).to(torch.bfloat16).cuda() for f in (torch.cos, torch.sin))
        return [randn(rows, length, 64, 64).transpose(1, 2), randn(rows, 8, length, 64)], (cos, sin)
    if name == "add":
        return [randn(rows, length, 4096), randn(rows, length, 4096, scale=1e-2)], (8 / 3,)  # rounds in bf16
    if name == "sinks":  # flex attention's output as transformers returns it, its float32 log-sum-exp rounded
        lse = (10 + 3 * torch.randn(rows, 64, length, generator=g)).to(torch.bfloat16).cuda()
        return [randn(rows, length, 64, 64), lse], (randn(64),)
    raise ValueError(name)


@pytest.mark.parametrize("name", ["norm", "rotary", "add", "sinks"])
def test_compiled_training_glue_equals_the_eager_forward_and_its_gradients_on_cuda(name):
    """train_glue's functions compiled (TRAIN_GLUE=compiled on a GPU) against the same functions run eagerly, the
    libraries' own code, at two lengths (one compiled graph takes both: the length is dynamic). Forward: the rotary
    embedding and the LoRA add are elementwise bf16 steps rounded where eager rounds, so bit for bit; the norm's float32
    mean and the sink step's float32 exp and log may move a bf16 rounding by 1 ulp on a few elements (as
    decode_glue's, above). Backward: eager autograd rounds
    each step's gradient to bf16, the compiled backward keeps float32 between steps and rounds once, so the gradients
    agree within a few bf16 ulps (the LoRA add's backward is one multiplication: bit for bit)."""
    from tes_grpo.layers import train_glue

    compiled, eager = train_glue.decide("cuda", "compiled"), train_glue.EAGER
    assert compiled.how.startswith("compiled")
    for length in (37, 301):
        tensors, extra = train_glue_inputs(name, 2, length)
        results = []
        for glue in (eager, compiled):
            leaves = [t.detach().clone().requires_grad_() for t in tensors]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = getattr(glue, name)(*leaves, *extra)
            out = list(out) if isinstance(out, tuple) else [out]
            g = torch.Generator(device="cuda").manual_seed(1)
            torch.autograd.backward(out, [torch.randn(o.shape, device="cuda", generator=g).to(o.dtype) for o in out])
            results.append((out, [leaf.grad for leaf in leaves]))
        (want, want_grads), (got, got_grads) = results
        for ours, theirs in zip(got, want, strict=True):
            assert ours.dtype == theirs.dtype == torch.bfloat16 and ours.shape == theirs.shape
            ulps = bf16_ulps(ours, theirs)
            if name in ("norm", "sinks"):
                assert int(ulps.max()) <= 1 and float((ulps > 0).float().mean()) <= 0.01
            else:
                assert torch.equal(ours, theirs)
        for ours, theirs in zip(got_grads, want_grads, strict=True):
            assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
            if name == "add":
                assert torch.equal(ours, theirs)
            else:
                close = (ours.float() - theirs.float()).abs() <= 2 ** -6 * theirs.float().abs() + 1e-6
                assert float(close.float().mean()) >= 0.99, float(close.float().mean())


@pytest.fixture
def own_flex_compilations():
    """Dynamo's caches emptied before and after a test that compiles flex attention for a configuration of its own
    (head counts, which inputs take gradients): transformers compiles flex attention once per process, and past
    dynamo's recompile limit (8 graphs) it runs the unfused eager form, whose saved tensors differ from the compiled
    one's, which fails gradient checkpointing's recompute in the tests after (seen on the GPU machine)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.usefixtures("own_flex_compilations")
def test_training_glue_gives_a_lora_model_the_eager_loss_and_gradients_on_cuda():
    """A small gpt-oss under LoRA with flex attention, trained as train_grpo trains it on a GPU (autocast, gradient
    checkpointing), with TRAIN_GLUE=compiled installed (norms, LoRA projections, rotary embedding, flex attention's
    sink step) against the libraries' forward: the same loss to bf16 precision and the adapter's gradients close;
    the installed glue really ran (its compiled functions hold graphs)."""
    from peft import LoraConfig, get_peft_model

    from tes_grpo.layers import train_glue

    base = small_cuda_model()
    base.set_attn_implementation("flex_attention")
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.05)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids, mask = left_padded_ids()
    glue = train_glue.decide("cuda", "compiled")
    results = []
    for use in (False, True):
        if use:
            assert train_glue.use_train_glue(model, glue) == (9, 16)
            assert train_glue.rope_through(glue) and train_glue.sinks_through(glue)
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, attention_mask=mask).logits.float().square().mean()
            loss.backward()
        finally:
            train_glue.drop_train_glue(model)
            train_glue.rope_through(None)
            train_glue.sinks_through(None)
        grads = [p.grad.detach().clone() for p in model.parameters() if p.requires_grad]
        model.zero_grad(set_to_none=True)
        results.append((float(loss.detach()), grads))
    (loss, grads), (glued_loss, glued_grads) = results
    assert abs(glued_loss - loss) <= 1e-2 * abs(loss)
    for ours, theirs in zip(glued_grads, grads, strict=True):
        assert float((ours - theirs).norm()) <= 0.05 * float(theirs.norm()) + 1e-6
    cache = [len(torch._dynamo.eval_frame._debug_get_cache_entry_list(f.__code__))
             for f in (train_glue.rms_norm, train_glue.add_scaled, train_glue.rope, train_glue.with_sinks)]
    assert all(cache), cache


@pytest.mark.usefixtures("own_flex_compilations")
def test_flex_attention_with_the_training_sink_step_equals_transformers_on_cuda():
    """transformers' flex_attention_forward with gpt-oss's sinks, in the training forward (gradients on, autocast),
    against the same call through train_glue.SinksInTraining (flex attention without the sinks, then the glue's
    compiled sink step on the transposed output): the output within 1 bf16 ulp on at most 1 % of the elements, the
    query's gradient close; under no_grad the wrapper calls transformers' function itself (the same tensor)."""
    from types import SimpleNamespace

    from transformers.integrations.flex_attention import flex_attention_forward

    from tes_grpo.layers import train_glue

    g = torch.Generator().manual_seed(3)
    q, k, v = ((torch.randn(2, heads, 300, 64, generator=g)).to(torch.bfloat16).cuda() for heads in (16, 4, 4))
    sinks = torch.randn(16, generator=g).to(torch.bfloat16).cuda()
    module = SimpleNamespace(training=True)
    wrapped = train_glue.SinksInTraining(flex_attention_forward, train_glue.decide("cuda", "compiled"))
    results = []
    for attention in (flex_attention_forward, wrapped):
        query = q.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out, _ = attention(module, query, k, v, None, scaling=0.125, s_aux=sinks)
        out.float().square().sum().backward()
        results.append((out.detach(), query.grad))
    (want, want_grad), (got, got_grad) = results
    ulps = bf16_ulps(got, want)
    assert got.shape == want.shape and int(ulps.max()) <= 1 and float((ulps > 0).float().mean()) <= 0.01
    assert float((got_grad - want_grad).float().norm()) <= 0.02 * float(want_grad.float().norm())
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        plain = flex_attention_forward(module, q, k, v, None, scaling=0.125, s_aux=sinks)[0]
        assert torch.equal(wrapped(module, q, k, v, None, scaling=0.125, s_aux=sinks)[0], plain)


def trl_padded_mask(rows: int, length: int) -> torch.Tensor:
    """A 0/1 mask as TRL batches rows: prompts left-padded by different amounts, completions right-padded."""
    mask = torch.ones(rows, length, dtype=torch.long)
    for row in range(rows):
        mask[row, :(37 * row) % 300] = 0
        mask[row, length - (101 * row) % 500:] = 0
    return mask.cuda()


@pytest.mark.parametrize("rows, length, window", [(4, 4869, None), (4, 4869, 128), (3, 700, 128), (2, 256, None)])
def test_block_mask_from_bounds_is_transformers_compiled_block_mask_on_cuda(rows, length, window):
    """FlexMaskWithPaddingBounds works the block mask out per block; transformers' flex_attention_mask builds it
    with torch.compile(create_block_mask) from the per-position lookup: the same block lists on CUDA, at a training
    pass's length (several blocks, the last one cut) and a short one."""
    import transformers.masking_utils as mu

    from tes_grpo.patches.transformers_patches import FlexMaskWithPaddingBounds

    mask = trl_padded_mask(rows, length)
    mask_function = mu.sliding_window_causal_mask_function(window) if window else mu.causal_mask_function
    call = dict(batch_size=rows, q_length=length, kv_length=length, q_offset=0, kv_offset=0,
                mask_function=mask_function, attention_mask=mask, local_size=window, device=mask.device)
    ours = FlexMaskWithPaddingBounds(mu.flex_attention_mask)(**call)
    # bool, as a model's forward gives transformers' lookup (it casts the 2-D mask): create_block_mask refuses int64
    theirs = mu.flex_attention_mask(**{**call, "attention_mask": mask.bool()})
    for field in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                  "q_indices", "full_q_num_blocks", "full_q_indices"):
        assert torch.equal(getattr(ours, field), getattr(theirs, field)), field


@pytest.mark.usefixtures("own_flex_compilations")
def test_a_flex_model_with_block_masks_from_bounds_gives_transformers_loss_and_gradients_on_cuda(monkeypatch):
    """A small gpt-oss with flex attention, trained as on a GPU (autocast, gradient checkpointing), over a padded
    batch of several blocks: with flex_masks_with_padding_bounds installed, no create_block_mask runs, flex attention
    compiles one graph for both layer kinds (forward, backward and recomputation), and the loss and gradients equal
    transformers' own (the same blocks, the same scores)."""
    import transformers.masking_utils as mu
    from torch.nn.attention.flex_attention import flex_attention

    from tes_grpo.patches.transformers_patches import flex_masks_with_padding_bounds

    model = small_cuda_model()
    model.set_attn_implementation("flex_attention")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    mask = trl_padded_mask(3, 700)
    ids = torch.randint(10, 512, mask.shape, generator=torch.Generator().manual_seed(2)).cuda() * mask
    built = []
    monkeypatch.setattr(mu, "create_block_mask", lambda *args, original=mu.create_block_mask, **kwargs: (
        built.append(1), original(*args, **kwargs))[1])
    results = []
    for bounds in (False, True):
        registry = mu.AttentionMaskInterface()  # a fresh instance: its local entries do not leak into other tests
        monkeypatch.setattr(mu, "ALL_MASK_ATTENTION_FUNCTIONS", registry)
        if bounds:
            assert flex_masks_with_padding_bounds()
            torch._dynamo.reset()  # count the graphs of this forward alone
        built.clear()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = (model(input_ids=ids, attention_mask=mask).logits.float().square() * mask[..., None]).mean()
        loss.backward()
        results.append((loss.detach(), [p.grad.detach().clone() for p in model.parameters()], len(built)))
        model.zero_grad(set_to_none=True)
    graphs = torch._dynamo.eval_frame._debug_get_cache_entry_list(flex_attention.__code__)
    (loss, grads, built), (bounded_loss, bounded_grads, bounded_built) = results
    assert built > 0 and bounded_built == 0
    assert len(graphs) == 1
    assert torch.equal(bounded_loss, loss)
    for ours, theirs in zip(bounded_grads, grads, strict=True):
        assert torch.equal(ours, theirs)
