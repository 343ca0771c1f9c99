"""test_lora_adapter.py / test_lora_adapter_quantized.py / llm_policy.py: metrics, seeds, parsing, end to end on the
tiny gpt-oss with a random LoRA adapter (CPU)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest
import torch

import test_lora_adapter as adapter_test
import test_lora_adapter_quantized
from tes_grpo.model import llm_policy
from tes_grpo.model.llm_policy import Completion
from tes_grpo.run.adapter_folder import checked_training_settings, from_training_run
from tes_grpo.run.fileio import InputError

REPO = Path(__file__).resolve().parents[1]
EVAL_DIR = REPO / "data" / "eval"
RETURN, END, CALL, EOT = 200002, 200007, 200012, 199999  # <|return|>, <|end|>, <|call|>, <|endoftext|>
STOPS = frozenset({RETURN, CALL, EOT})


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_lora_adapter(base: Path, folder: Path, b_std: float, seed: int = 1) -> Path:
    """LoRA on the attention projections (target_modules="all-linear"); lora_B ~ N(0, b_std), 0 = PEFT's init."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Mxfp4Config

    model = AutoModelForCausalLM.from_pretrained(base, quantization_config=Mxfp4Config(dequantize=True),
                                                 dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name and b_std > 0:
                param.normal_(0.0, b_std)
    peft_model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_base() -> Path:
    from tes_grpo.model.tiny_model import ensure_tiny_checkpoint

    return ensure_tiny_checkpoint()


@pytest.fixture(scope="module")
def adapters(tiny_base, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {"random": make_lora_adapter(tiny_base, root / "random", b_std=0.2),
            "zero": make_lora_adapter(tiny_base, root / "zero", b_std=0.0)}


@pytest.fixture(scope="module")
def random_policy_model(adapters):
    return llm_policy.load_policy_model(adapter_path=str(adapters["random"]))


@pytest.fixture(scope="module")
def eval_prompts():
    return adapter_test.load_eval_prompts(EVAL_DIR, max_prompts=3, reasoning_effort="low")


# ---------------------------------------------------------------------------------------------------------------
# Metrics on hand-made completions
# ---------------------------------------------------------------------------------------------------------------

Q = [-10.0, -9.0, -9.5, -12.0]  # best action 1
R = [0.1, 0.6, 0.25, 0.05]


@pytest.mark.parametrize("action, optimal, expected", [
    (1, 1, {"valid": True, "is_optimal": True, "reward": 0.6, "regret_q": 0.0}),  # the optimal action
    (3, 1, {"valid": True, "is_optimal": False, "reward": 0.05, "regret_q": 3.0}),  # worst action: regret max-min Q
    (2, 1, {"valid": True, "is_optimal": False, "reward": 0.25, "regret_q": 0.5}),  # second best
    (None, 1, {"valid": False, "is_optimal": False, "reward": 0.0, "regret_q": math.nan}),  # invalid: 0, no regret
    (0, 0, {"valid": True, "is_optimal": True, "reward": 0.1, "regret_q": 1.0}),  # "optimal" is the row's label
])
def test_score_action(action, optimal, expected):
    got = adapter_test.score_action(action, optimal, Q, R)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, nan_ok=True), key


def completion_frame(cases):
    """(model, row, action, truncated, n_tokens) tuples scored against Q/R with optimal action 1."""
    rows = []
    for model, row, action, truncated, n_tokens in cases:
        rows.append({"model": model, "source": "w.csv", "row": row, "sample": 0, "optimal_action": 1, "action": action,
                     **adapter_test.score_action(action, 1, Q, R), "truncated": truncated, "n_tokens": n_tokens})
    return pd.DataFrame(rows)


@pytest.mark.parametrize("cases, expected", [
    # all four answers valid: optimal 2 of 4, rewards 0.6+0.6+0.05+0.25, regrets 0+0+3+0.5
    ([("adapter", 1, 1, False, 10), ("adapter", 2, 1, False, 20), ("adapter", 3, 3, False, 30),
      ("adapter", 4, 2, False, 40)],
     {"completions": 4, "prompts": 4, "valid_rate": 1.0, "optimal_share": 0.5, "mean_reward": 0.375,
      "mean_regret_q": 0.875, "truncation_rate": 0.0, "mean_tokens": 25.0}),
    # one truncated (invalid) and one invalid but finished: rewards 0.6+0+0, regret over the one valid answer
    ([("base", 1, 1, False, 8), ("base", 1, None, True, 64), ("base", 2, None, False, 12)],
     {"completions": 3, "prompts": 2, "valid_rate": 1 / 3, "optimal_share": 1 / 3, "mean_reward": 0.2,
      "mean_regret_q": 0.0, "truncation_rate": 1 / 3, "mean_tokens": 28.0}),
    # nothing valid: regret undefined, reward 0
    ([("base", 1, None, True, 64), ("base", 2, None, True, 64)],
     {"completions": 2, "prompts": 2, "valid_rate": 0.0, "optimal_share": 0.0, "mean_reward": 0.0,
      "mean_regret_q": math.nan, "truncation_rate": 1.0, "mean_tokens": 64.0}),
])
def test_summarize(cases, expected):
    summary = adapter_test.summarize(completion_frame(cases))
    assert len(summary) == 1
    row = summary.iloc[0]
    for key, value in expected.items():
        assert row[key] == pytest.approx(value, nan_ok=True), key


def test_summarize_keeps_models_apart():
    frame = completion_frame([("adapter", 1, 1, False, 5), ("base", 1, 3, False, 5), ("base", 2, None, True, 9)])
    summary = adapter_test.summarize(frame).set_index("model")
    assert list(summary.index) == ["adapter", "base"]
    assert summary.loc["adapter", "optimal_share"] == 1.0 and summary.loc["base", "optimal_share"] == 0.0
    assert summary.loc["base", "valid_rate"] == 0.5 and summary.loc["base", "mean_regret_q"] == 3.0


@pytest.mark.parametrize("ids, kept, truncated", [
    ([5, 6, RETURN], [5, 6, RETURN], False),  # ends with <|return|>
    ([5, RETURN, EOT, EOT], [5, RETURN], False),  # padding after the end of a finished sequence is dropped
    ([5, END, 6, CALL, 7], [5, END, 6, CALL], False),  # <|end|> closes a message but does not stop; <|call|> does
    ([5, 6, END], [5, 6, END], True),  # hit the budget after <|end|>: no stop token
    ([], [], True),  # nothing generated
])
def test_split_at_stop(ids, kept, truncated):
    assert llm_policy.split_at_stop(ids, STOPS) == (kept, truncated)


@pytest.mark.parametrize("actions, expected", [
    ([2], 2),  # one vote
    ([1, 3, 3], 3),  # majority
    ([None, None, 0], 0),  # invalid samples do not vote
    ([None, None], None),  # nothing valid
    ([3, 1, 1, 3], 1),  # tie: the lowest action
    ([], None),  # no samples
])
def test_majority_vote(actions, expected):
    assert llm_policy.majority_vote(actions) == expected


@pytest.mark.parametrize("count, limit, expected", [
    (10, 0, list(range(10))),  # 0 = all
    (10, 20, list(range(10))),  # more than there are
    (10, 1, [0]),
    (10, 3, [0, 4, 9]),  # spread, ends included (4.5 rounds to 4)
    (90, 2, [0, 89]),
])
def test_evenly_spaced(count, limit, expected):
    assert adapter_test.evenly_spaced(count, limit) == expected


def test_completion_from_ids_parses_only_finished_answers(random_policy_model):
    tokenizer = random_policy_model.tokenizer
    answer = "<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>final<|message|>[2]<|return|>"
    ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
    done = llm_policy.completion_from_ids(tokenizer, ids + [EOT, EOT], STOPS)
    assert done == Completion(text=answer, n_tokens=len(ids), truncated=False, action=2)
    cut = llm_policy.completion_from_ids(tokenizer, ids[:-1], STOPS)  # [2] seen but never closed
    assert cut.truncated and cut.action is None


# ---------------------------------------------------------------------------------------------------------------
# Prompts and settings
# ---------------------------------------------------------------------------------------------------------------

def test_load_eval_prompts_spreads_rows_and_sets_the_reasoning_effort(eval_prompts):
    assert len(eval_prompts) == 3
    assert list(eval_prompts["source"]) == ["tes_2024-06-15_q_dataset_harmony.csv",
                                            "tes_2024-07-01_q_dataset_harmony.csv",
                                            "tes_2024-07-17_q_dataset_harmony.csv"]
    assert all("\nReasoning: low\n" in p for p in eval_prompts["prompt"])
    for column in (*adapter_test._Q_COLUMNS, "reward_action_0", "optimal_action"):
        assert column in eval_prompts.columns


def test_a_bad_q_value_names_file_row_column_and_value(tmp_path):
    frame = pd.read_csv(EVAL_DIR / "tes_2024-06-15_q_dataset_harmony.csv", dtype=str, keep_default_na=False)
    frame.loc[4, "q_action_2"] = "oops"
    path = tmp_path / "w_q_dataset_harmony.csv"
    frame.to_csv(path, index=False)
    with pytest.raises(InputError) as err:
        adapter_test.load_eval_prompts(tmp_path)
    assert (err.value.row, err.value.column, err.value.value) == (5, "q_action_2", "oops")
    assert str(path) in str(err.value)


def test_reasoning_effort_auto_reads_the_training_config(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoint-000010").mkdir(parents=True)
    (run / "train_config.json").write_text(json.dumps({"REASONING_EFFORT": "low"}))
    assert from_training_run("REASONING_EFFORT", "auto", str(run / "checkpoint-000010"), "medium")[0] == "low"
    assert from_training_run("REASONING_EFFORT", "auto", str(run), "medium")[0] == "low"
    assert from_training_run("REASONING_EFFORT", "high", str(run), "medium")[0] == "high"
    assert from_training_run("REASONING_EFFORT", "auto", str(tmp_path / "elsewhere"), "medium")[0] == "medium"


# evaluation settings that follow training: (settings given, train_config.json or None, expected values or error words)
FOLLOW_CASES = [
    ({"MAX_COMPLETION_LEN": "auto", "TEMPERATURE": "auto"}, {"MAX_COMPLETION_LEN": 48, "TEMPERATURE": 0.7},
     {"MAX_COMPLETION_LEN": 48, "TEMPERATURE": 0.7}),  # both from the training run
    ({"MAX_COMPLETION_LEN": "512", "TEMPERATURE": "auto"}, {"MAX_COMPLETION_LEN": 48, "TEMPERATURE": 0.7},
     {"MAX_COMPLETION_LEN": 512, "TEMPERATURE": 0.7}),  # a value given wins over the run's
    ({"MAX_COMPLETION_LEN": "auto", "TEMPERATURE": "0"}, None, "MAX_COMPLETION_LEN=auto follows the training run"),
    ({"MAX_COMPLETION_LEN": "12", "TEMPERATURE": "0"}, None,
     {"MAX_COMPLETION_LEN": 12, "TEMPERATURE": 0.0}),  # no run needed when both are given
    ({"MAX_COMPLETION_LEN": "0", "TEMPERATURE": "1"}, None, "MAX_COMPLETION_LEN='0'.*at least 1"),
    ({"MAX_COMPLETION_LEN": "many", "TEMPERATURE": "1"}, None, "MAX_COMPLETION_LEN='many'"),
    ({"MAX_COMPLETION_LEN": "8", "TEMPERATURE": "-1"}, None, "TEMPERATURE='-1'.*>= 0"),
    ({"MAX_COMPLETION_LEN": "8", "TEMPERATURE": "nan"}, None, "TEMPERATURE='nan'"),
]


@pytest.mark.parametrize("given, recorded, expected", FOLLOW_CASES)
def test_evaluation_sampling_follows_the_training_run(tmp_path, given, recorded, expected):
    run = tmp_path / "run"
    (run / "checkpoint-000010").mkdir(parents=True)
    if recorded is not None:
        (run / "train_config.json").write_text(json.dumps(recorded))
    adapter = str(run / "checkpoint-000010")
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=expected):
            checked_training_settings(given, tuple(given), adapter, say=lambda line: None)
    else:
        said = []
        assert checked_training_settings(given, tuple(given), adapter, say=said.append) == expected
        assert len(said) == len(given)


# ---------------------------------------------------------------------------------------------------------------
# Generation on the tiny model
# ---------------------------------------------------------------------------------------------------------------

def test_base_pass_uses_the_same_seeds_and_disables_the_adapter(adapters, eval_prompts):
    prompts = list(eval_prompts["prompt"])
    zero = llm_policy.load_policy_model(adapter_path=str(adapters["zero"]))
    with_adapter = llm_policy.generate(zero, prompts, samples=4, seed=3, max_new_tokens=40, progress=False)
    without = llm_policy.generate(zero, prompts, samples=4, seed=3, max_new_tokens=40, use_adapter=False,
                                  progress=False)
    # a zero LoRA changes nothing, so the same seeds must give the same sampled tokens
    assert with_adapter == without
    other_seed = llm_policy.generate(zero, prompts, samples=4, seed=4, max_new_tokens=40, progress=False)
    assert other_seed != with_adapter  # the seed does drive sampling (12 sampled answers)


def test_random_adapter_changes_the_completions(random_policy_model, eval_prompts):
    prompts = list(eval_prompts["prompt"])
    adapted = llm_policy.generate(random_policy_model, prompts, 2, 0, 40, progress=False)
    base = llm_policy.generate(random_policy_model, prompts, 2, 0, 40, use_adapter=False, progress=False)
    assert [c.text for s in adapted for c in s] != [c.text for s in base for c in s]
    base_again = llm_policy.generate(random_policy_model, prompts, 2, 0, 40, use_adapter=False, progress=False)
    assert base_again == base  # disabling the adapter is undone and redone cleanly


def test_a_tiny_budget_truncates_everything(random_policy_model, eval_prompts):
    completions = llm_policy.generate(random_policy_model, list(eval_prompts["prompt"][:2]), 1, 0, max_new_tokens=3,
                                      progress=False)
    assert all(c.truncated and c.action is None and c.n_tokens == 3 for s in completions for c in s)


def test_script_end_to_end(adapters, tmp_path, capsys):
    out = tmp_path / "report" / "completions.csv"  # OUT_DIR/completions.csv
    # greedy, so the format-warmed tiny model answers validly and the reward/regret columns are exercised
    code = adapter_test.main([f"--ADAPTER_PATH={adapters['random']}", f"--PROMPT_PATH={EVAL_DIR}", "--MAX_PROMPTS=2",
                              "--SAMPLES_PER_PROMPT=2", "--MAX_COMPLETION_LEN=40", "--TEMPERATURE=0",
                              "--REASONING_EFFORT=low", f"--OUT_DIR={out.parent}", "--PROGRESS=0"])
    assert code == 0
    frame = pd.read_csv(out)
    assert len(frame) == 2 * 2 * 2  # prompts x samples x (adapter, base)
    assert set(frame["model"]) == {"adapter", "base"}
    assert frame["valid"].any(), "the warmed tiny model should answer some greedy prompts validly"
    valid = frame[frame["valid"]]
    assert valid["action"].between(0, 3).all() and valid["regret_q"].ge(0).all()
    assert frame.loc[~frame["valid"], "reward"].eq(0).all() and frame.loc[~frame["valid"], "action"].isna().all()
    summary = pd.read_csv(out.with_name("completions_summary.csv")).set_index("model")
    for model, group in frame.groupby("model"):
        assert summary.loc[model, "valid_rate"] == pytest.approx(group["valid"].mean())
        assert summary.loc[model, "mean_reward"] == pytest.approx(group["reward"].mean())
        assert summary.loc[model, "truncation_rate"] == pytest.approx(group["truncated"].mean())
    assert summary["experts"].str.startswith("resident MXFP4").all()  # the training loader's, on any machine
    printed = capsys.readouterr().out
    assert "valid_rate" in printed and "adapter" in printed and f"wrote {out}" in printed


def test_quantized_script_keeps_the_experts_mxfp4_without_kernels(adapters, tmp_path, capsys):
    """No GPU, no `kernels` package: the experts stay resident as MXFP4 (the training loader's), computed in bf16."""
    out = tmp_path / "q" / "completions.csv"
    code = test_lora_adapter_quantized.test_lora_adapter.main(
        [f"--ADAPTER_PATH={adapters['random']}", f"--PROMPT_PATH={EVAL_DIR}", "--MAX_PROMPTS=1",
         "--SAMPLES_PER_PROMPT=1", "--MAX_COMPLETION_LEN=4", "--TEMPERATURE=1", f"--OUT_DIR={out.parent}",
         "--PROGRESS=0"],
        quantized=True)
    assert code == 0
    captured = capsys.readouterr()
    assert "FELL BACK" not in captured.err and "layer(s) resident as MXFP4" in captured.out
    summary = pd.read_csv(out.with_name("completions_summary.csv"))
    assert summary["experts"].str.startswith("resident MXFP4").all()
    assert adapter_test.QUANTIZED is False  # the in-process call left the module's defaults as they were


def test_missing_adapter_is_a_clear_error_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "completions.csv"
    code = adapter_test.main([f"--ADAPTER_PATH={tmp_path / 'nope'}", f"--OUT_DIR={tmp_path}"])
    assert code == 1
    assert "adapter folder does not exist" in capsys.readouterr().err
    assert not out.exists()


# adapter_config.json's target_parameters -> the layers whose experts carry LoRA (stay bf16 when evaluated)
EXPERT_LAYER_CASES = [
    (None, []),  # attention only (train_grpo's default)
    (["layers.7.mlp.experts.gate_up_proj", "layers.7.mlp.experts.down_proj"], [7]),  # one layer, both projections
    (["layers.15.mlp.experts.down_proj", "layers.3.mlp.experts.gate_up_proj"], [3, 15]),  # sorted
    (["model.layers.0.self_attn.sinks"], []),  # a parameter that is not an expert's
]


@pytest.mark.parametrize("targets, layers", EXPERT_LAYER_CASES)
def test_adapter_expert_layers(tmp_path, targets, layers):
    from tes_grpo.run.adapter_folder import adapter_expert_layers

    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "target_parameters": targets}))
    assert adapter_expert_layers(tmp_path) == layers


def test_an_expert_lora_adapter_evaluates_on_dequantized_experts_and_says_so(tiny_base, tmp_path, capsys):
    """PEFT adapts bf16 expert parameters only: quantized evaluation says it FELL BACK, and why."""
    from peft import LoraConfig, get_peft_model

    from tes_grpo.model.model_loading import load_training_model

    peft_model = get_peft_model(load_training_model(str(tiny_base), experts="bf16"), LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=[], target_parameters=["layers.1.mlp.experts.down_proj"]))
    peft_model.save_pretrained(tmp_path / "expert-lora")
    policy = llm_policy.load_policy_model(adapter_path=str(tmp_path / "expert-lora"), quantized=True)
    assert not policy.experts_resident and policy.experts.startswith("FELL BACK")
    assert "LoRA on the experts of layers [1]" in capsys.readouterr().err
