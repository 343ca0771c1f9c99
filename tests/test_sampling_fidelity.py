"""sampling_fidelity.py: the sampler's log-probabilities reach TRL aligned with the completions, the gap metrics and
the IMPORTANCE_SAMPLING loss are TRL's formulas on hand-made batches, a tiny GRPO run logs them; the vLLM weight sync
leaves the base weights as they were (sampler.py); REPORT_TO refuses what cannot work (trackers.py).

TRL's own _compute_loss runs on a stand-in trainer holding just the attributes it reads (TRL 1.16), so the loss is
TRL's arithmetic, not a copy of it.
"""

from __future__ import annotations

import json
import math
import types
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from transformers import GenerationConfig, GptOssConfig, GptOssForCausalLM

import train_grpo
from tes_grpo.run import trackers
from tes_grpo.sampling import graph_decode, sampler, sampling_fidelity
from tes_grpo.sampling.sampler import RecordingGenerate, SamplerSpec
from tes_grpo.sampling.sampling_fidelity import GEN_KL, LOGP_MAX, LOGP_MEAN, Correction, FidelityHook
from tes_grpo.training.batch_layout import batch_layout

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PAD = 5


def small_model():
    config = GptOssConfig(
        vocab_size=256, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], pad_token_id=PAD, eos_token_id=3, bos_token_id=1,
        attn_implementation="eager")
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    return GptOssForCausalLM(config).float().eval()


def prompts():
    ids = torch.randint(10, 256, (3, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left-padded, as TRL pads shorter prompts
    return ids.masked_fill(mask == 0, PAD), mask


def trl_config(**changes) -> GenerationConfig:
    settings = {"max_new_tokens": 12, "do_sample": True, "pad_token_id": PAD, "bos_token_id": 1, "eos_token_id": [3],
                "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": None, "repetition_penalty": 1.0,
                "cache_implementation": None, "use_cache": True, "disable_compile": True}
    return GenerationConfig(**{**settings, **changes})


# --- the sampler's log-probabilities ---------------------------------------------------------------------------

@pytest.mark.parametrize("route", ["transformers", "graph_decode"])
@pytest.mark.parametrize("changes", [
    {},  # TRL's defaults: the raw logits
    {"temperature": 0.7, "top_k": 20},  # after temperature and top-k, as sampled
    {"top_p": 0.9, "min_p": 0.05},
])
def test_recorded_logprobs_are_of_the_distribution_sampled_from(route, changes):
    # transformers' own processed scores (output_scores: what it sampled from) are the reference for both routes
    model = small_model()
    ids, mask = prompts()
    config = trl_config(**changes)
    torch.manual_seed(5)
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config, output_scores=True,
                         return_dict_in_generate=True)
    new = out.sequences[:, ids.shape[1]:]
    expected = torch.log_softmax(torch.stack(out.scores, dim=1), dim=-1).gather(2, new[..., None]).squeeze(2)
    generate = model.generate
    if route == "graph_decode":
        generate = graph_decode.GraphDecodeGenerate(model, model.generate)
    recording = RecordingGenerate(model, generate)
    torch.manual_seed(5)
    sequences = recording(input_ids=ids, attention_mask=mask, generation_config=config)
    assert torch.equal(sequences, out.sequences)  # recording changes nothing that is sampled
    got = recording.take()
    assert got.shape == new.shape and recording.take() is None  # handed out once
    live = ((new == 3).long().cumsum(dim=1) - (new == 3).long()) == 0  # up to and including the end token
    torch.testing.assert_close(got[live], expected[live], atol=1e-5, rtol=0)


class StandInTrainer:
    """The attributes TRL 1.16's GRPOTrainer._compute_loss reads, with its real _compute_loss bound; the training
    forward is replaced by `logps` (a leaf tensor, so the gradient can be checked)."""

    def __init__(self, logps: torch.Tensor, loss_type: str = "dr_grpo", max_completion_length: int = 8):
        from trl import GRPOTrainer

        self.logps = logps
        self.loss_type, self.max_completion_length = loss_type, max_completion_length
        self.top_entropy_quantile, self.off_policy_mask_threshold, self.importance_sampling_level = 1.0, None, "token"
        self.epsilon_low = self.epsilon_high = 0.2
        self.beta, self.use_vllm, self.vllm_importance_sampling_correction = 0.0, False, False
        self.args = SimpleNamespace(delta=None, use_bias_correction_kl=False)
        self.current_gradient_accumulation_steps = 1
        self._entropy_bonus_enabled = self.aux_loss_enabled = False
        self.model = SimpleNamespace(training=True)
        self.accelerator = SimpleNamespace(reduce=lambda t, reduction="sum": t, gather=lambda t: t,
                                           sync_gradients=True, num_processes=1)
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        self._compute_loss = types.MethodType(GRPOTrainer._compute_loss, self)
        self._generate_single_turn = lambda *args, **kwargs: (None, None)

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        return self.logps, torch.zeros_like(self.logps), None


def micro_batch(sampling):
    """2 completions of 3 and 4 tokens: their advantages, masks, and the sampler's log-probabilities."""
    return {"prompt_ids": torch.zeros(2, 1, dtype=torch.long), "prompt_mask": torch.ones(2, 1, dtype=torch.long),
            "completion_ids": torch.zeros(2, 4, dtype=torch.long),
            "completion_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]),
            "advantages": torch.tensor([0.5, -1.0]), "sampling_per_token_logps": torch.tensor(sampling)}


TRAINER = [[-1.0, -0.5, -2.0, 0.0], [-0.2, -3.0, -0.1, -1.5]]
SAMPLER = [[-1.2, -0.5, -0.9, 0.0], [-0.2, -2.5, float("nan"), -2.6]]  # a NaN: a token vLLM could not score


def hand_weights(mode: str, cap: float) -> torch.Tensor:
    """TRL's vLLM importance-sampling weights, worked out for TRAINER and SAMPLER."""
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.float64)
    delta = torch.tensor(TRAINER, dtype=torch.float64) - torch.tensor(SAMPLER, dtype=torch.float64)
    delta = torch.nan_to_num(delta * mask, nan=0.0)
    if mode.startswith("sequence"):
        delta = delta.sum(dim=1, keepdim=True)
    ratio = delta.exp()
    return ratio.clamp(max=cap) if mode.endswith("truncate") else ratio.masked_fill(ratio > cap, 0.0)


