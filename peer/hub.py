"""Is the Hugging Face Hub there? Asked once before a tokenizer or dataset is fetched by name.

Offline (no network, a firewall, a mistyped local path read as a hub name), huggingface_hub retried every
request with back-off: ~45 s of doubled retry warnings before one useful error. One short TCP connect tells
instead, and the caller fails in one line that says what to do.
"""
from __future__ import annotations

import os
import socket
from urllib.parse import urlparse

_TRUE = {"1", "true", "yes", "on"}


def offline_mode() -> bool:
    """The user asked for cached files only (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE / TRANSFORMERS_OFFLINE)."""
    return any(os.environ.get(name, "").strip().lower() in _TRUE
               for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hub_unreachable(timeout: float = 3.0) -> str | None:
    """Why the hub cannot be reached now (a short phrase), or None if it answers a TCP connect."""
    from huggingface_hub import constants
    endpoint = urlparse(constants.ENDPOINT)
    host = endpoint.hostname or "huggingface.co"
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return None
    except OSError as e:
        return f"{host} cannot be reached ({e.strerror or type(e).__name__})"
