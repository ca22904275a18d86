"""Where a server answers and how to reach it: the endpoint (URL, model name, API key variable) and one HTTP client
factory for every caller (the generate stage's async client, extraction and evaluation requests).

The API key of a remote endpoint is read from an environment variable when a request is built and never stored in a
field, a manifest or a log.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import httpx

from eagle3lib.config.verifier import VerifierConfig


class ServerError(RuntimeError):
    """A server did not start, cannot be reached, or answered something unusable; the message names the URL."""


@dataclass
class Endpoint:
    base_url: str  # e.g. http://127.0.0.1:8000 (no /v1)
    model: str  # the name requests must carry
    api_key_env: str | None = None  # env var NAME; the value is read when needed and never kept in a field

    def headers(self) -> dict[str, str]:
        if self.api_key_env:
            key = os.environ.get(self.api_key_env)
            if not key:
                raise ServerError(f"environment variable {self.api_key_env} (verifier.api_key_env) is not set")
            return {"Authorization": f"Bearer {key}"}
        return {}

    def info(self) -> dict[str, Any]:
        """Server facts for manifests: model name and vLLM version (no secrets)."""
        out: dict[str, Any] = {"base_url": self.base_url, "model": self.model}
        try:
            r = httpx.get(f"{self.base_url}/version", headers=self.headers(), timeout=10)
            if r.status_code == 200:
                out["server_version"] = r.json().get("version")
        except httpx.HTTPError:
            pass
        return out


def http_client(endpoint: Endpoint, concurrency: int, request_timeout_s: float, connect_timeout_s: float = 10.0,
                asynchronous: bool = False) -> httpx.Client | httpx.AsyncClient:
    """A client for `concurrency` requests in flight against `endpoint`.

    Timeouts per phase: a short connect timeout (an unreachable server fails fast) and a read timeout of hours
    (reasoning models think for minutes; a client library's 60 s default broke a real run). The pool is sized to the
    concurrency (httpx's default of 100 would silently cap it), and keep-alive is shorter than uvicorn's 5 s, so a
    pooled connection is not reused just as the server closes it.
    """
    cls = httpx.AsyncClient if asynchronous else httpx.Client
    return cls(
        base_url=endpoint.base_url,
        headers=endpoint.headers(),  # the API key lives in this in-memory client only
        timeout=httpx.Timeout(connect=connect_timeout_s, read=request_timeout_s, write=request_timeout_s, pool=None),
        limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency, keepalive_expiry=3.0),
    )


def _models(url: str, headers: dict[str, str], connect_timeout_s: float) -> list[str]:
    try:
        r = httpx.get(f"{url}/v1/models", headers=headers, timeout=httpx.Timeout(60.0, connect=connect_timeout_s))
    except httpx.HTTPError as e:
        raise ServerError(f"cannot reach the verifier server at {url} (connect timeout {connect_timeout_s:g} s): "
                          f"{type(e).__name__}: {e}") from e
    if r.status_code != 200:
        raise ServerError(f"{url}/v1/models answered HTTP {r.status_code} ({_gist(r)}): is it a vLLM (OpenAI API) server?")
    try:
        return [m["id"] for m in r.json()["data"]]
    except (ValueError, KeyError, TypeError):
        raise ServerError(f"{url}/v1/models: not an OpenAI model list ({_gist(r)}): is it a vLLM (OpenAI API) "
                          "server?") from None


def _gist(r: httpx.Response) -> str:
    """What answered, in one short line: an HTML page's text without its markup, not the page."""
    kind = r.headers.get("content-type", "no content type").split(";")[0]
    text = " ".join(re.sub(r"<(script|style)[^>]*>.*?</\1>|<[^>]+>", " ", r.text[:4000], flags=re.S | re.I).split())
    return f"{kind}: {text[:120]!r}" if text else kind


def connect_endpoint(url: str, *, model: str | None = None, api_key_env: str | None = None,
                     connect_timeout_s: float = 10.0) -> Endpoint:
    """An Endpoint for a running server, checked now: unreachable fails within the connect timeout.

    `url` may end in /v1. The model name is `model`, else the server's first model.
    """
    url = url.rstrip("/")
    url = url[: -len("/v1")] if url.endswith("/v1") else url
    endpoint = Endpoint(url, model or "", api_key_env)
    served = _models(url, endpoint.headers(), connect_timeout_s)
    if not endpoint.model:
        if not served:
            raise ServerError(f"{url}/v1/models lists no model")
        endpoint.model = served[0]
    return endpoint


def verifier_endpoint(verifier_cfg: VerifierConfig, connect_timeout_s: float, base_url: str | None = None) -> Endpoint:
    """The profile's running verifier server (`base_url`, else the first of `verifier.server_url`), with its API key
    variable."""
    try:
        return connect_endpoint(base_url or verifier_cfg.server_urls[0], model=verifier_cfg.served_model_name,
                                api_key_env=verifier_cfg.api_key_env, connect_timeout_s=connect_timeout_s)
    except ServerError as e:
        if base_url:
            raise
        raise ServerError(f"verifier.server_url: {e}") from None
