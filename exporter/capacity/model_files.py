"""Where a model's `config.json` is, for a model named the way vLLM takes it: its Hugging Face id.

Why: `vllm serve Qwen/Qwen3-8B` is how a server is started, so `model: Qwen/Qwen3-8B` is what a user
writes. The daemon runs offline beside the servers; it reads the architecture from a file that is
already here, never from the network:

* a folder of model configs (`STEPBUDGET_MODEL_CONFIGS`, default `/etc/stepbudget/models`, where the
  chart mounts its `models` value): `<owner>--<name>.json` (a ConfigMap key cannot hold a `/`) or
  `<owner>/<name>/config.json`;
* the Hugging Face cache a server on this host filled (`HF_HUB_CACHE`, else `HF_HOME/hub`, else
  `$XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub`):
  `models--<owner>--<name>/snapshots/<revision>/config.json`, the revision `refs/main` names, else the
  newest snapshot;
* only where the user opts in by naming a hub (`STEPBUDGET_MODEL_HUB`, the address of the Hugging Face
  hub or of a mirror of it), `<hub>/<owner>/<name>/resolve/main/config.json`, fetched once with a
  timeout (and `HF_TOKEN` as a bearer token, for gated models) and kept under the temporary folder.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from exporter.errors import InputError

MODEL_CONFIGS_ENV = "STEPBUDGET_MODEL_CONFIGS"
DEFAULT_MODEL_CONFIGS = "/etc/stepbudget/models"
MODEL_HUB_ENV = "STEPBUDGET_MODEL_HUB"
HUB_TIMEOUT_SECONDS = 10.0
# A Hugging Face repository id: owner/name, each of letters, digits, '-', '_' and '.' (not starting with one).
_HF_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def is_hf_id(model: str) -> bool:
    """`owner/name` and nothing a path would hold beyond it (no leading `./`, no `.json`)."""
    return bool(_HF_ID.match(model)) and not model.endswith(".json")


def config_file_key(model_id: str) -> str:
    """The file name a model config folder (or a ConfigMap's key) gives a model's config: `owner--name.json`."""
    owner, name = model_id.split("/", 1)
    return f"{owner}--{name}.json"


@dataclass(frozen=True)
class Found:
    """The config.json found for a model id, or every place looked in (for the error)."""

    path: str | None
    looked_in: tuple[str, ...]


def find_model_config(model_id: str) -> Found:
    """The first place in the order above holding the model's config.json."""
    owner, name = model_id.split("/", 1)
    looked_in: list[str] = []
    for folder in _model_config_folders():
        for candidate in (folder / config_file_key(model_id), folder / owner / name / "config.json"):
            looked_in.append(str(candidate))
            if candidate.is_file():
                return Found(str(candidate), tuple(looked_in))
    repository = _hub_cache() / f"models--{owner}--{name}"
    looked_in.append(str(repository / "snapshots" / "*" / "config.json"))
    snapshot = _snapshot(repository)
    if snapshot is not None and (snapshot / "config.json").is_file():
        return Found(str(snapshot / "config.json"), tuple(looked_in))
    hub = os.environ.get(MODEL_HUB_ENV, "").rstrip("/")
    if hub:
        looked_in.append(_hub_url(hub, model_id))
        return Found(download_config(hub, model_id), tuple(looked_in))
    return Found(None, tuple(looked_in))


def _model_config_folders() -> list[Path]:
    value = os.environ.get(MODEL_CONFIGS_ENV, DEFAULT_MODEL_CONFIGS)
    return [Path(folder) for folder in value.split(os.pathsep) if folder]


def _hub_cache() -> Path:
    """The Hugging Face hub cache, as huggingface_hub places it (its constants: HF_HUB_CACHE, else
    HF_HOME/hub, else ~/.cache/huggingface/hub)."""
    if cache := os.environ.get("HF_HUB_CACHE"):
        return Path(cache)
    if home := os.environ.get("HF_HOME"):
        return Path(home) / "hub"
    if cache_home := os.environ.get("XDG_CACHE_HOME"):
        return Path(cache_home) / "huggingface" / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def _snapshot(repository: Path) -> Path | None:
    """The snapshot `refs/main` names (what a plain download of the model fetched), else the newest."""
    snapshots = repository / "snapshots"
    try:
        main = (repository / "refs" / "main").read_text(encoding="utf-8").strip()
    except OSError:
        main = ""
    if main and (snapshots / main).is_dir():
        return snapshots / main
    try:
        folders = [path for path in snapshots.iterdir() if path.is_dir()]
    except OSError:
        return None
    return max(folders, key=lambda path: path.stat().st_mtime, default=None)


def _hub_url(hub: str, model_id: str) -> str:
    # The hub's file route: /<repo id>/resolve/<revision>/<file> (huggingface_hub's HUGGINGFACE_CO_URL_TEMPLATE).
    return f"{hub}/{model_id}/resolve/main/config.json"


def download_config(hub: str, model_id: str) -> str:
    """Fetch the model's config.json from the hub the user named, once, into the temporary folder (the
    chart's pod has a writable /tmp and nothing else); the path it was kept at. A failure is an error
    naming the URL and what to do, never a hang: the request has a timeout."""
    kept = Path(tempfile.gettempdir()) / "stepbudget-models" / config_file_key(model_id)
    if kept.is_file():
        return str(kept)
    url = _hub_url(hub, model_id)
    request = urllib.request.Request(url, headers={"Accept": "application/json"})
    if token := os.environ.get("HF_TOKEN"):
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=HUB_TIMEOUT_SECONDS) as response:
            body = response.read(4 * 1024 * 1024)
    except urllib.error.HTTPError as error:
        raise InputError(f"model {model_id!r}: {url} answered HTTP {error.code}{_http_hint(error.code)}") from None
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise InputError(f"model {model_id!r}: cannot fetch {url} ({reason}); ship the config.json instead, "
                         f"or unset {MODEL_HUB_ENV}") from None
    try:
        json.loads(body)
    except ValueError as error:
        raise InputError(f"model {model_id!r}: {url} did not answer a JSON config.json ({error})") from None
    kept.parent.mkdir(parents=True, exist_ok=True)
    partial = kept.with_suffix(".partial")
    partial.write_bytes(body)
    partial.replace(kept)  # whole or absent: a crash mid-write leaves no half file to read next time
    return str(kept)


def _http_hint(code: int) -> str:
    if code in (401, 403):
        return " (a gated or private model: set HF_TOKEN to a token that may read it)"
    if code == 404:
        return " (no such model, or no config.json in it: check the id's spelling and case)"
    return ""
