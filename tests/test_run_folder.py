"""tes_grpo/run/run_folder.py: checkpoint names, which checkpoint a resume takes, and logs trimmed on resume, torn files
included (a run killed mid-write: disk full, SIGKILL). Table-driven; no model."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from tes_grpo.run.fileio import InputError
from tes_grpo.run.run_folder import (
    checkpoints_in,
    drop_log_rows_after,
    prepare_resume,
    rename_checkpoint,
    resume_checkpoint,
)

HEADER = "step,micro_step,prompt,completion,action,reward,truncated,target_action,rank\n"


def make_checkpoint(out: Path, step: int, padded: bool = True, state: str | None = None) -> Path:
    folder = out / (f"checkpoint-{step:06d}" if padded else f"checkpoint-{step}")
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}) if state is None else state)
    return folder


def test_resume_picks_newest_checkpoint_by_number(tmp_path):
    for step, padded in ((5, True), (20, False), (10, True)):
        make_checkpoint(tmp_path, step, padded)
    assert resume_checkpoint(tmp_path, "1") == tmp_path / "checkpoint-20"
    assert resume_checkpoint(tmp_path, str(tmp_path / "checkpoint-000005")) == tmp_path / "checkpoint-000005"
    assert [step for step, _ in checkpoints_in(tmp_path)] == [5, 10, 20]


# (what OUT_DIR holds, RESUME, error words or None)
RESUME_CASES = [
    ([], "", None),  # new run in an empty folder
    (["checkpoint"], "", "--RESUME=1"),  # refuses to start over an existing run
    (["metrics.jsonl"], "", "already holds a run"),
    (["checkpoint", "adapter"], "", "already holds a finished run (checkpoint-000004, adapter_model.safetensors); a "
                                    "new run needs another --OUT_DIR, and --RESUME=1 with a higher --TOTAL_STEPS"),
    ([], "1", "no complete checkpoint-* folder to resume from; {out} holds no run yet: a plain run (without "
              "--RESUME) starts one there"),  # an empty folder: says what a plain run does
    (["metrics.jsonl"], "1", "stopped before its first checkpoint, so it cannot be continued: a plain run (without "
                             "--RESUME) starts over there once its metrics.jsonl are removed, or in another --OUT_DIR"),
    (["torn"], "1", "no complete checkpoint"),  # the only checkpoint is torn
    ([], "/nonexistent/checkpoint-3", "without trainer_state.json"),
]


@pytest.mark.parametrize("contents, resume, words", RESUME_CASES)
def test_resume_rules(tmp_path, contents, resume, words):
    if "checkpoint" in contents:
        make_checkpoint(tmp_path, 4)
    if "torn" in contents:
        make_checkpoint(tmp_path, 4, state='{"global_st')
    if "metrics.jsonl" in contents:
        (tmp_path / "metrics.jsonl").write_text("{}\n")
    if "adapter" in contents:
        (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    if words is None:
        assert resume_checkpoint(tmp_path, resume) is None
    else:
        with pytest.raises(InputError) as err:
            resume_checkpoint(tmp_path, resume)
        assert words.format(out=tmp_path) in str(err.value)


# (what OUT_DIR holds, the step in progress, after the last step?, the one line said)
STOPPED_CASES = [
    ([4], 7, False, "stopped by Ctrl-C in step 7 of 10; --RESUME=1 continues from {out}/checkpoint-000004 (step 4); "
                    "the rows of later steps in the logs are dropped then"),
    ([], 3, False, "stopped by Ctrl-C in step 3 of 10; no checkpoint was written yet; the run in {out} stopped before "
                   "its first checkpoint, so it cannot be continued: a plain run (without --RESUME) starts over there "
                   "once its metrics.jsonl are removed, or in another --OUT_DIR"),
    (None, None, False, "stopped by Ctrl-C before the first training step; no checkpoint was written yet; {out} holds "
                        "no run yet: a plain run (without --RESUME) starts one there"),  # nothing written at all
    ([10], 11, True, "stopped by Ctrl-C after the last step (10), while saving the adapter; --RESUME=1 continues from "
                     "{out}/checkpoint-000010 (step 10)"),
]


@pytest.mark.parametrize("checkpoints, step, ended, line", STOPPED_CASES)
def test_a_stopped_run_says_where_and_how_to_go_on(tmp_path, checkpoints, step, ended, line):
    from tes_grpo.run.run_folder import stopped_message

    out = tmp_path / "run"
    if checkpoints is not None:
        out.mkdir()
        (out / "metrics.jsonl").write_text('{"step": 1}\n')
        for number in checkpoints:
            make_checkpoint(out, number)
    said = stopped_message(out, 10, step, ended, "stopped by Ctrl-C")
    assert said.startswith(line.format(out=out)) and "\n" not in said


# (trainer_state.json of the newest checkpoint (step 20); step 10's is complete)
TORN_STATES = [
    '{"global_step": 2',  # cut mid-write
    "",  # empty: the write never happened
    '{"best_metric": null}',  # no global_step
    "\xff\xfe",  # garbage
]


@pytest.mark.parametrize("state", TORN_STATES)
def test_resume_falls_back_to_previous_complete_checkpoint(tmp_path, state):
    make_checkpoint(tmp_path, 10)
    make_checkpoint(tmp_path, 20, state=state)
    said = []
    assert resume_checkpoint(tmp_path, "1", said.append) == tmp_path / "checkpoint-000010"
    assert any("skipping checkpoint-000020" in line for line in said)


def test_explicit_torn_checkpoint_is_an_error(tmp_path):
    folder = make_checkpoint(tmp_path, 20, state='{"global_')
    with pytest.raises(InputError, match="not a complete trainer state"):
        resume_checkpoint(tmp_path, str(folder))


def metrics_lines(steps) -> str:
    return "".join(json.dumps({"step": s, "reward": 0.1}) + "\n" for s in steps)


def log_rows(steps) -> str:
    return "".join(f'{s},0,"p\nq",c{s},1,0.5,0,1,0\n' for s in steps)


# (metrics.jsonl, completions.csv, steps kept in each, notes expected)
TRIM_CASES = [
    (metrics_lines([1, 2, 3, 4]), HEADER + log_rows([1, 2, 3, 3, 4]), [1, 2], [1, 2], ["dropped 2 metrics"]),
    # torn last metrics line (disk full): dropped with a note, not a JSONDecodeError
    (metrics_lines([1, 2]) + '{"step": 3, "rew', HEADER + log_rows([1, 2]), [1, 2], [1, 2], ["torn last line"]),
    # torn last completion-log row inside a quoted prompt: dropped, not a ParserError
    (metrics_lines([1, 2]), HEADER + log_rows([1, 2]) + '3,0,"p\nq', [1, 2], [1, 2], ["torn last row"]),
    # torn last row cut between fields
    (metrics_lines([1, 2]), HEADER + log_rows([1, 2]) + "3,0,", [1, 2], [1, 2], ["torn last row"]),
    # nothing to trim: files left byte for byte
    (metrics_lines([1, 2]), HEADER + log_rows([1, 2]), [1, 2], [1, 2], []),
]


@pytest.mark.parametrize("metrics, log, kept_metrics, kept_log, notes", TRIM_CASES)
def test_drop_log_rows_after_checkpoint(tmp_path, metrics, log, kept_metrics, kept_log, notes):
    import pandas as pd

    (tmp_path / "metrics.jsonl").write_text(metrics)
    path = tmp_path / "completions.csv"
    path.write_bytes(log.encode())
    said = []
    drop_log_rows_after(tmp_path, 2, path, said.append)
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == kept_metrics
    frame = pd.read_csv(path, keep_default_na=False)
    assert frame["step"].tolist() == kept_log and set(frame["prompt"]) == {"p\nq"}
    for note in notes:
        assert any(note in line for line in said), (note, said)
    if not notes:
        assert (tmp_path / "metrics.jsonl").read_text() == metrics and path.read_bytes() == log.encode()


def test_kept_rows_stay_byte_for_byte_with_carriage_returns(tmp_path):
    # a completion holding a bare carriage return keeps it (universal newlines would have made it \n)
    path = tmp_path / "completions.csv"
    kept = HEADER + '1,0,"p\nq","c\rr",1,0.5,0,1,0\n'  # a quoted \r (CompletionLog quotes every field)
    path.write_bytes((kept + log_rows([2])).encode())
    drop_log_rows_after(tmp_path, 1, path, lambda _: None)
    import pandas as pd

    assert pd.read_csv(path, keep_default_na=False)["completion"].tolist() == ["c\rr"]


def test_bad_row_in_the_middle_is_an_error_naming_it(tmp_path):
    path = tmp_path / "completions.csv"
    path.write_text(HEADER + log_rows([1]) + "2,0\n" + log_rows([3]))
    with pytest.raises(InputError, match="row 3 has 2 fields"):
        drop_log_rows_after(tmp_path, 2, path)


@pytest.mark.parametrize("total_steps, trimmed", [
    (None, True),  # no end given: the steps after the checkpoint will be redone, their rows go
    (3, True),  # the run goes on past the checkpoint: the same
    (1, False),  # the checkpoint is already at the end: nothing is redone, the folder stays as it is
])
def test_prepare_resume_trims_before_any_model_load(tmp_path, total_steps, trimmed):
    make_checkpoint(tmp_path, 1)
    written = metrics_lines([1, 2]) + '{"st'
    (tmp_path / "metrics.jsonl").write_text(written)
    checkpoint, step = prepare_resume(tmp_path, "1", tmp_path / "completions.csv", processes=1, say=lambda _: None,
                                      total_steps=total_steps)
    assert (checkpoint.name, step) == ("checkpoint-000001", 1)
    assert (tmp_path / "metrics.jsonl").read_text() == (metrics_lines([1]) if trimmed else written)


def test_zero_padded_checkpoint_rename(tmp_path):
    from tes_grpo.run.callbacks import ZeroPaddedCheckpointNames

    make_checkpoint(tmp_path, 30, padded=False)
    state = SimpleNamespace(global_step=30, is_world_process_zero=True, best_model_checkpoint=None)
    ZeroPaddedCheckpointNames().on_save(SimpleNamespace(output_dir=str(tmp_path)), state, None)
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-000030"]
    rename_checkpoint(tmp_path, 30)  # already padded: nothing to do
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-000030"]


# (seconds since training began, global step of the line, what the line ends with): logged every step, then every 2
PROGRESS_TIMES = [
    (30.0, 1, "step 1/6  reward 0.5  30.0 s/step (average 30.0)"),  # the first step (compiles) alone
    (40.0, 2, "step 2/6  reward 0.5  10.0 s/step (average 20.0)"),  # the latest step, then the average
    (60.0, 4, "step 4/6  reward 0.5  10.0 s/step (average 15.0)"),  # two steps since the last line
]


def test_progress_line_gives_the_latest_steps_seconds_then_the_average():
    from tes_grpo.run.callbacks import ProgressLineCallback

    line = ProgressLineCallback()
    line.started = line.last = 100.0
    for seconds, step, expected in PROGRESS_TIMES:
        state = SimpleNamespace(global_step=step, max_steps=6)
        assert "  ".join(line.progress_parts(state, {"reward": 0.5}, 100.0 + seconds)) == expected


# ---------------------------------------------------------------------------------------------------------------
# The one adapter-folder check (lora_adapter_config), shared by evaluation and both exporters
# ---------------------------------------------------------------------------------------------------------------

def make_adapter(folder: Path, config: dict | str | None = None, weights: bool = True) -> Path:
    """An adapter folder: adapter_config.json (a dict as JSON, a string as written; None: no file) and, with
    weights, an adapter_model.safetensors (its content is never read by the check)."""
    folder.mkdir(parents=True, exist_ok=True)
    if config is not None:
        text = config if isinstance(config, str) else json.dumps(config)
        (folder / "adapter_config.json").write_text(text, encoding="utf-8")
    if weights:
        (folder / "adapter_model.safetensors").write_bytes(b"")
    return folder


LORA = {"peft_type": "LORA", "base_model_name_or_path": "openai/gpt-oss-20b", "lora_alpha": 8}

# (what the folder holds, the message's start after the path it names, the file it names)
BAD_ADAPTERS = [
    ("no folder", "adapter folder does not exist", ""),
    ("no config", "missing: this is not a PEFT adapter folder (no adapter_config.json)", "adapter_config.json"),
    ("torn config", "not valid JSON", "adapter_config.json"),
    ("no weights", "missing: the adapter has no weights saved as safetensors", "adapter_model.safetensors"),
    ("not LoRA", "peft_type is 'IA3': only LoRA adapters", "adapter_config.json"),
    ("no peft_type", "peft_type is None: only LoRA adapters", "adapter_config.json"),
]


def bad_adapter(tmp_path: Path, case: str) -> Path:
    folder = tmp_path / "adapter"
    if case == "no config":
        make_adapter(folder)
    elif case == "torn config":
        make_adapter(folder, '{"peft_type": "LO')
    elif case == "no weights":
        make_adapter(folder, LORA, weights=False)
    elif case == "not LoRA":
        make_adapter(folder, {**LORA, "peft_type": "IA3"})
    elif case == "no peft_type":
        make_adapter(folder, {"base_model_name_or_path": "x"})
    return folder


@pytest.mark.parametrize("case, message, file", BAD_ADAPTERS)
def test_lora_adapter_config_names_the_file_and_the_problem(tmp_path, case, message, file):
    from tes_grpo.run.adapter_folder import lora_adapter_config

    folder = bad_adapter(tmp_path, case)
    with pytest.raises(InputError) as caught:
        lora_adapter_config(folder)
    where = folder / file if file else folder
    assert str(caught.value).startswith(f"{where}: {message}"), str(caught.value)


def test_lora_adapter_config_returns_the_config_of_a_good_folder(tmp_path):
    from tes_grpo.run.adapter_folder import adapter_base_model, lora_adapter_config

    folder = make_adapter(tmp_path / "adapter", LORA)
    assert lora_adapter_config(folder) == LORA
    assert adapter_base_model(folder) == "openai/gpt-oss-20b"


@pytest.mark.parametrize("case, message, file", BAD_ADAPTERS)
def test_evaluation_and_both_exporters_refuse_a_bad_adapter_with_the_same_words(tmp_path, case, message, file):
    """One check: each consumer reports lora_adapter_config's own message, before any model is loaded."""
    import export_gguf_adapter
    import export_quantized_model
    from tes_grpo.model import llm_policy
    from tes_grpo.run.adapter_folder import lora_adapter_config
    from tes_grpo.run.script_config import settings_from

    folder = bad_adapter(tmp_path, case)
    with pytest.raises(InputError) as expected:
        lora_adapter_config(folder)
    with pytest.raises(InputError) as evaluation:
        llm_policy.load_policy_model(adapter_path=str(folder))
    with pytest.raises(export_gguf_adapter.GGUFExportError) as gguf:
        export_gguf_adapter.write_gguf_lora(folder, tmp_path / "lora.gguf")
    settings = settings_from(vars(export_quantized_model),
                             {"ADAPTER_PATH": str(folder), "OUT_DIR": str(tmp_path / "o")})
    with pytest.raises(export_quantized_model.ExportError) as merged:
        export_quantized_model.run_export(settings)
    assert str(evaluation.value) == str(gguf.value) == str(merged.value) == str(expected.value)
    assert message in str(expected.value)
    assert not (tmp_path / "lora.gguf").exists() and not (tmp_path / "o").exists()
