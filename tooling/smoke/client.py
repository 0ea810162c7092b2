"""The few HTTP calls the smoke makes to a vLLM server, with the standard library only."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from ..errors import SmokeError


@dataclass(frozen=True)
class Completion:
    """One greedy completion as the OpenAI-compatible API returned it."""

    text: str
    token_ids: tuple[int, ...] | None
    prompt_tokens: int
    cached_tokens: int | None
    """``usage.prompt_tokens_details.cached_tokens`` (needs --enable-prompt-tokens-details)."""
    finish_reason: str | None


def _request(url: str, data: bytes | None, timeout_s: float) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"} if data is not None else {}
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        body = e.read().decode("utf-8", "replace").strip()
        raise SmokeError(f"{url}: HTTP {e.code}: {body[:300]}") from None
    except (urllib.error.URLError, OSError) as e:
        raise SmokeError(f"{url}: {getattr(e, 'reason', e)}") from None


def get_text(url: str, timeout_s: float = 10.0) -> str:
    """GET ``url`` and return the body as text; SmokeError on any failure."""
    return _request(url, None, timeout_s)[1].decode("utf-8", "replace")


def is_healthy(base_url: str, timeout_s: float = 2.0) -> bool:
    """True when ``/health`` answers 200 (False while the server is still starting)."""
    try:
        status, _ = _request(f"{base_url}/health", None, timeout_s)
    except SmokeError:
        return False
    return status == 200


def post_json(url: str, payload: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """POST ``payload`` as JSON and return the decoded JSON answer."""
    _, body = _request(url, json.dumps(payload).encode(), timeout_s)
    try:
        return json.loads(body)
    except ValueError:
        raise SmokeError(f"{url}: answer is not JSON: {body[:200]!r}") from None


def parse_completion(data: dict[str, Any]) -> Completion:
    """The first choice of a /v1/completions answer."""
    try:
        choice = data["choices"][0]
        usage = data.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        token_ids = choice.get("token_ids")
        return Completion(
            text=choice.get("text") or "",
            token_ids=tuple(token_ids) if token_ids is not None else None,
            prompt_tokens=int(usage.get("prompt_tokens", 0)),
            cached_tokens=details.get("cached_tokens"),
            finish_reason=choice.get("finish_reason"),
        )
    except (KeyError, IndexError, TypeError) as e:
        raise SmokeError(f"unexpected /v1/completions answer ({e}): {str(data)[:200]}") from None


def complete(
    base_url: str,
    model: str,
    prompt: str | list[int],
    *,
    max_tokens: int,
    timeout_s: float,
    seed: int = 0,
) -> Completion:
    """A greedy completion of ``prompt`` (text or token ids) of exactly ``max_tokens`` tokens."""
    payload: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "seed": seed,
        # Fixed length: end-of-text from a random model must not cut a run short.
        "ignore_eos": True,
        # Compare token ids, not only text (two ids can decode alike).
        "return_token_ids": True,
    }
    return parse_completion(post_json(f"{base_url}/v1/completions", payload, timeout_s))


def tokenize(
    base_url: str, model: str, text: str, *, timeout_s: float, add_special_tokens: bool = False
) -> list[int]:
    """The server's own tokenization of ``text`` (``add_special_tokens``: as
    /v1/completions does for a text prompt)."""
    data = post_json(
        f"{base_url}/tokenize",
        {"model": model, "prompt": text, "add_special_tokens": add_special_tokens},
        timeout_s,
    )
    try:
        return [int(t) for t in data["tokens"]]
    except (KeyError, TypeError, ValueError):
        raise SmokeError(f"unexpected /tokenize answer: {str(data)[:200]}") from None
