"""Opening a shard or file by name: local files and `pipe:` commands with webdataset's `gopen`,
every other URL (`s3://`, `gs://`, `az://`, `https://`, ...) with fsspec, so object stores are read
natively with their usual credentials, no shell involved."""

from __future__ import annotations

import pyarrow.parquet as pq
import webdataset as wds

from pairclean.ops.extras import PROTOCOL_EXTRAS, optional
from pairclean.errors import UserError
from pairclean.ops.urls import is_local, not_regular


def open_input(url: str):
    """A readable binary stream of a shard or file: webdataset's `gopen` for local paths and
    `pipe:` commands, fsspec for any other URL (credentials and endpoints from the
    filesystem's usual environment, e.g. AWS_* variables for s3fs)."""
    if is_local(url) or url.startswith("pipe:"):
        return wds.gopen(url)
    import fsspec

    return fsspec.open(url, "rb").open()


def check_protocols(urls: list[str]) -> None:
    """Every URL scheme is one fsspec can read here, else a UserError before anything is written
    (a missing s3fs would otherwise fail every shard of the run one by one)."""
    import fsspec

    for protocol in sorted({url.split("://", 1)[0] for url in urls if not is_local(url) and "://" in url}):
        if protocol in PROTOCOL_EXTRAS:
            optional(*PROTOCOL_EXTRAS[protocol])
        try:
            fsspec.get_filesystem_class(protocol)
        except (ImportError, ValueError) as exc:
            raise UserError(f"cannot read {protocol}:// shards: {str(exc).splitlines()[0]} "
                            "(pip install 'pairclean[s3]' or 'pairclean[gcs]' for s3:// and gs://)") from None


def parquet_file(path: str) -> pq.ParquetFile:
    if is_local(path) and (kind := not_regular(path)):
        raise UserError(f"{path} is not a regular file ({kind})")
    return pq.ParquetFile(path if is_local(path) else open_input(path))
