"""tes_grpo/run/sources.py and harmony.check_tokenizer_source: where a model or tokenizer comes from, checked in a
second before anything slow, one line saying what to do when it cannot be had. The Hub is stood in for (its answer
and the cache), but for one case that asks the real network with its timeout."""

from __future__ import annotations

import time
from pathlib import Path

import huggingface_hub.constants
import pytest

from tes_grpo.run import sources
from tes_grpo.run.sources import SourceError, check_model_id, check_source
from tes_grpo.task import harmony

REMEDY = "give a checkpoint folder or tiny"

# (value ({tmp}: a folder holding ckpt/ with config.json, bare/ without, and file.txt), HF_HUB_OFFLINE, the Hub's
#  answer (reached, problem) or None when it must not be asked, in the cache?, the result or the error's words)
CASES = [
    ("{tmp}/ckpt", False, None, False, "{tmp}/ckpt"),  # a checkpoint folder: as it is, nothing asked
    ("{tmp}/bare", False, None, False, "MODEL_ID='{tmp}/bare': the folder has no config.json; " + REMEDY),
    ("{tmp}/file.txt", False, None, False, "MODEL_ID='{tmp}/file.txt': is a file; give the folder that holds"),
    ("{tmp}/ckpx", False, None, False, "MODEL_ID='{tmp}/ckpx' (did you mean {tmp}/ckpt?): no such folder; " + REMEDY),
    ("{tmp}/elsewhere", False, None, False, "MODEL_ID='{tmp}/elsewhere': no such folder; " + REMEDY),  # nothing near
    ("tinyy", True, None, False, "MODEL_ID='tinyy' (did you mean tiny?): not a folder here, and as a Hub id it is not "
                                 "in the local Hugging Face cache, and HF_HUB_OFFLINE=1 keeps the Hub off; " + REMEDY),
    ("org/model", False, (False, "Name or service not known"), False,
     "MODEL_ID='org/model': not a folder here, and as a Hub id it is not in the local Hugging Face cache, and the Hub "
     "(https://huggingface.co) cannot be reached (Name or service not known; on a machine without it, "
     "HF_HUB_OFFLINE=1 skips asking); " + REMEDY),
    ("org/model", False, (True, "is not on the Hub"), False, "MODEL_ID='org/model': not a folder here, and as a Hub "
                                                              "id it is not on the Hub; " + REMEDY),
    ("org/model", False, (True, None), False, "org/model"),  # on the Hub: the loader downloads it
    ("org/model", True, None, True, "org/model"),  # offline, in the cache: loaded from it, nothing asked
    ("org/model", False, (False, "timed out"), True, "org/model"),  # cached, the Hub away: offline from here on
    ("a--b", False, None, False, "MODEL_ID='a--b': no such folder"),  # not a valid Hub id: never asked
]


@pytest.mark.parametrize("value, offline, answer, cached, expected", CASES)
def test_check_source(tmp_path, monkeypatch, value, offline, answer, cached, expected):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    (tmp_path / "bare").mkdir()
    (tmp_path / "file.txt").write_text("x")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", offline)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    asked = []
    monkeypatch.setattr(sources, "ask_hub", lambda repo_id, timeout=0: asked.append(repo_id) or answer)
    monkeypatch.setattr(sources, "in_cache", lambda repo_id, filename: cached)
    said = []
    value, expected = value.format(tmp=tmp_path), expected.format(tmp=tmp_path)
    if expected.startswith("MODEL_ID="):
        with pytest.raises(SourceError) as err:
            check_source(value, "MODEL_ID", "config.json", REMEDY, known=sources.KNOWN_MODELS, say=said.append)
        assert expected in str(err.value) and "\n" not in str(err.value)
    else:
        assert check_source(value, "MODEL_ID", "config.json", REMEDY, known=sources.KNOWN_MODELS,
                            say=said.append) == expected
    assert bool(asked) == (answer is not None)  # the Hub is asked only where neither a folder nor the cache answers
    went_offline = answer is not None and cached and not answer[0]
    assert huggingface_hub.constants.HF_HUB_OFFLINE == (offline or went_offline)
    assert bool(said) == went_offline  # and says so