# (IMPORTANCE_SAMPLING, cap, loss type)
LOSS_CASES = [
    ("off", 3.0, "dr_grpo"),  # no correction: weight 1
    ("token_truncate", 2.0, "dr_grpo"),  # the last token's delta 1.1 (e^1.1 = 3.0) truncated to 2
    ("token_mask", 2.0, "dr_grpo"),  # ... and dropped
    ("sequence_truncate", 2.0, "dr_grpo"),  # the sums: row 0 e^-0.9, row 1 e^0.6
    ("sequence_mask", 1.5, "dr_grpo"),  # row 1's 1.82 > 1.5: dropped
    ("token_truncate", 2.0, "grpo"),  # grpo's per-sequence mean
    ("token_truncate", 2.0, "bnpo"),  # bnpo's mean over the batch's tokens
]


@pytest.mark.parametrize("mode, cap, loss_type", LOSS_CASES)
def test_importance_sampling_loss_is_trls_formula(mode, cap, loss_type):
    logps = torch.tensor(TRAINER, requires_grad=True)
    trainer = StandInTrainer(logps, loss_type)
    FidelityHook(trainer, Correction(mode, cap)).attach()
    batch = micro_batch(SAMPLER)
    loss = trainer._compute_loss(None, batch)
    loss.backward()
    # by hand: coef = exp(logp - logp.detach()) = 1, so each token's loss is -w A, its gradient -w A d(logp)
    w = hand_weights(mode, cap) if mode != "off" else torch.ones(2, 4, dtype=torch.float64)
    mask = batch["completion_mask"].double()
    advantages = batch["advantages"].double()[:, None]
    grad = -(w * advantages * mask)
    if loss_type == "dr_grpo":
        expected_loss, expected_grad = grad.sum() / (2 * 8), grad / (2 * 8)
    elif loss_type == "grpo":
        per_sequence = mask.sum(dim=1, keepdim=True)
        expected_loss, expected_grad = ((grad / per_sequence).sum(dim=1)).mean(), grad / per_sequence / 2
    else:  # bnpo: over the 7 completion tokens
        expected_loss, expected_grad = grad.sum() / 7, grad / 7
    assert loss.item() == pytest.approx(expected_loss.item(), rel=1e-6, abs=1e-7)
    torch.testing.assert_close(logps.grad.double(), expected_grad, rtol=1e-6, atol=1e-7)
    assert torch.equal(batch["advantages"], torch.tensor([0.5, -1.0]))  # the buffered micro-batch is untouched


