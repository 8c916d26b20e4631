"""An S3 bucket on loopback for tests: moto's S3 server (HTTP, as AWS speaks it) in a thread,
reached through s3fs with the endpoint in AWS_ENDPOINT_URL (as a user points boto at MinIO),
so Ray workers started meanwhile inherit it."""

from __future__ import annotations

import os
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.serve_fixtures import free_port

BUCKET = "loras"


@contextmanager
def moto_s3() -> Iterator[Any]:
    """An s3fs file system on a fresh moto server holding an empty bucket `loras`; the AWS
    environment is set while it runs and restored after."""
    import s3fs
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    # moto's state is the process's, shared by every server it starts: begin empty
    reset = urllib.request.Request(f"http://127.0.0.1:{port}/moto-api/reset", method="POST")
    urllib.request.urlopen(reset, timeout=30).close()
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        fs = s3fs.S3FileSystem()
        fs.mkdir(BUCKET)
        yield fs
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        s3fs.S3FileSystem.clear_instance_cache()
        server.stop()


def upload(fs: Any, folder: Path, key: str) -> str:
    """Copy `folder`'s files to s3://loras/<key>/; return that URL."""
    for f in os.listdir(folder):
        fs.put_file(str(folder / f), f"{BUCKET}/{key}/{f}")
    return f"s3://{BUCKET}/{key}"
