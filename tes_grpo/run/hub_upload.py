"""The Hub upload of an exported folder: everything checked before the slow export, the token passed down and never
printed.

Library module, not a script. export_quantized_model.py asks `hub_target` for the repo id and token (HubError on a
bad id or a missing token), `check_hub_access` before exporting (the token can write there; an existing repo is
private unless allowed public), and `push_folder_to_hub` after; `redact` keeps the token out of any message it
prints. The api argument is huggingface_hub.HfApi(token=...) (the tests give a stand-in).
"""

from __future__ import annotations

import importlib
import re
import typing
from pathlib import Path

from huggingface_hub.errors import HfHubHTTPError, HFValidationError, RepositoryNotFoundError
from huggingface_hub.utils import validate_repo_id


class HubError(RuntimeError):
    """The Hub upload cannot go ahead or failed; the message says why (never the token)."""


_REPO_ID_FORM = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def hub_connection_errors() -> tuple[type[BaseException], ...]:
    """The HTTP client's transport errors (no network, DNS, timeout): httpx under huggingface_hub 1.x, httpx2 under
    2.x. Only these and the Hub's HTTP errors are turned into an `error:` line; anything else is a bug to see."""
    found = []
    for name in ("httpx", "httpx2"):
        try:
            found.append(importlib.import_module(name).TransportError)
        except ImportError:
            continue
    return tuple(found)


def hub_target(settings, environ: typing.Mapping[str, str]) -> tuple[str, str] | None:
    """(repo id, token) for the upload, or None when there is nothing to upload to; HubError on bad input.

    The repo id is --HUB_REPO_ID, else the HF_REPO_ID environment variable; the token is HF_TOKEN.
    """
    if not settings.PUSH_TO_HUB:
        return None
    repo_id = (settings.HUB_REPO_ID or environ.get("HF_REPO_ID", "")).strip()
    if not repo_id:
        return None
    source = "--HUB_REPO_ID" if settings.HUB_REPO_ID else "HF_REPO_ID"
    if not _REPO_ID_FORM.match(repo_id):
        raise HubError(f"{source}={repo_id!r} is not a Hub repo id of the form owner/name (e.g. "
                       f"you/gpt-oss-20b-tes-mxfp4)")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise HubError(f"{source}={repo_id!r} is not a valid Hub repo id ({err})") from None
    token = environ.get("HF_TOKEN", "").strip()
    if not token:
        raise HubError(f"{source}={repo_id} asks for an upload, but HF_TOKEN is not set: export HF_TOKEN=<a token "
                       f"with write access> (or --PUSH_TO_HUB=0 to export without uploading)")
    return repo_id, token


def hub_call(what: str, call, *args, **kwargs):
    """Runs one Hub call; connection failures and HTTP errors become a HubError naming `what` (not the token)."""
    try:
        return call(*args, **kwargs)
    except HfHubHTTPError as err:
        status = getattr(getattr(err, "response", None), "status_code", None)
        detail = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise HubError(f"{what}: the Hub answered {status or 'an error'}: {detail}") from None
    except hub_connection_errors() as err:
        raise HubError(f"{what}: cannot reach the Hugging Face Hub ({type(err).__name__}: {err})") from None


def repo_visibility(api, repo_id: str) -> str | None:
    """"private" or "public" for an existing repo, None when it does not exist (or is not visible to the token)."""
    try:
        info = api.repo_info(repo_id, repo_type="model")
    except RepositoryNotFoundError:
        return None
    return "private" if info.private else "public"


def check_hub_access(api, repo_id: str, allow_public: bool) -> str:
    """Before the export: the token is valid and may write to the repo's namespace, and an existing repo is private
    (or public with allow_public). Returns what will happen to the repo, for the log."""
    who = hub_call("checking HF_TOKEN", api.whoami)
    role = ((who.get("auth") or {}).get("accessToken") or {}).get("role")
    if role == "read":
        raise HubError(f"HF_TOKEN belongs to {who.get('name')} but is a read-only token: uploading to {repo_id} needs "
                       f"a token with write access")
    owner = repo_id.split("/", 1)[0]
    namespaces = {who.get("name")} | {org.get("name") for org in who.get("orgs") or []}
    if owner not in namespaces:
        raise HubError(f"HF_TOKEN belongs to {who.get('name')}, which cannot write to {owner}/ (its namespaces: "
                       f"{', '.join(sorted(n for n in namespaces if n))})")
    visibility = hub_call(f"looking up {repo_id}", repo_visibility, api, repo_id)
    if visibility == "public" and not allow_public:
        raise HubError(f"{repo_id} exists and is PUBLIC: the upload would publish the model. Make the repo private "
                       f"on the Hub, choose another repo id, or pass --ALLOW_PUBLIC_REPO=1")
    return f"existing {visibility} repo" if visibility else "new private repo"


def push_folder_to_hub(api, out_dir: Path, repo_id: str, allow_public: bool) -> tuple[str, str]:
    """Uploads `out_dir` to `repo_id` (created private if missing); returns (url, the repo's real visibility)."""
    later = f"the export is complete in {out_dir}; upload it later with `hf upload {repo_id} {out_dir}`"
    try:
        url = hub_call(f"creating {repo_id}", api.create_repo, repo_id, private=True, exist_ok=True,
                       repo_type="model")
        # create_repo(exist_ok=True) leaves an existing repo as it is: read what it really is
        visibility = hub_call(f"looking up {repo_id}", repo_visibility, api, repo_id) or "unknown visibility"
        if visibility != "private" and not allow_public:
            raise HubError(f"{repo_id} is {visibility.upper()}, not private: not uploading (pass "
                           f"--ALLOW_PUBLIC_REPO=1 to publish)")
        hub_call(f"uploading to {repo_id}", api.upload_folder, folder_path=str(out_dir), repo_id=repo_id,
                 repo_type="model", commit_message="MXFP4 export of gpt-oss with a merged GRPO LoRA adapter")
    except HubError as err:
        raise HubError(f"{err}; {later}") from None
    return str(url), visibility


def redact(text: str, secret: str | None) -> str:
    """`text` with every occurrence of `secret` replaced, for messages that might quote a request."""
    return text.replace(secret, "<HF_TOKEN>") if secret else text