@pytest.mark.parametrize("mode", ["off", "token_truncate", "sequence_mask"])
def test_gap_metrics_are_trls_names_and_formulas(mode):
    trainer = StandInTrainer(torch.tensor(TRAINER, requires_grad=True))
    FidelityHook(trainer, Correction(mode, 1.5)).attach()
    trainer._compute_loss(None, micro_batch(SAMPLER))
    logged = {name: values[-1] for name, values in trainer._metrics["train"].items() if name.startswith("sampling/")}
    # the 6 scored tokens (padding and the NaN one left out): delta = 0.2, 0, -1.1, 0, -0.5, 1.1
    deltas = torch.tensor([0.2, 0.0, -1.1, 0.0, -0.5, 1.1], dtype=torch.float64)
    assert logged["sampling/sampling_logp_difference/mean"] == pytest.approx(2.9 / 6)
    assert logged["sampling/sampling_logp_difference/max"] == pytest.approx(1.1)
    assert logged["sampling/gen_kl_error"] == pytest.approx((deltas.exp() - deltas - 1).mean().item())
    if mode == "off":  # the plain ratio of the scored tokens
        ratios = deltas.exp()
    elif mode == "token_truncate":  # the weights applied, on every completion token (the NaN one weighs 1)
        ratios = torch.cat([hand_weights(mode, 1.5)[0, :3], hand_weights(mode, 1.5)[1]])
    else:  # one per sequence
        ratios = hand_weights(mode, 1.5).flatten()
    assert logged["sampling/importance_sampling_ratio/mean"] == pytest.approx(ratios.mean().item())
    assert logged["sampling/importance_sampling_ratio/min"] == pytest.approx(ratios.min().item())
    assert logged["sampling/importance_sampling_ratio/max"] == pytest.approx(ratios.max().item())
    assert set(logged) == set(sampling_fidelity.METRICS)


def test_metrics_cover_every_micro_batch_of_a_step():
    # logged once per optimizer step, as a token mean over its micro-batches (not a mean of their means)
    trainer = StandInTrainer(torch.tensor(TRAINER))
    FidelityHook(trainer, Correction()).attach()
    trainer.accelerator.sync_gradients = False
    first = micro_batch(SAMPLER)
    first["completion_mask"] = torch.tensor([[1, 0, 0, 0], [0, 0, 0, 0]])  # one token: |delta| 0.2
    trainer._compute_loss(None, first)
    assert "sampling/sampling_logp_difference/mean" not in trainer._metrics["train"]
    trainer.accelerator.sync_gradients = True
    trainer._compute_loss(None, micro_batch(SAMPLER))  # 6 tokens, |delta| sum 2.9
    assert trainer._metrics["train"]["sampling/sampling_logp_difference/mean"] == [pytest.approx(3.1 / 7)]


def test_generate_single_turn_hands_trl_the_logprobs_cut_to_each_completion():
    said = []
    trainer = StandInTrainer(torch.zeros(2, 4))
    completions = [[7, 8, 3], [9], [4, 4, 4, 3]]  # TRL cut each after its end token
    trainer._generate_single_turn = lambda *args, **kwargs: (completions, None)
    hook = FidelityHook(trainer, Correction(), say=said.append)
    hook.attach()
    assert trainer._generate_single_turn([], None, {}, 3) == (completions, None)  # nothing recorded: said, once
    assert trainer._generate_single_turn([], None, {}, 3) == (completions, None)
    assert len(said) == 1 and "no sampled log-probabilities" in said[0]

    recorded = torch.arange(12, dtype=torch.float32).view(3, 4) / -10

    class Recording:
        latest = None

        def take(self):
            return recorded

    hook.recording = Recording()
    ids, logprobs = trainer._generate_single_turn([], None, {}, 3)
    assert ids is completions
    assert logprobs == [pytest.approx([0.0, -0.1, -0.2]), pytest.approx([-0.4]), pytest.approx([-0.8, -0.9, -1.0,
                                                                                                   -1.1])]
    trainer_logprobs = [[-1.0]]  # a path that returns its own (vLLM): passed through
    hook._generate_single_turn = lambda *args, **kwargs: (completions, trainer_logprobs)
    assert trainer._generate_single_turn([], None, {}, 3)[1] is trainer_logprobs


