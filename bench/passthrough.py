"""The baseline of the proxy benchmark: a bare proxy that forwards the body's bytes and sends the
answer's bytes back, with nothing else (no parsing, no session, no compaction).

It is the cost of the extra hop itself, on the same stack as ``ctxfold serve``: the aiohttp server,
the proxy's upstream client (``ctxfold.serve.upstream``) and event loop (uvloop when installed).
What ``ctxfold serve`` adds beyond it is its own work. Run: ``python bench/passthrough.py --upstream
URL [--port 0]``; it prints ``listening on URL``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from aiohttp import web

from ctxfold.cli.serve import event_loop_factory
from ctxfold.serve.upstream import UpstreamClient


async def serve(upstream: str, host: str, port: int) -> None:
    url = upstream.rstrip("/") + "/v1/chat/completions"
    client = UpstreamClient(url, connect_timeout_s=10.0, read_timeout_s=600.0)

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        # The same path on the upstream (its base URL ends in /v1, as the proxy's does).
        async with client.post(body, {"Content-Type": "application/json"}, target=request.path) as up:
            ctype = up.headers.get("content-type", "application/json")
            if ctype.startswith("text/event-stream"):
                resp = web.StreamResponse(status=up.status, headers={"Content-Type": ctype})
                await resp.prepare(request)
                async for chunk in up.iter_chunks():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
            return web.Response(body=await up.read(), status=up.status, headers={"Content-Type": ctype})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_post("/v1/responses", completions)
    app.router.add_post("/v1/messages", completions)
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
