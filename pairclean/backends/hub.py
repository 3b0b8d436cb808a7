"""Whether model weights named by a tag can come from the Hugging Face Hub, asked before a download.

open_clip fetches a pretrained tag's weights through huggingface_hub, which retries an unreachable
hub with back-off (1 + 2 + 4 + 8 + 8 s per file, two files: about a minute) before it looks in its
cache. So before that: the weights already in the cache are used as they are; otherwise, when
HF_HUB_OFFLINE is set or the hub's host does not answer within seconds, the run stops at once with
the ways forward instead of after the retries.
"""

from __future__ import annotations

import socket
import urllib.request
from urllib.parse import urlparse

from pairclean.errors import ConfigError
from pairclean.ops.notices import notice

PROBE_SECONDS = 3.0  # one TCP connect to the hub's host, no retry


def hub_cache() -> str:
    """The directory huggingface_hub keeps downloads in (HF_HUB_CACHE, else under HF_HOME)."""
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def cached_file(repo_id: str, filenames: list[str]) -> str | None:
    """The first of `filenames` of the repo that huggingface_hub has in its cache, without the network."""
    from huggingface_hub import hf_hub_download

    for filename in filenames:
        try:
            return hf_hub_download(repo_id, filename, local_files_only=True)
        except Exception:  # LocalEntryNotFoundError, or a cache entry that cannot be read
            continue
    return None


def hub_unreachable() -> str | None:
    """Why the hub cannot be used now (HF_HUB_OFFLINE set, its host unknown or not answering within
    PROBE_SECONDS), or None when it answers or cannot be probed quickly (through a proxy)."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    endpoint = urlparse(constants.ENDPOINT)
    host = endpoint.hostname or constants.ENDPOINT
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    if urllib.request.getproxies() and not urllib.request.proxy_bypass(host):
        return None  # the proxy decides: let the download try
    try:
        socket.create_connection((host, port), timeout=PROBE_SECONDS).close()
    except OSError as exc:
        reason = exc.strerror or (f"no answer within {PROBE_SECONDS:g} s" if isinstance(exc, TimeoutError)
                                  else type(exc).__name__)
        return f"{host} cannot be reached ({reason})"
    return None


def check_fetchable(model: str, tag: str, repo_id: str, filenames: list[str]) -> None:
    """Refuse at once, with the ways forward, weights that are neither in the cache nor reachable;
    say so when cached weights will be found only after the downloader's retries."""
    from huggingface_hub import constants

    why = hub_unreachable()
    if why is None:
        return
    if cached_file(repo_id, filenames) is not None:
        if not constants.HF_HUB_OFFLINE:
            notice(f"{why}: the weights {tag!r} of {model} come from the Hugging Face cache, after the downloader's "
                   "retries (about half a minute; HF_HUB_OFFLINE=1 skips them)")
        return
    cache = hub_cache()
    raise ConfigError(f"cannot fetch the weights {tag!r} of {model}: {why}, and they are not in the Hugging Face cache "
                      f"({cache}). Give `pretrained` a local checkpoint file, or `pretrained` none for random "
                      f"weights, or fetch them once where the hub can be reached and copy that cache to {cache} "
                      "(HF_HUB_OFFLINE=1 then skips the network)", "pretrained")
