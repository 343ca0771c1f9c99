"""The decode limit's byte accounting (benchmarks/decode_limit.py) against the model shapes, exactly (CPU, no GPU)."""

import itertools
from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch

from benchmarks import decode_limit as dl
from tes_grpo.model.gpt_oss_shapes import gpt_oss_config


def distinct_by_enumeration(tokens: int, top_k: int, experts: int) -> Fraction:
    """Mean number of distinct experts over every way the tokens can each pick top_k distinct experts."""
    picks = list(itertools.combinations(range(experts), top_k))
    total = sum(len(set().union(*choice)) for choice in itertools.product(picks, repeat=tokens))
    return Fraction(total, len(picks) ** tokens)


@pytest.mark.parametrize("tokens, top_k, experts", [(1, 2, 5), (2, 1, 3), (3, 2, 5), (4, 3, 4), (0, 1, 3)])
def test_expected_experts_hit_matches_enumeration(tokens, top_k, experts):
    assert dl.expected_experts_hit(tokens, top_k, experts) == pytest.approx(
        float(distinct_by_enumeration(tokens, top_k, experts)), rel=1e-12)


def test_expected_experts_hit_refuses_impossible_picks():
    with pytest.raises(ValueError, match="top_k 5 of 4"):
        dl.expected_experts_hit(3, 5, 4)


def test_20b_at_the_generate_benchmark_reproduces_the_estimate():
    # gpt-oss-20b, 64 sequences, 1,316-token prompts + 512 (half of 1,024 new tokens): ~15.7 GB, ~5.2 ms at 3.0 TB/s
    limit = dl.decode_bytes(gpt_oss_config("20b"), 64, 1316 + 512, "mxfp4", lora_rank=4)
    items = limit.items
    assert items[dl.EXPERTS] / 1e9 == pytest.approx(10.16, abs=0.01)  # 64 x 4 picks of 32 leave almost none unread
    assert items[dl.EXPERTS] / 2**30 == pytest.approx(9.46, abs=0.01)
    assert items[dl.PROJECTIONS] / 1e9 == pytest.approx(1.3, abs=0.05)
    assert items[dl.LM_HEAD] / 1e9 == pytest.approx(1.2, abs=0.05)
    assert items[dl.KV_FULL] / 1e9 == pytest.approx(2.9, abs=0.05)
    assert items[dl.KV_SLIDING] / 1e9 == pytest.approx(0.2, abs=0.01)
    assert limit.total / 1e9 == pytest.approx(15.7, abs=0.05)
    assert 1e3 * limit.seconds(3.0e12) == pytest.approx(5.2, abs=0.05)


def test_grpo_and_120b_estimates():
    # inside GRPO at 4,000 tokens the mean context is 841 + 2,000: ~17.3 GB, ~5.8 ms
    grpo = dl.decode_bytes(gpt_oss_config("20b"), 64, 841 + 2000, lora_rank=4)
    assert grpo.total / 1e9 == pytest.approx(17.3, abs=0.05)
    assert 1e3 * grpo.seconds(3.0e12) == pytest.approx(5.8, abs=0.05)
    # the 120B: ~87 % of its 128 experts hit, ~63 GB, ~21 ms
    big = dl.decode_bytes(gpt_oss_config("120b"), 64, 841 + 2000, lora_rank=4)
    assert big.experts_hit / 128 == pytest.approx(0.87, abs=0.005)
    assert big.total / 1e9 == pytest.approx(63, abs=0.5)
    assert 1e3 * big.seconds(3.0e12) == pytest.approx(21, abs=0.2)


def small_config(**changes):
    fields = dict(hidden_size=8, intermediate_size=6, num_attention_heads=4, num_key_value_heads=2, head_dim=2,
                  num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=3, vocab_size=10, sliding_window=5,
                  layer_types=["sliding_attention", "full_attention", "full_attention"], attention_bias=True)
    return SimpleNamespace(**{**fields, **changes})