def test_tiny_is_a_model_id_of_its_own():
    assert check_model_id("tiny") == "tiny"


def test_an_unreachable_hub_is_one_line_within_five_seconds(monkeypatch):
    """The real network, whatever this machine has: no Hub (an error at once), a slow one (PROBE_SECONDS), or one that
    answers (no such model). Never huggingface_hub's retries."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    started = time.monotonic()
    with pytest.raises(SourceError, match="MODEL_ID='no-such-org-x7/no-such-model-x7': not a folder here"):
        check_model_id("no-such-org-x7/no-such-model-x7")
    assert time.monotonic() - started < 5


def test_a_hub_that_does_not_answer_is_given_up_on(monkeypatch):
    from huggingface_hub import HfApi

    monkeypatch.setattr(HfApi, "model_info", lambda self, repo_id, timeout=None: time.sleep(30))
    started = time.monotonic()
    assert sources.ask_hub("org/model", timeout=0.2) == (False, "no answer within 0.2 s")
    assert time.monotonic() - started < 3


# ---- the tokenizer: (GPT_OSS_TOKENIZER ({tmp}: with tok/ holding tokenizer.json), the shared folder there?,
#      HF_HUB_OFFLINE, the result or the error's words)
TOKENIZER_CASES = [
    ("{tmp}/tok", False, False, "{tmp}/tok"),
    ("/nonexistent/tok", True, False,
     "GPT_OSS_TOKENIZER='/nonexistent/tok': no such folder; set GPT_OSS_TOKENIZER to a folder with gpt-oss's "
     "tokenizer.json (AutoTokenizer.from_pretrained('openai/gpt-oss-20b').save_pretrained(FOLDER) writes one where "
     "the Hub can be reached), or unset it to use {shared} or else the Hub's openai/gpt-oss-20b"),
    ("{tmp}", True, False, "GPT_OSS_TOKENIZER='{tmp}': the folder has no tokenizer.json"),
    (None, True, False, "{shared}"),  # unset: the shared folder
    (None, False, True, "no gpt-oss tokenizer: GPT_OSS_TOKENIZER is unset, there is no folder {shared}, and the Hub's "
                        "openai/gpt-oss-20b is not in the local Hugging Face cache, and HF_HUB_OFFLINE=1 keeps the Hub "
                        "off; set GPT_OSS_TOKENIZER to a folder with gpt-oss's tokenizer.json"),
]


@pytest.mark.parametrize("env, shared, offline, expected", TOKENIZER_CASES)
def test_the_tokenizer_is_checked_before_anything_loads(tmp_path, monkeypatch, env, shared, offline, expected):
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    shared_folder = tmp_path / "shared" / "gpt-oss-tokenizer"
    if shared:
        shared_folder.mkdir(parents=True)
        (shared_folder / "tokenizer.json").write_text("{}")
    monkeypatch.setattr(harmony, "SHARED_TOKENIZER", shared_folder)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", offline)
    monkeypatch.setattr(sources, "in_cache", lambda repo_id, filename: False)
    if env is None:
        monkeypatch.delenv("GPT_OSS_TOKENIZER", raising=False)
    else:
        monkeypatch.setenv("GPT_OSS_TOKENIZER", env.format(tmp=tmp_path))
    expected = expected.format(tmp=tmp_path, shared=shared_folder)
    if Path(expected).is_absolute():
        assert harmony.check_tokenizer_source(say=lambda line: None) == expected
    else:
        with pytest.raises(SourceError) as err:
            harmony.check_tokenizer_source(say=lambda line: None)
        assert str(err.value).startswith(expected) and "\n" not in str(err.value)
        with pytest.raises(SourceError):  # and the loader, cached or not, says the same before transformers is asked
            harmony.load_tokenizer.__wrapped__()
