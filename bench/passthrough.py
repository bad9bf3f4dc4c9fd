"""The baseline of the proxy benchmark: a bare aiohttp proxy that forwards the body's bytes and sends
the answer's bytes back, with nothing else (no parsing, no session, no compaction).

It is the cost of the extra hop itself: an asyncio server and client on the same stack and event
loop as ``ctxfold serve`` (uvloop when installed). What ``ctxfold serve`` adds beyond it is its own
work. Run: ``python bench/passthrough.py --upstream URL [--port 0]``; it prints ``listening on URL``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import aiohttp
from aiohttp import web

from ctxfold.cli.serve import event_loop_factory


async def serve(upstream: str, host: str, port: int) -> None:
    url = upstream.rstrip("/") + "/v1/chat/completions"
    client = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        async with client.post(url, data=body, headers={"Content-Type": "application/json"}) as up:
            if up.headers.get("Content-Type", "").startswith("text/event-stream"):
                resp = web.StreamResponse(status=up.status, headers={"Content-Type": up.headers["Content-Type"]})
                await resp.prepare(request)
                async for chunk in up.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
            raw = await up.read()
            return web.Response(body=raw, status=up.status,
                                headers={"Content-Type": up.headers.get("Content-Type", "application/json")})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    print(f"passthrough: listening on http://{host}:{bound}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await client.close()
        await runner.cleanup()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--upstream", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args()
    with asyncio.Runner(loop_factory=event_loop_factory("auto")) as runner:
        runner.run(serve(args.upstream, args.host, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
