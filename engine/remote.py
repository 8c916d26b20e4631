"""Object storage: the one place raylora reads an adapter folder from a URL.

An adapter's ``lora_path`` (or a serve app's ``dynamic_lora_loading_path``) may be a URL of
any file system fsspec knows: ``s3://bucket/loras/sql`` (with ``s3fs`` installed),
``gs://`` (``gcsfs``), ``az://`` / ``abfs://`` (``adlfs``), as Ray Serve LLM and LoRAX take
them. ``fetch_folder`` copies the files a caller asks for into the local cache,

    <cache>/remote/<hash of the URL>-<hash of what the store says of each file>/

once per version: the second hash holds each file's size and its ETag or modification time
as the store lists them, so a folder overwritten in the bucket is fetched again and an
unchanged one is read from the local copy. A new copy removes the URL's other copies that no
read has used for PRUNE_AFTER_S (a copy's mtime is its last use; a read that old is over), so
the cache holds about one copy per folder, not one per version ever fetched. Credentials and
endpoints are the file system's own (for S3, boto's: ``AWS_ACCESS_KEY_ID``,
``AWS_ENDPOINT_URL``, an instance role...). Errors are FileNotFoundError naming the URL and
what to do; the callers turn them into "adapter not found" (a 404), as they do the Hub's.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from engine import paths

_URL = re.compile(r"^([a-z][a-z0-9+.-]*)://")
PRUNE_AFTER_S = 600.0  # a copy unused this long is removed when its folder's next version lands

# the package that gives fsspec each common protocol: named in the error when it is missing
PROTOCOL_PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs"}
PROTOCOL_PACKAGES |= {"abfs": "adlfs", "abfss": "adlfs"}


def is_url(spec: object) -> bool:
    """True for ``scheme://...`` (a Hub repo id or a local path never has one)."""
    return isinstance(spec, str) and bool(_URL.match(spec))


def join(base: str, name: str) -> str:
    """``base`` (a URL or a local folder) and one more path component."""
    return f"{base.rstrip('/')}/{name}" if is_url(base) else os.path.join(base, name)


def _filesystem(url: str) -> tuple[Any, str]:
    protocol = _URL.match(url).group(1)  # type: ignore[union-attr]  # is_url checked
    try:
        import fsspec

        return fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as e:  # fsspec raises ValueError for unknown protocols
        package = PROTOCOL_PACKAGES.get(protocol)
        hint = f" (pip install {package})" if package else ""
        raise FileNotFoundError(
            f"cannot read {url!r}: no file system for {protocol}://{hint}: {e}"
        ) from e


def _version(entry: dict[str, Any]) -> str:
    """What the store says changes when the file does (ETag, generation, modification time),
    and its size, as S3 (s3fs), GCS (gcsfs) and Azure (adlfs) list them."""
    keys = ("ETag", "etag", "md5Hash", "generation", "LastModified", "last_modified", "updated")
    keys += ("mtime", "size")
    return json.dumps({k: str(entry[k]) for k in keys if k in entry}, sort_keys=True)


def _versions(fs: Any, root: str, url: str, wanted: list[str], what: str) -> dict[str, str]:
    """file -> its version, for the files of `wanted` in the folder."""
    try:
        fs.invalidate_cache(root)  # a listing cached by an earlier read would hide new versions
        listing = {Path(e["name"]).name: e for e in fs.ls(root, detail=True)}
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{what}: {url!r} does not exist") from e
    except Exception as e:  # credentials, the network, a bucket that is not there
        raise FileNotFoundError(f"{what}: cannot list {url!r}: {type(e).__name__}: {e}") from e
    return {
        f: _version(listing[f])
        for f in wanted
        if f in listing and listing[f].get("type") != "directory"
    }


def fetch_folder(url: str, wanted: list[str], required: str, what: str) -> Path:
    """A local copy of the files named in ``wanted`` (those present) of the folder at ``url``.

    ``required`` must be among them, else FileNotFoundError; ``what`` names the folder in
    errors. Copies are made in a temporary folder and renamed into place, so concurrent
    fetches of one version (two replicas on a node, two threads) leave one whole copy; a
    folder whose files changed while they were copied is copied again (up to 3 times)."""
    match = _URL.match(url)
    if match is None or not url[match.end() :].strip("/"):
        raise FileNotFoundError(f"{what}: {url!r} names no folder")
    url = url.rstrip("/")  # one folder, one key, with or without the slash
    fs, root = _filesystem(url)
    root = root.rstrip("/")
    for _ in range(3):
        versions = _versions(fs, root, url, wanted, what)
        if required not in versions:
            raise FileNotFoundError(f"{what}: {url!r} has no {required}")
        version = json.dumps([url, sorted(versions.items())])
        dest = paths.remote_dir() / f"{_hash(url)}-{_hash(version)}"
        if dest.is_dir():
            _touch(dest)
            return dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
        try:
            for f in versions:
                fs.get_file(f"{root}/{f}", str(tmp / f))
            if _versions(fs, root, url, wanted, what) != versions:
                continue  # written meanwhile: the copy may mix two versions
            os.replace(tmp, dest)  # atomic; fails if another fetch got there first
            _touch(dest)
            _prune_older(url, dest)
            return dest
        except FileNotFoundError:
            raise
        except Exception as e:
            if not dest.is_dir():
                msg = f"{what}: reading {url!r} failed: {type(e).__name__}: {e}"
                raise FileNotFoundError(msg) from e
            return dest
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    raise FileNotFoundError(f"{what}: {url!r} kept changing while it was read; try again")


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _touch(copy: Path) -> None:
    """Mark `copy` used now (_prune_older keeps copies used lately)."""
    try:
        os.utime(copy)
    except OSError:  # pruned meanwhile by another process: the read will say so
        pass


def _prune_older(url: str, keep: Path) -> None:
    """Remove the other copies of `url`'s folder unused for PRUNE_AFTER_S."""
    now = time.time()
    for old in keep.parent.glob(f"{_hash(url)}-*"):
        try:
            if old != keep and now - old.stat().st_mtime > PRUNE_AFTER_S:
                shutil.rmtree(old)
        except OSError:  # another process pruned or is pruning it
            pass