def test_every_item_counted_exactly():
    c = small_config()
    got = dl.decode_bytes(c, batch=3, mean_context=7, experts="bf16", lora_rank=2, experts_hit=3.0).items
    per_expert = (8 * 12 + 6 * 8) * 2 + (12 + 8) * 2  # gate_up, down in bf16, their biases
    assert got[dl.EXPERTS] == 3 * 3.0 * per_expert
    assert got[dl.ROUTER] == 3 * (4 * 8 + 4) * 2
    weights = 8 * (8 + 2 * 4) + 8 * 8  # q [8 -> 8], k and v [8 -> 4], o [8 -> 8]
    lora = 2 * ((8 + 8) + 2 * (8 + 4) + (8 + 8))
    assert got[dl.PROJECTIONS] == 3 * ((weights + 8 + 2 * 4 + 8) * 2 + lora * 2)
    assert got[dl.LM_HEAD] == 10 * 8 * 2
    assert got[dl.SMALL] == ((2 * 3 + 1) * 8 + 3 * 4 + 3 * 8) * 2
    kv_token = 2 * 4 * 2
    assert got[dl.KV_FULL] == 2 * 3 * 7 * kv_token  # two full layers over the whole context
    assert got[dl.KV_SLIDING] == 1 * 3 * 5 * kv_token  # one sliding layer over its window of 5
    assert got[dl.KV_WRITES] == 3 * 3 * kv_token
    short = dl.decode_bytes(c, batch=3, mean_context=4, experts="bf16", experts_hit=3.0).items
    assert short[dl.KV_SLIDING] == 1 * 3 * 4 * kv_token  # a context shorter than the window


def test_mxfp4_experts_and_routing_source():
    c = small_config(hidden_size=64, intermediate_size=32)
    mx = dl.decode_bytes(c, batch=1, mean_context=1, experts="mxfp4", experts_hit=2.0)
    values = 64 * 64 + 32 * 64
    assert mx.items[dl.EXPERTS] == 3 * 2.0 * (values * 4.25 / 8 + (64 + 64) * 2)
    assert mx.routing == "measured from the router"
    uniform = dl.decode_bytes(c, batch=1, mean_context=1)
    assert uniform.experts_hit == 2.0 and uniform.routing == "uniform-routing expectation"  # one token: top_k
    with pytest.raises(ValueError, match="fp8"):
        dl.decode_bytes(c, 1, 1, experts="fp8")


def test_experts_format():
    assert dl.experts_format("mxfp4", resident=False) == "mxfp4"
    assert dl.experts_format("model", resident=True) == "mxfp4"
    assert dl.experts_format("model", resident=False) == "bf16"


def test_calls_seconds_adds_each_calls_decode_steps():
    c = small_config()
    limit = dl.DecodeLimit(c, "bf16", 0, rate=1e3)
    calls = [(3, 10.0, 5), (2, 4.0, 1), (3, 6.0, 9)]  # the second call decoded nothing after its prefill token
    expected = (4 * dl.decode_bytes(c, 3, 10 + 2.5, "bf16").total + 8 * dl.decode_bytes(c, 3, 6 + 4.5, "bf16").total)
    assert limit.calls_seconds(calls) == pytest.approx(expected / 1e3, rel=1e-12)


def test_decode_shape_weights_calls_by_their_steps():
    from benchmarks.bench_grpo import decode_shape

    assert decode_shape([(64, 800.0, 101), (64, 900.0, 1)]) == (64, 800.0 + 50.5)
    assert decode_shape([]) == (0, 0.0)


def test_generation_timer_records_each_call(monkeypatch):
    from benchmarks.grpo_timers import GenerationTimer

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    sampler = SimpleNamespace(generate=lambda model, input_ids, attention_mask, config: (
        torch.zeros(input_ids.shape[0], 9), None))  # the trainer's Sampler: 9 tokens, prompt included
    timer = GenerationTimer(sampler)
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    assert timer.generate(None, torch.zeros(2, 4), mask, None)[1] is None  # what the sampler returned
    timer.generate(None, torch.zeros(3, 6), None, None)
    assert timer.calls == [(2, 3.5, 5), (3, 6.0, 3)]
    assert timer.tokens == 2 * 5 + 3 * 3 and timer.sequences == 5