@pytest.mark.parametrize("mode, cap, loss_type, words", [
    ("off", 3.0, "dr_grpo", None),
    ("token_truncate", 3.0, "dr_grpo", None),
    ("clip", 3.0, "dr_grpo", "IMPORTANCE_SAMPLING='clip'"),
    ("token_truncate", 0.0, "dr_grpo", "IMPORTANCE_SAMPLING_CAP=0.0"),
    ("token_truncate", 3.0, "vespo", "vespo"),  # vespo folds the ratio into its own weights
    ("off", 3.0, "vespo", None),
])
def test_importance_sampling_settings(mode, cap, loss_type, words):
    settings = train_grpo.default_settings(IMPORTANCE_SAMPLING=mode, IMPORTANCE_SAMPLING_CAP=cap, LOSS_TYPE=loss_type)
    if words is None:
        train_grpo.check_settings(settings)
    else:
        with pytest.raises(train_grpo.SettingsError, match=words):
            train_grpo.check_settings(settings)


def test_grpo_config_leaves_trls_vllm_correction_off(tmp_path):
    # one correction for every path: TRL's own vLLM one (and its extra forward) is off
    settings = train_grpo.default_settings(OUT_DIR=str(tmp_path), USE_VLLM=True, DECODE_GRAPHS="off")
    args = train_grpo.build_grpo_config(settings, batch_layout(settings, 871), cuda=False)
    assert args.use_vllm and args.vllm_importance_sampling_correction is False


# --- a tiny GRPO run logs the gap ------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("graphs, mode", [
    ("on", "off"),  # graph_decode (eager steps on the CPU)
    ("off", "token_truncate"),  # transformers' generate, with the correction on
])
def test_tiny_run_logs_the_gap(tmp_path, tokenizer, capsys, graphs, mode):
    # CPU, float32: sampler and trainer do the same arithmetic, so the gap is float32 rounding (measured 3.6e-7)
    if torch.cuda.is_available():
        pytest.skip("bounds the gap at float32 rounding, the CPU's dtype; on a GPU (bf16) the gap is measured by "
                    "benchmarks/bench_generate.py --COMPARE_SEQS (BENCHMARKS.md)")
    from grpo_fixtures import write_fixture_data

    data = write_fixture_data(tmp_path, tokenizer)
    out = tmp_path / "run"
    assert train_grpo.main(["--MODEL_ID=tiny", f"--DATA_DIR={data}", f"--EVAL_DIR={data / 'eval'}", f"--OUT_DIR={out}",
                            "--TOTAL_STEPS=2", "--NUM_GENERATIONS=4", "--GRADIENT_ACCUMULATION_STEPS=2",
                            "--MAX_COMPLETION_LEN=12", "--SAVE_STEPS=100", f"--DECODE_GRAPHS={graphs}",
                            f"--IMPORTANCE_SAMPLING={mode}"]) == 0
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if "reward" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert 0 <= m["sampling/sampling_logp_difference/mean"] <= m["sampling/sampling_logp_difference/max"] < 1e-3
        assert 0 <= m["sampling/gen_kl_error"] < 1e-6
        assert m["sampling/importance_sampling_ratio/min"] <= 1 <= m["sampling/importance_sampling_ratio/max"] < 1.001
    printed = capsys.readouterr().out
    assert "step 2/2" in printed and "logp gap" in printed
    assert f"IMPORTANCE_SAMPLING={mode}" in printed


# --- vLLM's weight sync keeps the base weights -----------------------------------------------------------------

