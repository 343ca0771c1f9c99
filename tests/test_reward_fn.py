"""reward_fn and parse_action on real Harmony completion strings (table-driven, no model)."""

from __future__ import annotations

import math

import pytest

from data_reward import reward_fn
from tes_grpo.task.harmony import parse_action

A = "<|channel|>analysis<|message|>"
F = "<|start|>assistant<|channel|>final<|message|>"
END, RET = "<|end|>", "<|return|>"
ROW = [0.1, 0.2, 0.3, 0.4]  # reward_action_0..3 of the prompt the completion answers

# (completion text as generated, with its special tokens; expected action or None)
CASES = [
    (f"{A}Load is high later; charge now.{END}{F}[1]{RET}", 1),  # analysis then final: the normal gpt-oss answer
    (f"<|channel|>final<|message|>[2]{RET}", 2),  # final channel only
    (f"{A}Options [0] or [3]?{END}{F}[2]{RET}", 2),  # brackets in the analysis do not count
    (f"{A}x{END}{F}I pick [0], no: [3]{RET}", 3),  # several brackets in the final message: the last one
    (f"{A}x{END}{F}[4]{RET}", None),  # out of range
    (f"{A}x{END}{F}[-1]{RET}", None),  # negative
    (f"{A}x{END}{F}[10]{RET}", None),  # two digits, out of range
    (f"{A}x{END}{F}[2] then [7]{RET}", None),  # the last bracketed integer decides, and it is out of range
    (f"{A}I would answer [2].{END}", None),  # no final channel
    (f"{A}I would answer [2].{RET}", None),  # analysis closed by <|return|>, still no final channel
    (f"{A}x{END}{F}[2]", None),  # truncated: final message never closed
    (f"{A}x{END}{F}", None),  # truncated right after the final header
    (f"{A}x{END}{F}{RET}", None),  # empty final message
    ("", None),  # empty completion
    (f"{A}x{END}{F}Réponse : [1] ✓ — 充电{RET}", 1),  # unicode around the answer
    (f"{A}x{END}{F}[２]{RET}", None),  # fullwidth digit is not an ASCII [k]
    (f"{A}x{END}{F}[ 2 ]{RET}", None),  # spaces inside the brackets
    (f"{A}x{END}{F}[2.0]{RET}", None),  # not an integer
    (f"{A}x{END}{F}[1]{END}", 1),  # final message closed by <|end|>
    (f"{A}x{END}{F}[1]<|call|>", 1),  # closed by <|call|>
    (f"{F}[1]{END}<|start|>assistant<|channel|>final<|message|>[3]{RET}", 3),  # two final messages: the last one
    ("analysisx.assistantfinal[2]", None),  # text decoded without special tokens: no channel markers left
]


@pytest.mark.parametrize("text, expected", CASES)
def test_parse_action(text, expected):
    assert parse_action(text) == expected


def rewards_for(completions, completion_ids=None):
    cols = {f"reward_action_{k}": [ROW[k]] * len(completions) for k in range(4)}
    return reward_fn(completions, **cols, completion_ids=completion_ids, invalid_reward=math.nan)


@pytest.mark.parametrize("text, expected", CASES)
def test_reward_fn_on_text(text, expected):
    [reward] = rewards_for([text])
    if expected is None:
        assert math.isnan(reward)
    else:
        assert reward == ROW[expected]


