"""The Hugging Face Hub: the one place raylora tells a repo id from a path and downloads.

A model (``EngineConfig.model``) or an adapter (``LoRARequest.lora_path``) that is not an
existing file or folder is a Hub repo id, ``name`` or ``owner/name``, optionally
``@revision``. ``snapshot`` fetches the files a caller asks for (or finds them in the local
cache; ``HF_HUB_OFFLINE=1`` is honoured) and turns the Hub's errors into FileNotFoundError
saying what to do.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_WINDOWS_DRIVE = re.compile(r"^[A-Za-z]:[\\/]")


def split_revision(spec: str) -> tuple[str, str | None]:
    """``"owner/name@rev"`` -> ``("owner/name", "rev")``; no revision -> None."""
    repo_id, _, revision = spec.partition("@")
    return repo_id, revision or None


def looks_like_local_path(spec: str) -> bool:
    """True if ``spec`` (which does not exist on disk) cannot be a Hub repo id: then it was
    meant as a folder, and the caller says the folder does not exist instead of asking the
    Hub."""
    name = split_revision(spec)[0]
    return (
        spec.startswith(("/", ".", "~", "\\"))
        or "\\" in spec
        or bool(_WINDOWS_DRIVE.match(spec))
        or name.count("/") > 1
        or not _REPO_ID.match(name)
    )


def hub_offline() -> bool:
    """Whether downloads are off (``HF_HUB_OFFLINE``, as huggingface_hub read it at import,
    or as the environment says now)."""
    try:
        from huggingface_hub import constants

        if constants.HF_HUB_OFFLINE:
            return True
    except Exception:  # pragma: no cover - very old huggingface_hub
        pass
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def snapshot(
    spec: str, what: str, allow_patterns: list[str], ignore_patterns: list[str] | None = None
) -> Path:
    """The local snapshot of the repo ``spec`` names, holding the files ``allow_patterns``
    match. ``what`` names it in errors (``"model 'org/x'"``). Raises FileNotFoundError for a
    repo that is not there, not cached offline, gated, or a revision it lacks; other errors
    (the network, an invalid id) as huggingface_hub raises them."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo_id, revision = split_revision(spec)
    try:
        return Path(
            snapshot_download(
                repo_id,
                revision=revision,
                allow_patterns=allow_patterns,
                ignore_patterns=ignore_patterns,
            )
        )
    except LocalEntryNotFoundError as e:
        if hub_offline():
            raise FileNotFoundError(
                f"{what} is not a local folder and is not in the local Hugging Face cache, "
                f"and HF_HUB_OFFLINE is set, so it cannot be downloaded. Download it first "
                f"(e.g. `hf download {repo_id}`) or pass a local folder."
            ) from e
        raise FileNotFoundError(
            f"{what} is not a local folder and could not be downloaded from the Hugging "
            f"Face Hub (no connection?) nor found in the local cache: {e}"
        ) from e
    except GatedRepoError as e:
        raise FileNotFoundError(
            f"Hugging Face repo {repo_id!r} is gated; log in with access (HF_TOKEN): {e}"
        ) from e
    except RepositoryNotFoundError as e:
        raise FileNotFoundError(
            f"{what} is neither a local folder nor a Hugging Face Hub repo "
            f"(or it is private and no token was given)"
        ) from e
    except RevisionNotFoundError as e:
        raise FileNotFoundError(f"revision {revision!r} of {repo_id!r} does not exist") from e
