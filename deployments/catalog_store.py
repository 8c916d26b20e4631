"""Durable record of the AdapterRegistry's catalog: where it lives and how it is written.

The record is one JSON object, small (a few hundred bytes per adapter), rewritten whole on
every catalog change:

    {
      "format": 1,
      "version": 7,                                  # catalog changes ever made to it
      "adapters": {name: spec},                      # spec: source, rank, target_modules,
                                                     #       base_model (the registry's spec)
      "tombstones": {name: {"source": str,           # the source it had when unloaded
                            "unloaded_at": float}},  # unix time
    }

Two stores implement `CatalogStore` (`load() -> dict | None`, `save(record) -> None`):

- `GcsKVStore` (the default): Ray's GCS internal KV, key "catalog/<registry name>" in the
  "raylora" namespace. It outlives the registry actor's restarts and is reachable from any
  node the actor restarts on; with GCS fault tolerance (an external Redis, as KubeRay offers)
  it also outlives a head-node restart. It goes with the Ray cluster: tearing the cluster
  down (stopping `serve run`) forgets runtime-loaded adapters, as restarting vLLM does.
- `FileStore(path)`: a JSON file, for a catalog that outlives the Ray cluster on one machine.
  Written atomically: a temp file in the same folder, fsync, os.replace, fsync of the folder,
  so a crash at any point leaves either the old record or the new one, never a mix.

A record that exists but cannot be read or parsed raises `CatalogStoreError` naming where it
is; the registry does not start. Starting empty would lose every load (adapters vanish from
/v1/models) and the tombstones with them (a replica's next report would bring back what was
unloaded); falling back to a previous copy would silently undo the last changes. Since the
writes are atomic, such a record means outside damage or a hand edit, which an operator
should see and fix (repair or delete the file, or the KV key). A missing record is a first
start: `load()` returns None.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Protocol

RECORD_FORMAT = 1
KV_NAMESPACE = "raylora"


class CatalogStoreError(RuntimeError):
    """A durable record exists but cannot be read, or is not a catalog record."""


class CatalogStore(Protocol):
    def load(self) -> dict[str, Any] | None:
        """The last saved record; None if none was ever saved. Raises CatalogStoreError."""
        ...

    def save(self, record: dict[str, Any]) -> None:
        """Replace the record; returns only once it is durable. Failures raise."""
        ...


def empty_record() -> dict[str, Any]:
    return {"format": RECORD_FORMAT, "version": 0, "adapters": {}, "tombstones": {}}


def encode_record(record: dict[str, Any]) -> bytes:
    return json.dumps(record, sort_keys=True, indent=1).encode()


def decode_record(data: bytes, where: str) -> dict[str, Any]:
    """Parse and check a stored record; raise CatalogStoreError naming `where` if it is bad."""
    try:
        record = json.loads(data)
    except (UnicodeDecodeError, ValueError) as e:
        raise CatalogStoreError(f"catalog record {where} is not valid JSON: {e}") from e
    problem = _record_problem(record)
    if problem:
        raise CatalogStoreError(f"catalog record {where} is not a catalog record: {problem}")
    return record


def _record_problem(record: Any) -> str | None:
    if not isinstance(record, dict):
        return f"expected an object, got {type(record).__name__}"
    if record.get("format") != RECORD_FORMAT:
        return f"format {record.get('format')!r}, expected {RECORD_FORMAT}"
    if not isinstance(record.get("version"), int):
        return "no integer 'version'"
    for field in ("adapters", "tombstones"):
        entries = record.get(field)
        if not isinstance(entries, dict) or not all(isinstance(v, dict) for v in entries.values()):
            return f"'{field}' is not an object of objects"
    return None


class GcsKVStore:
    """The record in Ray's GCS internal KV; usable only inside a connected Ray process."""

    def __init__(self, registry_name: str, namespace: str = KV_NAMESPACE) -> None:
        self.key = f"catalog/{registry_name}"
        self.namespace = namespace

    def _kv(self):
        from ray.experimental import internal_kv

        if not internal_kv._internal_kv_initialized():
            raise CatalogStoreError("GcsKVStore needs a connected Ray process (ray.init)")
        return internal_kv

    def load(self) -> dict[str, Any] | None:
        data = self._kv()._internal_kv_get(self.key, namespace=self.namespace)
        if data is None:
            return None
        return decode_record(data, f"GCS KV {self.namespace}/{self.key}")

    def save(self, record: dict[str, Any]) -> None:
        self._kv()._internal_kv_put(
            self.key, encode_record(record), overwrite=True, namespace=self.namespace
        )

    def __repr__(self) -> str:
        return f"GcsKVStore({self.namespace}/{self.key})"


class FileStore:
    """The record in a JSON file at `path` (parent folders are created on the first save)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    def load(self) -> dict[str, Any] | None:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise CatalogStoreError(f"catalog record {self.path} cannot be read: {e}") from e
        return decode_record(data, str(self.path))

    def save(self, record: dict[str, Any]) -> None:
        folder = self.path.parent
        folder.mkdir(parents=True, exist_ok=True)
        # Same folder as the record: os.replace is atomic only within one file system.
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{self.path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(encode_record(record))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        _fsync_dir(folder)  # the rename itself survives a power loss

    def __repr__(self) -> str:
        return f"FileStore({str(self.path)!r})"


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
