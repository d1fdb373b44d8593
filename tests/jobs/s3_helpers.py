"""A real S3-compatible server for tests: moto in server mode on 127.0.0.1, reached only through pyarrow's
own S3 client (jobs/io/storage.py). Import the fixture into a test module: `from s3_helpers import s3  # noqa`.

The fixture sets fake credentials and the endpoint in the standard AWS_* environment variables (so a
subprocess such as `esp-batch` finds the store too) and restores them afterwards.
"""
from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from typing import Iterator

import pytest

from jobs_helpers import free_port

FAKE_KEY_ID = "AKIAESPBATCHTEST0000"
FAKE_SECRET = "esp-batch-fake-secret-key-never-written"  # tests check no written file contains it
ENV = {
    "AWS_ACCESS_KEY_ID": FAKE_KEY_ID,
    "AWS_SECRET_ACCESS_KEY": FAKE_SECRET,
    "AWS_REGION": "us-east-1",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",  # no instance-metadata lookups (slow timeouts off EC2)
}


@dataclass
class S3Store:
    endpoint: str  # http://127.0.0.1:PORT
    bucket: str
    fs: object  # pyarrow.fs.S3FileSystem on the server

    def uri(self, *names: str) -> str:
        return "/".join([f"s3://{self.bucket}", *names])

    def path(self, *names: str) -> str:
        """The same location as a path on `fs` (bucket/key)."""
        return "/".join([self.bucket, *names])

    def put(self, key: str, data: bytes) -> None:
        with self.fs.open_output_stream(self.path(key)) as f:
            f.write(data)

    def storage(self):  # the `storage.*` config section pointing at this server
        from jobs.io.storage import StorageConfig

        return StorageConfig(endpoint=self.endpoint, region=ENV["AWS_REGION"])


def start_server() -> tuple[object, str]:
    """(ThreadedMotoServer, endpoint URL) on 127.0.0.1 and a free port."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    return server, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Store]:
    """A running moto server, the AWS_* variables pointing at it, and a fresh bucket."""
    pytest.importorskip("moto.server", reason="moto[server] is not installed (pip install -e '.[test]')")
    import pyarrow.fs as pafs

    server, endpoint = start_server()
    saved = {k: os.environ.get(k) for k in [*ENV, "AWS_ENDPOINT_URL"]}
    os.environ.update({**ENV, "AWS_ENDPOINT_URL": endpoint})
    try:
        fs = pafs.S3FileSystem(endpoint_override=endpoint, scheme="http", region=ENV["AWS_REGION"],
                               access_key=FAKE_KEY_ID, secret_key=FAKE_SECRET, allow_bucket_creation=True)
        bucket = f"esp-batch-{uuid.uuid4().hex[:8]}"
        fs.create_dir(bucket)
        yield S3Store(endpoint=endpoint, bucket=bucket, fs=fs)
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
