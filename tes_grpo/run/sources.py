"""Where a model or tokenizer that a setting names comes from, checked in about a second, before anything slow: a
local folder (it must hold the file its loader reads first), or a Hugging Face Hub id, which needs the Hub or a copy
in the local cache. Library module, not a script:

    path = check_source(s.MODEL_ID, "MODEL_ID", "config.json", "give a checkpoint folder, or tiny", known=("tiny",))

Why here and not left to transformers: from_pretrained answers a folder that does not exist with "Repo id must be
in the form ...", and a Hub id it cannot reach only after huggingface_hub's retries (about a minute and a dozen
"Retrying" lines). check_source says in one line (SourceError) what is wrong and what to do: the nearest known
name ("did you mean tiny?"), the local options, HF_HUB_OFFLINE. The Hub is asked once, with PROBE_SECONDS to
answer and no retries; an id already in the cache then loads from it as HF_HUB_OFFLINE=1 would (this process is
set offline, and says so), so that the loaders do not retry either.
"""

from __future__ import annotations

import difflib
import os
import re
import threading
from pathlib import Path

from tes_grpo.run.presets import TINY_MODEL_ID
from tes_grpo.run.script_config import SettingsError

PROBE_SECONDS = 3.0  # how long the Hub may take to answer the one question asked of it
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")  # "name" or "owner/name"
_TRUE = {"1", "on", "yes", "true"}  # huggingface_hub's reading of HF_HUB_OFFLINE
KNOWN_MODELS = (TINY_MODEL_ID, "openai/gpt-oss-20b", "openai/gpt-oss-120b")  # what a misspelt MODEL_ID is compared with
MODEL_OPTIONS = (f"give a checkpoint folder (one with config.json), {TINY_MODEL_ID} (the embedded tiny model) or a "
                 "Hub id such as openai/gpt-oss-20b")


class SourceError(SettingsError):
    """A model or tokenizer that cannot be had: one line naming the setting, its value and what to do."""


def hub_offline() -> bool:
    """Whether HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) keeps the Hub off, as huggingface_hub reads them; also after
    go_offline, which changes huggingface_hub's constant rather than the process's environment alone."""
    import huggingface_hub.constants as constants

    return constants.HF_HUB_OFFLINE or any(os.environ.get(name, "").strip().lower() in _TRUE
                                           for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def go_offline(why: str, say=print) -> None:
    """This process loads from the local cache only, as HF_HUB_OFFLINE=1 makes it: huggingface_hub reads the
    variable when imported, and transformers asks huggingface_hub's constant at every load."""
    import huggingface_hub.constants as constants

    os.environ["HF_HUB_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True
    say(f"note: the Hub cannot be reached ({why}); loading from the local cache only, as HF_HUB_OFFLINE=1 would")


def hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def in_cache(repo_id: str, filename: str) -> bool:
    """Whether the local Hugging Face cache holds `filename` of the model `repo_id`."""
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, filename), str)


def ask_hub(repo_id: str, timeout: float = PROBE_SECONDS) -> tuple[bool, str | None]:
    """(whether the Hub answered, why the model cannot be had from it (the end of a sentence) or None): one request,
    no retries, at most `timeout` seconds (a thread, since name resolution takes no timeout of its own)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    answer: list = []

    def ask() -> None:
        try:
            HfApi().model_info(repo_id, timeout=timeout)
            answer.append((True, None))
        except GatedRepoError:
            answer.append((True, "is a gated model: accept its terms on the Hub, then log in (`hf auth login`)"))
        except RepositoryNotFoundError:
            answer.append((True, "is not on the Hub (or is private: log in with `hf auth login`)"))
        except HfHubHTTPError:  # the Hub answered, with something else: the loader reports it in its own words
            answer.append((True, None))
        except Exception as err:  # no answer: the HTTP library's own errors (the library changes between versions)
            answer.append((False, " ".join(str(err).split()) or type(err).__name__))

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    thread.join(timeout + 1.0)
    return answer[0] if answer else (False, f"no answer within {timeout:g} s")


def hub_problem(repo_id: str, needs: str, say=print) -> str | None:
    """Why the Hub id `repo_id` cannot be loaded here (the end of a sentence about it), or None when it can: from the
    cache (then, with the Hub out of reach, this process goes offline) or from the Hub."""
    if in_cache(repo_id, needs):
        if not hub_offline():
            reached, _ = ask_hub(repo_id)
            if not reached:
                go_offline(f"{hub_endpoint()} did not answer", say)
        return None
    if hub_offline():
        return "is not in the local Hugging Face cache, and HF_HUB_OFFLINE=1 keeps the Hub off"
    reached, problem = ask_hub(repo_id)
    if not reached:
        return (f"is not in the local Hugging Face cache, and the Hub ({hub_endpoint()}) cannot be reached "
                f"({problem}; on a machine without it, HF_HUB_OFFLINE=1 skips asking)")
    return problem


def looks_like_a_path(text: str) -> bool:
    """A Hub id is "name" or "owner/name"; anything else with a slash, or starting with . or ~, is a folder, and so
    is "a/b" where a folder "a" is here (runs/my-run)."""
    return (text.startswith(("/", ".", "~")) or text.count("/") > 1 or "\\" in text or text.endswith("/")
            or ("/" in text and Path(text.split("/")[0]).is_dir()))


def nearest(value: str, known=()) -> str:
    """" (did you mean X?)" for the known name nearest to `value`, or, for a missing path, the folder beside it
    whose name is nearest to its name; "" when none is near."""
    if value in known:
        return ""
    close = difflib.get_close_matches(value, list(known), n=1, cutoff=0.75)
    parent = Path(value).expanduser().parent
    if not close and looks_like_a_path(value) and parent.is_dir():
        names = [child.name for child in parent.iterdir() if child.is_dir()]
        close = [str(Path(value).parent / name)
                 for name in difflib.get_close_matches(Path(value).name, names, n=1, cutoff=0.75)]
    return f" (did you mean {close[0]}?)" if close else ""


def check_source(value: str, name: str, needs: str, local: str, known=(), say=print) -> str:
    """`value` (setting `name`) as a loader takes it, a folder or a Hub id, once it is known to be there; SourceError
    otherwise. needs: the file the loader reads first (config.json, tokenizer.json); local: what to give instead,
    said after the problem; known: the names a misspelling is compared with (the Hub ids and "tiny")."""
    text = str(value).strip()
    subject = f"{name}={text!r}"
    if not text:
        raise SourceError(f"{name} is empty; {local}")
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / needs).is_file():
            raise SourceError(f"{subject}: the folder has no {needs}; {local}")
        return str(path)
    if path.exists():
        raise SourceError(f"{subject}: is a file; give the folder that holds {needs}")
    subject += nearest(text, known)
    if looks_like_a_path(text) or not HUB_ID.match(text) or "--" in text or ".." in text:  # the Hub's own rules
        raise SourceError(f"{subject}: no such folder; {local}")
    problem = hub_problem(text, needs, say)
    if problem:
        raise SourceError(f"{subject}: not a folder here, and as a Hub id it {problem}; {local}")
    return text


def check_model_id(model_id: str, name: str = "MODEL_ID", local: str = MODEL_OPTIONS, say=print) -> str:
    """A MODEL_ID-like setting checked as check_source checks it, before anything slow; "tiny" (built on first use)
    passes as it is."""
    if model_id == TINY_MODEL_ID:
        return model_id
    return check_source(model_id, name, "config.json", local, known=KNOWN_MODELS, say=say)