def mocked_vllm_generation(model):
    """TRL 1.16's VLLMGeneration with vLLM itself mocked: its own sync_weights and _iter_named_params (PEFT's
    merge_adapter, the weights read, unmerge_adapter), the weights landing in `received`."""
    import contextlib

    from trl.generation.vllm_generation import VLLMGeneration

    generation = object.__new__(VLLMGeneration)
    received = {}
    vllm_model = SimpleNamespace(load_weights=lambda pairs: received.update({n: p.clone() for n, p in pairs}))
    generation.model, generation.mode, generation.enable_sleep_mode = model, "colocate", False
    generation.accelerator = SimpleNamespace(is_main_process=True)
    generation._dist = SimpleNamespace(is_fsdp=False, gather_params=lambda params: contextlib.nullcontext())
    generation.llm = SimpleNamespace(reset_prefix_cache=lambda: None, llm_engine=SimpleNamespace(
        model_executor=SimpleNamespace(driver_worker=SimpleNamespace(model_runner=SimpleNamespace(model=vllm_model)))))
    return generation, received


def bf16_lora_model():
    from peft import get_peft_model

    model = get_peft_model(small_model().to(torch.bfloat16), train_grpo.build_lora_config(4, 8))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    return model


def bases(model) -> dict:
    return {name: p.detach().clone() for name, p in model.named_parameters() if "base_layer" in name}


def vllm_trainer(model, generation):
    """What sampler.install reads of a GRPOTrainer that generates with vLLM (TRL 1.16's names)."""
    def unused(*args, **kwargs):
        raise AssertionError("not called here")

    return SimpleNamespace(vllm_generation=generation, model=model, use_vllm=True,
                           vllm_importance_sampling_correction=False, accelerator=SimpleNamespace(mixed_precision="no"),
                           _generate_single_turn=unused, _compute_loss=unused,
                           _get_per_token_logps_and_entropies=unused, _metrics={})


@pytest.mark.parametrize("kept", [False, True])
def test_vllm_sync_leaves_the_base_bit_identical(kept):
    """With the trainer's hooks installed (train_grpo's build_trainer calls sampler.install), each sync
    still sends vLLM the merged weights and the trainer's base stays bit for bit; without them it drifts."""
    model = bf16_lora_model()
    generation, received = mocked_vllm_generation(model)
    trainer = vllm_trainer(model, generation)
    if kept:
        sampler.install(trainer, SamplerSpec("vllm"), say=lambda text: None)
        assert isinstance(generation.sync_weights, sampler.BaseWeightsKept)
    before = bases(model)
    g = torch.Generator().manual_seed(0)
    for _ in range(200):  # a sync per optimizer step; the adapter trains in between
        generation.sync_weights()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.add_(torch.randn(param.shape, generator=g) * 1e-3)
    # vLLM receives the merged weights either way: PEFT's merge of the current adapter into the current base
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    with torch.no_grad():  # base (bf16) += delta (PEFT keeps the factors in float32): summed in float32, rounded
        merged = (q.base_layer.weight.float() + q.get_delta_weight("default")).to(torch.bfloat16)
    generation.sync_weights()
    assert torch.equal(received["model.layers.0.self_attn.q_proj.weight"], merged)
    after = bases(model)
    moved = sum(int((before[n] != after[n]).sum()) for n in before) / sum(t.numel() for t in before.values())
    if kept:
        assert moved == 0
    else:
        assert moved > 0.01  # TRL's merge and unmerge in place move the frozen base (measured: 74 % after 200 syncs)


# --- REPORT_TO -------------------------------------------------------------------------------------------------

def test_tracker_table_is_transformers():
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    assert set(trackers.TRACKER_PACKAGES) == set(INTEGRATION_TO_CALLBACK) - {"kubeflow"}


@pytest.mark.parametrize("value, installed, words", [
    (["tensorboard"], {"tensorboard"}, None),  # the default
    (["none"], set(), None),  # no tracker: metrics.jsonl only
    ([], set(), None),
    (["wandb"], {"tensorboard"}, "wandb needs the package wandb, which is not installed"),
    (["tensorboard", "trackio"], {"tensorboard", "trackio"}, None),
    (["tensorboard"], {"tensorboardX"}, None),  # either package serves transformers' TensorBoard callback
    (["dagshub"], {"dagshub"}, "dagshub needs the package mlflow"),
    (["wandbb"], {"wandb"}, "unknown tracker(s) wandbb"),
    (["none", "wandb"], {"wandb"}, "unknown tracker(s) none"),  # none means no tracker: alone
])
def test_report_to_problem(value, installed, words):
    def find_spec(name):
        return object() if name in installed else None

    problem = trackers.report_to_problem(value, find_spec=find_spec)
    assert (problem is None) if words is None else (words in problem), problem


