"""Whether model files can come from the Hugging Face Hub, asked before a download.

open_clip fetches a pretrained tag's weights (and an `hf-hub:` model's config and weights), and
sentence-transformers a model's files, through huggingface_hub, which retries an unreachable hub
with back-off (1 + 2 + 4 + 8 + 8 s per file: a minute for open_clip's two, 83 s for a sentence
model's three) before it looks in its cache. So before that: files already in the cache are used as
they are; otherwise, when HF_HUB_OFFLINE is set or the hub's host does not answer within seconds,
the run stops at once with the ways forward instead of after the retries.
"""

from __future__ import annotations

import socket
import urllib.request
from contextlib import contextmanager
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


TAG_WAYS = "Give `pretrained` a local checkpoint file, or `pretrained` none for random weights"


def check_fetchable(what: str, repo_id: str, filenames: list[str], ways: str = TAG_WAYS,
                    field: str = "pretrained") -> None:
    """Refuse at once, with the ways forward, files (`what`: "the weights 'openai' of ViT-B-32";
    `filenames`: alternatives, the first cached one will do) that are neither in the cache nor
    reachable; say so when cached files will be found only after the downloader's retries."""
    from huggingface_hub import constants

    why = hub_unreachable()
    if why is None:
        return
    if cached_file(repo_id, filenames) is not None:
        if not constants.HF_HUB_OFFLINE:
            notice(f"{why}: {what} come from the Hugging Face cache, after the downloader's retries (about half "
                   "a minute; HF_HUB_OFFLINE=1 skips them)")
        return
    cache = hub_cache()
    raise ConfigError(f"cannot fetch {what}: {why}, and they are not in the Hugging Face cache ({cache}). {ways}, "
                      f"or fetch them once where the hub can be reached and copy that cache to {cache} "
                      "(HF_HUB_OFFLINE=1 then skips the network)", field)


@contextmanager
def quiet_progress_bars():
    """transformers' and huggingface_hub's own tqdm bars ("Loading weights", "Writing model shards",
    downloads) off while a model is loaded or saved, so they are not drawn into pairclean's progress
    display; each library's setting is restored afterwards."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    try:
        from transformers.utils import logging as transformers_logging
    except ImportError:  # huggingface_hub alone
        transformers_logging = None
    hub_was_off = are_progress_bars_disabled()
    transformers_was_on = transformers_logging is not None and transformers_logging.is_progress_bar_enabled()
    if transformers_logging is not None:
        transformers_logging.disable_progress_bar()  # also huggingface_hub's
    disable_progress_bars()
    try:
        yield
    finally:
        if transformers_was_on:
            transformers_logging.enable_progress_bar()  # turns huggingface_hub's on too: set it back below
        (disable_progress_bars if hub_was_off else enable_progress_bars)()
