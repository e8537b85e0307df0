"""Where a teacher's `model_path` points: a local directory, or a Hugging Face id resolved as vLLM
resolves one (its snapshot in the hub cache, downloaded there first unless `HF_HUB_OFFLINE=1`).

Resolved once, in the front, before anything starts: every replica, the front's tokenizer and the
fingerprints then read the same local snapshot directory, and a missing model is one line at start
rather than a replica's traceback. The hub cache is huggingface_hub's own (`HF_HOME`,
`HF_HUB_CACHE`), shared with vLLM, transformers and the `hf` command.
"""

from __future__ import annotations

import re
from pathlib import Path

from proctor.server.engines.base import EngineConfigError

# `org/name`: what the Hub accepts as a model repository id (no leading '/', '.', '~').
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# A teacher needs its config, tokenizer and safetensors weights, not a repository's other
# formats (`original/` .pth, GGUF, ONNX), which can be larger than the model itself.
_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]


def is_hub_id(model_path: str) -> bool:
    """A path that is not on this machine and reads as a Hub model id."""
    return bool(_HUB_ID.match(model_path)) and not Path(model_path).expanduser().exists()


def hub_snapshot(repo_id: str, *, download: bool) -> Path:
    """The local snapshot directory of `repo_id` (its `refs/main` revision in the hub cache):
    downloaded into the cache when `download` and the hub is not offline, else the cache only."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    offline = constants.HF_HUB_OFFLINE
    try:
        return Path(snapshot_download(repo_id, allow_patterns=_FILES, local_files_only=not download))
    except LocalEntryNotFoundError:
        where = f"model_path {repo_id!r} is no directory here, and as a Hugging Face id it is not in the hub cache " \
                f"{constants.HF_HUB_CACHE}"
        if not download and not offline:  # check-config: serving downloads it
            raise EngineConfigError(f"{where} yet: `proctor serve` downloads it there (or `hf download {repo_id}` "
                                    "first)") from None
        why = "HF_HUB_OFFLINE=1" if offline else "the hub could not be reached"
        raise EngineConfigError(f"{where} ({why}): `hf download {repo_id}` first (or point model_path at a model "
                                "directory)") from None
    except (HfHubHTTPError, OSError) as exc:  # unknown or gated repository, no network, a full disk
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise EngineConfigError(f"model_path {repo_id!r}: the Hugging Face download failed: {first}") from None