def test_missing_tracker_is_one_error_line_before_anything_slow(tmp_path, capsys):
    # this environment has no wandb (requirements-test.txt): the run stops at the settings check
    assert trackers.report_to_problem(["wandb"]) is not None
    assert train_grpo.main([f"--OUT_DIR={tmp_path / 'run'}", "--REPORT_TO=tensorboard,wandb"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: REPORT_TO:") and "wandb" in err[0]
    assert not (tmp_path / "run").exists()  # nothing written, no model loaded


@pytest.mark.parametrize("value, expected", [(["tensorboard"], ["tensorboard"]), (["none"], []),
                                             (["tensorboard", "trackio"], ["tensorboard", "trackio"])])
def test_grpo_config_report_to(tmp_path, value, expected):
    settings = train_grpo.default_settings(OUT_DIR=str(tmp_path), REPORT_TO=value)
    args = train_grpo.build_grpo_config(settings, batch_layout(settings, 871), cuda=False)
    assert args.report_to == expected


def test_correction_weights_match_hand_values():
    w = sampling_fidelity.importance_weights(torch.tensor([[0.0, math.log(4.0), float("nan")]]),
                                             torch.tensor([[1, 1, 1]]), Correction("token_truncate", 3.0))
    torch.testing.assert_close(w, torch.tensor([[1.0, 3.0, 1.0]]))


def test_gap_summary_for_the_completion_log():
    records = [{"step": 1, "reward": 0.1, LOGP_MEAN: 0.02, LOGP_MAX: 1.5, GEN_KL: 0.001},
               {"step": 1, "train_runtime": 3.0},  # the trainer's closing record has no metrics
               {"step": 2, "reward": 0.2, LOGP_MEAN: 0.04, LOGP_MAX: 0.5, GEN_KL: 0.003}]
    line = sampling_fidelity.gap_summary(records)
    assert line.startswith("sampler vs trainer over 2 logged steps: mean |log p| gap 0.03 (last step 0.04)")
    assert "largest 1.5" in line and "gen KL 0.002 on average, 0.003 at most" in line
    assert sampling_fidelity.gap_summary([{"step": 1, "reward": 0.1}]) is None  # a run without the metrics


def test_detach_gives_back_what_install_wrapped():
    """bench_grpo's SAMPLING_METRICS=0 times a step without the measurement: detach restores the trainer's methods
    and the model's generate()."""
    from tes_grpo.training.lm_head import causal_lm

    model = bf16_lora_model()
    trainer = vllm_trainer(model, None)
    trainer.use_vllm = False
    inner = causal_lm(model)
    before = {name: getattr(trainer, name) for name in
              ("_generate_single_turn", "_compute_loss", "_get_per_token_logps_and_entropies")}
    generate = inner.generate
    hook = sampler.install(trainer, SamplerSpec("generate"), say=lambda text: None)
    assert isinstance(inner.generate, RecordingGenerate) and trainer.sampling_fidelity is hook
    assert all(getattr(trainer, name) is not method for name, method in before.items())
    hook.detach()
    assert inner.generate == generate and not hasattr(trainer, "sampling_fidelity")
    assert all(getattr(trainer, name) is method for name, method in before.items())


# (what is wrong with the trainer, words of the error)
REFUSED = [
    ({"vllm_importance_sampling_correction": True}, "TRL's own vLLM importance sampling is on"),
    ({"use_vllm": False}, "use_vllm is False"),  # a vLLM sampler for a trainer that does not generate with vLLM
]


@pytest.mark.parametrize("changes, words", REFUSED)
def test_a_sampler_that_cannot_work_is_refused_before_anything_is_wrapped(changes, words):
    model = bf16_lora_model()
    generation, _ = mocked_vllm_generation(model)
    trainer = vllm_trainer(model, generation)
    sync = generation.sync_weights
    for name, value in changes.items():
        setattr(trainer, name, value)
    with pytest.raises(ValueError, match=words):
        sampler.install(trainer, SamplerSpec("vllm"), say=lambda text: None)
    assert generation.sync_weights == sync and not isinstance(generation.sync_weights, sampler.BaseWeightsKept)
    assert not hasattr(trainer, "sampling_fidelity")
