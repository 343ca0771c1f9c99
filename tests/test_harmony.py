"""convert_to_harmony.py against OpenAI's openai-harmony renderer, plus the script's refusals.

Named difference between the two renderings: gpt-oss's chat template ends the developer message with
"\\n\\n" after the instructions ("# Instructions\\n\\n{system}\\n\\n<|end|>"); openai-harmony writes
"# Instructions\\n\\n{system}<|end|>". Everything else (system message with the model identity, knowledge
cutoff, date, reasoning effort and channel line; user message; generation prompt) is identical.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from openai_harmony import Conversation, DeveloperContent, Message, ReasoningEffort, Role, SystemContent

import convert_to_harmony as ch
import make_series
from tes_grpo.run.fileio import InputError
from tes_grpo.task import harmony, task_prompt, tes_env
from tes_grpo.task.harmony import harmony_encoding

REPO = Path(__file__).resolve().parents[1]
TEMPLATE_ONLY_SUFFIX = "\n\n"  # the named difference (module docstring)
EFFORTS = {"low": ReasoningEffort.LOW, "medium": ReasoningEffort.MEDIUM, "high": ReasoningEffort.HIGH}


@pytest.fixture(scope="module")
def series() -> tes_env.Series:
    text = make_series.generate_windows(n_windows=1, seed=3, start_date="2024-06-10")
    [(name, csv_text)] = text.items()
    rows = [line.split(",") for line in csv_text.splitlines()[1:]]
    return tes_env.series_from_rows(rows, name)


def openai_harmony_text(system: str, user: str, effort: str, date: str) -> tuple[str, list[int]]:
    encoding = harmony_encoding()
    conversation = Conversation.from_messages([
        Message.from_role_and_content(
            Role.SYSTEM, SystemContent.new().with_reasoning_effort(EFFORTS[effort]).with_conversation_start_date(date)),
        Message.from_role_and_content(Role.DEVELOPER, DeveloperContent.new().with_instructions(system)),
        Message.from_role_and_content(Role.USER, user),
    ])
    tokens = encoding.render_conversation_for_completion(conversation, Role.ASSISTANT)
    return encoding.decode(tokens), list(tokens)


def with_named_difference(harmony_text: str, system: str) -> str:
    marker = f"# Instructions\n\n{system}<|end|>"
    assert harmony_text.count(marker) == 1
    return harmony_text.replace(marker, f"# Instructions\n\n{system}{TEMPLATE_ONLY_SUFFIX}<|end|>")


# ---- conversations rendered both ways: (timestep, TES energy, reasoning effort, date) ----------------------
AGREEMENT_CASES = [
    (8, 150.0, "medium", "2025-08-05"),  # first decision, the shipped settings
    (35, 0.0, "low", "2025-08-05"),  # day 2 with an empty TES, low effort
    (65, 300.0, "high", "2024-12-31"),  # last decision, full TES, another date
]


@pytest.mark.parametrize("t, energy, effort, date", AGREEMENT_CASES)
def test_template_rendering_agrees_with_openai_harmony(tokenizer, series, t, energy, effort, date):
    system, user = task_prompt.build_prompt(series, t, energy)
    ours = harmony.render_harmony_prompt(system, user, tokenizer, reasoning_effort=effort, date=date)
    theirs, their_tokens = openai_harmony_text(system, user, effort, date)
    assert ours != theirs  # the named difference exists ...
    assert ours == with_named_difference(theirs, system)  # ... and is the only one
    ours_tokens = tokenizer(ours, add_special_tokens=False)["input_ids"]
    expected_tokens = tokenizer(with_named_difference(theirs, system), add_special_tokens=False)["input_ids"]
    assert ours_tokens == expected_tokens
    assert tokenizer.decode(their_tokens) == theirs  # both sides share one vocabulary
    assert f"Current date: {date}\n" in ours and f"Reasoning: {effort}\n" in ours
    assert ours.endswith("<|start|>assistant")


def test_simple_conversation_agrees_with_openai_harmony(tokenizer):
    ours = harmony.render_harmony_prompt("Be brief.", "Say [1].", tokenizer)
    theirs, _ = openai_harmony_text("Be brief.", "Say [1].", "medium", ch.DATE)
    assert ours == with_named_difference(theirs, "Be brief.")


def test_date_is_pinned_and_validated(tokenizer):
    text = harmony.render_harmony_prompt("s", "u", tokenizer, date="2030-01-02")
    assert text.count("Current date: 2030-01-02\n") == 1
    with pytest.raises(ValueError, match="YYYY-MM-DD"):
        harmony.render_harmony_prompt("s", "u", tokenizer, date="2030-01-02\" + x + \"")
    with pytest.raises(ValueError, match="reasoning effort"):
        harmony.render_harmony_prompt("s", "u", tokenizer, reasoning_effort="extreme")


def test_pinning_fails_loudly_when_the_template_has_no_single_date_call(tokenizer):
    template = tokenizer.chat_template
    assert harmony.pinned_date_template(template, "2025-08-05").count('"2025-08-05"') == 1
    with pytest.raises(ValueError, match="0 times"):
        harmony.pinned_date_template(template.replace('strftime_now("%Y-%m-%d")', '"x"'), "2025-08-05")


def legacy_csv(path: Path, prompts: list[str]) -> Path:
    frame = pd.DataFrame({"timestep": [str(8 + i) for i in range(len(prompts))], "prompt": prompts,
                          "q_action_0": ["-1.000000"] * len(prompts), "extra": ["keep, me"] * len(prompts)})
    frame.to_csv(path, index=False, lineterminator="\n")
    return path


def test_convert_keeps_other_columns_and_refuses_existing_output(tokenizer, tmp_path):
    prompts = [task_prompt.legacy_prompt("sys one", "user one"), task_prompt.legacy_prompt("sys two", "user two")]
    source = legacy_csv(tmp_path / "x_q_dataset.csv", prompts)
    [written] = ch.convert_files([source], tokenizer=tokenizer, progress=False)
    assert written == tmp_path / "x_q_dataset_harmony.csv"
    out = pd.read_csv(written, dtype=str, keep_default_na=False)
    original = pd.read_csv(source, dtype=str, keep_default_na=False)
    assert list(out.columns) == list(original.columns)
    assert out.drop(columns="prompt").equals(original.drop(columns="prompt"))
    assert out.prompt[1] == harmony.render_harmony_prompt("sys two", "user two", tokenizer)
    before = written.read_bytes()
    with pytest.raises(InputError, match="output exists"):
        ch.convert_files([source], tokenizer=tokenizer, progress=False)
    assert ch.convert_files([source], overwrite=True, tokenizer=tokenizer, progress=False) == [written]
    assert written.read_bytes() == before  # reproducible


# ---- bad prompts: (prompt of row 2, expected message) -----------------------------------------------------
BAD_PROMPT_CASES = [
    ("<|start|>system<|message|>hi<|end|>", "row 2, column 'prompt': prompt is already in Harmony format"),
    ("   <|start|>user<|message|>x", "row 2, column 'prompt': prompt is already in Harmony format"),  # leading space
    ("", "row 2, column 'prompt': empty prompt"),  # empty cell
    ("just some text", "row 2, column 'prompt': not a legacy two-part prompt"),  # no sections
]


@pytest.mark.parametrize("prompt, message", BAD_PROMPT_CASES)
def test_bad_prompts_are_refused_and_nothing_is_written(tokenizer, tmp_path, prompt, message):
    source = legacy_csv(tmp_path / "y.csv", [task_prompt.legacy_prompt("s", "u"), prompt])
    with pytest.raises(InputError) as info:
        ch.convert_files([source], tokenizer=tokenizer, progress=False)
    assert f"{source}, {message}" in str(info.value)
    assert not (tmp_path / "y_harmony.csv").exists()


def test_cli_refuses_existing_output_without_overwrite(tmp_path):
    source = legacy_csv(tmp_path / "z.csv", [task_prompt.legacy_prompt("s", "u")])
    (tmp_path / "z_harmony.csv").write_text("mine\n")
    result = subprocess.run([sys.executable, str(REPO / "convert_to_harmony.py"), str(source)], cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode == 1
    assert "output exists" in result.stderr and "--OVERWRITE" in result.stderr
    assert (tmp_path / "z_harmony.csv").read_text() == "mine\n"


def test_folder_input_skips_harmony_outputs(tmp_path):
    legacy_csv(tmp_path / "a_q_dataset.csv", [task_prompt.legacy_prompt("s", "u")])
    (tmp_path / "a_q_dataset_harmony.csv").write_text("prompt\nx\n")
    (tmp_path / "series.csv").write_text("datetime,co2_kg_per_kwh,cooling_load_kw\n")
    assert ch.expand_paths([tmp_path]) == [tmp_path / "a_q_dataset.csv"]


def test_main_follows_the_settings(tokenizer, tmp_path, monkeypatch, capsys):
    """--TOKENIZER, --DATE and --REASONING_EFFORT reach the rendering (nothing is bound at definition)."""
    loaded = []
    monkeypatch.setattr(ch, "load_tokenizer", lambda source=None: loaded.append(source) or tokenizer)
    source = legacy_csv(tmp_path / "m.csv", [task_prompt.legacy_prompt("s", "u")])
    folder = tmp_path / "my-tokenizer"
    folder.mkdir()
    assert ch.main([str(source), f"--TOKENIZER={folder}", "--DATE=2030-01-02", "--REASONING_EFFORT=low"]) == 0
    assert loaded == [str(folder)]
    prompt = pd.read_csv(tmp_path / "m_harmony.csv").prompt[0]
    assert prompt == harmony.render_harmony_prompt("s", "u", tokenizer, reasoning_effort="low", date="2030-01-02")
    assert "Current date: 2030-01-02\n" in prompt and "Reasoning: low\n" in prompt
    assert f"tokenizer: {folder}; reasoning effort low; date 2030-01-02" in capsys.readouterr().out
    assert (ch.DATE, ch.REASONING_EFFORT, ch.TOKENIZER) == ("2025-08-05", "medium", "")  # defaults untouched


# ---- TOKENIZER values: (value, error words or None when it is passed on to the loader) -----------------------------
TOKENIZER_CASES = [
    ("/no/such/folder", "the folder does not exist"),  # an absolute path
    ("./missing", "the folder does not exist"),  # a relative one
    ("a/b/c", "the folder does not exist"),  # more than one slash: not a hub id
    ("~/no-such-tokenizer-here", "the folder does not exist"),
    ("openai/gpt-oss-20b", None),  # a hub id
    ("gpt2", None),  # a hub id without owner
]


@pytest.mark.parametrize("value, words", TOKENIZER_CASES)
def test_tokenizer_setting_is_checked_before_loading(value, words):
    if words is None:
        ch.check_tokenizer_source(value)
    else:
        with pytest.raises(ValueError, match=words):
            ch.check_tokenizer_source(value)


def test_a_tokenizer_that_cannot_load_names_the_setting(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=rf"--TOKENIZER='{empty}': cannot load a tokenizer"):
        ch.get_tokenizer(str(empty))


def test_the_random_gpt_oss_shapes_use_harmonys_special_tokens():
    """gpt_oss_shapes' configs (benchmarks' random models) end generation on harmony's <|return|>, not a copied id."""
    from tes_grpo.model.gpt_oss_shapes import gpt_oss_config

    for size in ("20b", "120b"):
        config = gpt_oss_config(size)
        assert (config.eos_token_id, config.pad_token_id, config.bos_token_id) == (
            harmony.RETURN_ID, harmony.PAD_ID, harmony.BOS_ID)
