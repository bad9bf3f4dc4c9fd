"""Relaying a request the proxy does not change: method, path and query, body and end-to-end headers
to the upstream; status, headers and body, as they come, back (every path the proxy does not handle,
and a request passed through uncompacted)."""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from ctxfold.serve.request import error_response, relayed_headers
from ctxfold.serve.upstream import UpstreamClient, UpstreamError


async def relay_body(request: web.Request, upstream: UpstreamClient, target: str, body: bytes,
                     headers: list[tuple[str, str]], failure: Callable[[BaseException], web.Response]
                     ) -> web.StreamResponse:
    """``body`` to ``target`` on the upstream's origin with ``headers``, the answer back as it comes.
    ``failure``: the response for an upstream that cannot be reached or fails before the head."""
    resp: web.StreamResponse | None = None
    try:
        async with upstream.request(request.method, target, body, headers) as up:
            resp = web.StreamResponse(status=up.status,
                                      headers=relayed_headers(up.header_list, frozenset({"content-length"})))
            length = up.headers.get("content-length")
            if length is not None and length.isdigit() and request.method != "HEAD":
                resp.content_length = int(length)  # the same bytes: the upstream's framing holds
            await resp.prepare(request)
            async for chunk in up.iter_chunks():
                await resp.write(chunk)
            await resp.write_eof()
        return resp
    except ValueError as e:  # a method, path or header the upstream client cannot write
        return error_response(400, f"cannot relay this request: {e}", code="invalid_request")
    except (UpstreamError, TimeoutError) as e:
        if resp is None or not resp.prepared:
            return failure(e)
        if request.transport is not None:  # the head went out: a cut connection is the only way to tell
            request.transport.close()
        return resp
    except (ConnectionError, RuntimeError):  # the client went away
        return resp if resp is not None else web.Response(status=499)
