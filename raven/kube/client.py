"""The Kubernetes client layer: an API client from a kubeconfig or the service account, JSON calls with a
deadline, and the API's error statuses as :class:`KubeApiError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client import ApiClient

from raven.errors import KubeError

MANAGED_BY = {"app.kubernetes.io/managed-by": "raven"}
MAX_BACKOFF = 30.0


class KubeApiError(KubeError):
    """The API server answered with an error status (the Status object's code, reason and message)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}" if message else f"{status} {reason}")
        self.status = status
        self.reason = reason
        self.message = message


# ---------------------------------------------------------------------------------------------------------------
# client


async def api_client(kubeconfig: Path | None, timeout: float = 30.0) -> ApiClient:
    """An ApiClient (the caller closes it): in-cluster service account when ``kubeconfig`` is None, else that file.

    The configuration is private to this client (the library's process-wide default is left alone), and a kubeconfig
    is never written back (``persist_config=False``).
    """
    cfg = client.Configuration()
    load_incluster: Callable[..., None] = config.load_incluster_config  # untyped in the library
    try:
        if kubeconfig is None:
            load_incluster(client_configuration=cfg)
        else:
            # the library would only say "Expected key current-context" for a missing file
            if not await asyncio.to_thread(kubeconfig.is_file):
                raise KubeError(f"kubeconfig {kubeconfig}: no such file")
            # An exec credential plugin runs here, with no deadline of the library's own.
            async with asyncio.timeout(timeout):
                await config.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg,
                                              persist_config=False)
    except KubeError:
        raise
    except TimeoutError:
        raise KubeError(
            f"loading kubeconfig {kubeconfig} took over {timeout:g}s (a credential plugin that hangs?)"
        ) from None
    except Exception as exc:
        where = f"kubeconfig {kubeconfig}" if kubeconfig is not None else "in-cluster configuration"
        hint = "" if kubeconfig is not None else " (not running in a pod? pass a kubeconfig)"
        raise KubeError(f"cannot load {where}{hint}: {type(exc).__name__}: {exc}") from exc
    api: ApiClient = ApiClient(configuration=cfg)
    return api


def status_error(status: int, reason: str, text: str) -> KubeApiError:
    """Turn an error response into KubeApiError, using the Status object's reason and message when there is one."""
    message = text.strip()[:500]
    with contextlib.suppress(ValueError):
        body = json.loads(text)
        if isinstance(body, dict) and body.get("kind") == "Status":
            reason = str(body.get("reason") or reason)
            message = str(body.get("message") or "")
    return KubeApiError(status, reason, message)


async def check_status(resp: aiohttp.ClientResponse) -> None:
    if not 200 <= resp.status < 300:
        raise status_error(resp.status, resp.reason or "", await resp.text())


async def call_json(
    func: Callable[..., Awaitable[Any]], *args: Any, timeout: float, **kwargs: Any
) -> dict[str, Any]:
    """Call an API method without the library's models and return the JSON body; KubeApiError on error statuses.

    ``timeout`` bounds the whole call, a credential refresh (exec plugin) included, not just the HTTP request.
    """
    async with asyncio.timeout(timeout):
        resp: aiohttp.ClientResponse = await func(*args, _preload_content=False, _request_timeout=timeout, **kwargs)
        try:
            await check_status(resp)
            text = await resp.text()
        finally:
            resp.release()
    try:
        body = json.loads(text)
    except ValueError as exc:
        raise KubeError(f"API server sent a body that is not JSON: {text[:200]!r}") from exc
    if not isinstance(body, dict):
        raise KubeError(f"API server sent JSON that is not an object: {text[:200]!r}")
    return body


def describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__