@pytest.mark.parametrize("text, expected", [c for c in CASES if c[0].endswith(("<|return|>", "<|call|>"))])
def test_reward_fn_decodes_completion_ids_with_special_tokens(text, expected, tokenizer):
    """TRL passes completions decoded without special tokens; the ids are decoded again with them."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    stripped = tokenizer.decode(ids, skip_special_tokens=True)  # what TRL hands over as `completions`
    [reward] = rewards_for([stripped], completion_ids=[ids])
    assert (math.isnan(reward) if expected is None else reward == ROW[expected])


# (completion text, reward expected when generation stopped at its last token?)
STOP_CASES = [
    (f"{A}x{END}{F}[1]{RET}", True),  # stopped at <|return|>
    (f"{A}x{END}{F}[1]{END}", False),  # cut at MAX_COMPLETION_LEN right after <|end|>: generation never stopped
    (f"{A}x{END}{F}[1]{END}<|start|>assistant", False),  # cut while starting another message
]


@pytest.mark.parametrize("text, valid", STOP_CASES)
def test_reward_fn_nan_when_generation_was_cut(text, valid, tokenizer):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    [reward] = rewards_for([tokenizer.decode(ids, skip_special_tokens=True)], completion_ids=[ids])
    assert (reward == ROW[1]) if valid else math.isnan(reward)


def test_each_completion_scored_with_its_own_row():
    completions = [f"{A}x{END}{F}[{k}]{RET}" for k in (0, 3, 3, 1)]
    cols = {f"reward_action_{k}": [10 * i + k for i in range(4)] for k in range(4)}
    assert reward_fn(completions, **cols, invalid_reward=math.nan) == [0, 13, 23, 31]


def test_the_invalid_reward_is_required():
    with pytest.raises(TypeError, match="invalid_reward"):
        reward_fn(["x"], *([[0.1]] * 4))


# TRL's conversational completions: (completion as TRL passes it, expected action)
CONVERSATIONAL_CASES = [
    ([{"role": "assistant", "content": f"{A}x{END}{F}[2]{RET}"}], 2),  # one message, content a string
    ([{"role": "assistant", "content": [{"type": "text", "text": f"{A}x{END}{F}"},
                                        {"type": "text", "text": f"[3]{RET}"}]}], 3),  # content as text parts
    ([{"role": "assistant", "content": f"{A}x{END}"}, {"role": "assistant", "content": f"{F}[1]{RET}"}], 1),  # 2
    ([{"role": "assistant", "content": ""}], None),  # empty message: invalid, not an error
    ([], None),  # no messages
]


@pytest.mark.parametrize("completion, expected", CONVERSATIONAL_CASES)
def test_reward_fn_reads_conversational_completions(completion, expected):
    [reward] = rewards_for([completion])
    assert (math.isnan(reward) if expected is None else reward == ROW[expected])


# anything else is a TypeError naming the shape: (completion, words in the message)
BAD_SHAPES = [
    (None, "NoneType"),  # no completion at all
    (b"[1]", "bytes"),  # bytes, not text
    (7, "int"),  # a number
    (["[1]"], "str"),  # a bare string inside the list, not a message
    ([{"role": "assistant"}], "no 'content'"),  # a message without content
    ([{"role": "assistant", "content": None}], "content a NoneType"),  # content None
    ([{"role": "assistant", "content": [{"type": "image"}]}], "content a list"),  # a part that is not text
]


@pytest.mark.parametrize("completion, words", BAD_SHAPES)
def test_reward_fn_names_an_unknown_completion_shape(completion, words):
    with pytest.raises(TypeError, match=words):
        rewards_for([completion])




# (invalid_reward bound, completion, expected reward): what INVALID_REWARD gives an invalid or truncated completion
INVALID_CASES = [
    (0.0, f"{A}x{END}{F}[2]{RET}", ROW[2]),  # valid answers keep their row reward
    (0.0, f"{A}I would answer [2].{END}", 0.0),  # the default: invalid scores 0, below every valid reward here
    (-1.0, f"{A}x{END}{F}[9]{RET}", -1.0),  # any finite value
    (math.nan, f"{A}x{END}{F}[9]{RET}", math.nan),  # nan: left to TRL's masking (no gradient)
]


@pytest.mark.parametrize("invalid_reward, text, expected", INVALID_CASES)
def test_bound_reward_scores_invalid_completions(invalid_reward, text, expected):
    from data_reward import bind_reward

    reward = bind_reward(invalid_reward, None)
    assert reward.__name__ == "reward_fn"  # TRL names its reward metrics after it
    [got] = reward([text], **{f"reward_action_{k}": [ROW[k]] for k in range(4)})
    assert (math.isnan(got) if math.isnan(expected) else got == expected)


def test_truncated_completion_gets_the_invalid_reward_and_is_counted(tokenizer):
    from data_reward import bind_reward

    ids = tokenizer(f"{A}x{END}{F}[1]{END}", add_special_tokens=False)["input_ids"]  # cut: no stop token at the end
    logged = {}
    [reward] = bind_reward(0.0, None)([""], **{f"reward_action_{k}": [ROW[k]] for k in range(4)},
                                      completion_ids=[ids], log_metric=logged.__setitem__)
    assert reward == 0.0
    assert logged == {"action/valid_fraction": 0.0, "action/truncated_fraction": 1.0, "action/mean_reward": 0.0}
