"""Where raylora keeps what it fetches or builds: one root, ``$RAYLORA_CACHE`` or
``~/.cache/raylora``, read at each call (a test or a user may set it late). Torch-free.

    <root>/models/<name>   converted models (the default SmolLM2-135M-Instruct)
    <root>/wheels          the wheel the default model comes from
    <root>/adapters        the demo adapters
    <root>/remote/<key>    adapter folders copied from object storage (engine/remote.py)
    <root>/<benchmark>     a benchmark's generated adapters (bench-routing, soak-adapters)
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_CACHE = "RAYLORA_CACHE"


def cache_dir() -> Path:
    """The raylora cache root: ``$RAYLORA_CACHE`` or ``~/.cache/raylora``."""
    root = os.environ.get(ENV_CACHE)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "raylora"


def adapters_dir() -> Path:
    """The demo adapters' folder."""
    return cache_dir() / "adapters"


def remote_dir() -> Path:
    """Local copies of adapter folders read from object storage, one per version."""
    return cache_dir() / "remote"
