"""The SDK clients (``openai``, ``anthropic``) the tests drive the proxy with, closed when the test ends.

An SDK client holds a pool of connections. Left to the garbage collector, its open sockets raise
``ResourceWarning`` wherever the collector happens to run; warnings are errors here, so that failed
some later, unrelated test. Every client made here is closed by the root conftest's
``close_sdk_clients`` fixture at the end of the test that made it.
"""

from __future__ import annotations

from typing import Any

_open: list[Any] = []


def openai_client(base_url: str, **options: Any) -> Any:
    """``openai.OpenAI`` at ``base_url`` (``.../v1``), without retries, closed at the end of the test."""
    import openai

    return _kept(openai.OpenAI(base_url=base_url, **{"api_key": "sk-test", "max_retries": 0, **options}))


def anthropic_client(base_url: str, **options: Any) -> Any:
    """``anthropic.Anthropic`` at ``base_url``, without retries, closed at the end of the test."""
    import anthropic

    return _kept(anthropic.Anthropic(base_url=base_url, **{"api_key": "sk-test", "max_retries": 0, **options}))


def close_all() -> None:
    while _open:
        _open.pop().close()


def _kept(client: Any) -> Any:
    _open.append(client)
    return client
