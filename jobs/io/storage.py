"""Where data lives: a local path or a URI (s3://, gs://, hdfs://, file://), resolved to a pyarrow
filesystem and a path on it. No hand-written clients: everything goes through `pyarrow.fs`.

Store options come from the `storage.*` config section or the store's standard environment variables
(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_ENDPOINT_URL / AWS_REGION, GOOGLE_APPLICATION_CREDENTIALS).
Credentials are never taken from the config, so they never land in `_job.json` or `_summary.json`.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pyarrow.fs as pafs

_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


@dataclass
class StorageConfig:
    endpoint: str = ""  # S3-compatible endpoint, e.g. http://127.0.0.1:9000 ("" = AWS_ENDPOINT_URL or AWS)
    region: str = ""  # "" = AWS_REGION / AWS_DEFAULT_REGION, else the store's default
    anonymous: bool = False  # public buckets: no credentials


class StorageError(ValueError):
    """A path or URI cannot be resolved; one-line message."""


def is_uri(path: str) -> bool:
    """True for `scheme://...` (file:// included); False for local paths."""
    return bool(_URI.match(path))


def normalize(path: str) -> str:
    """The canonical spelling of a location: URIs unchanged, local paths absolute and resolved, so that
    `data/x.jsonl` and `/abs/.../data/x.jsonl` are the same input."""
    if not path or is_uri(path):
        return path
    return str(Path(path).expanduser().resolve())


def looks_local(path: str) -> bool:
    """A path the user means as a local file or directory (not a hub id such as `org/name`, not a URI,
    not a built-in name): absolute, `./`, `../`, `~`, more than one `/`, a file extension, or existing."""
    if not path or is_uri(path):
        return False
    if path.startswith(("/", "./", "../", "~")) or path in (".", "..") or path.count("/") > 1:
        return True
    return Path(path).exists() or path.lower().endswith(_FILE_EXTENSIONS)


_FILE_EXTENSIONS = (".parquet", ".pq", ".jsonl", ".ndjson", ".json", ".csv", ".txt", ".arrow", ".yaml", ".gz", ".zst")


def resolve(path: str, cfg: Optional[Any] = None) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path on it) for a local path or URI; `cfg` is a StorageConfig-like object or None."""
    if not is_uri(path):
        return pafs.LocalFileSystem(), normalize(path)
    scheme = path.split("://", 1)[0].lower()
    try:
        if scheme in ("s3", "s3a"):
            endpoint = (cfg.endpoint if cfg is not None else "") or os.environ.get("AWS_ENDPOINT_URL", "")
            region = (cfg.region if cfg is not None else "") or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
            opts: dict[str, Any] = {"anonymous": bool(cfg is not None and cfg.anonymous)}
            if endpoint:
                opts["endpoint_override"] = endpoint
                if endpoint.startswith("http://"):
                    opts["scheme"] = "http"
            if region:
                opts["region"] = region
            rest = path.split("://", 1)[1]
            return pafs.S3FileSystem(**opts), rest.rstrip("/")
        fs, p = pafs.FileSystem.from_uri(path)
        return fs, p.rstrip("/") or "/"
    except (ValueError, OSError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise StorageError(f"cannot open {path!r}: {str(exc).strip().splitlines()[0]}") from None


def join(base: str, *names: str) -> str:
    """`base/name/...` on a filesystem path (forward slashes, as pyarrow.fs uses everywhere)."""
    return "/".join([base.rstrip("/"), *names])
