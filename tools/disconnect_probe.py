"""Does the server keep memory per request that clients abandon? Serves in this process, then
runs PHASES rounds of N requests that each disconnect early (a completion and a chat completion
streamed and closed after their first event, and a non-streamed completion cut by a 20 ms client
timeout), and prints after each round the Python heap traced by tracemalloc, the process's max
RSS, and the asyncio tasks and engine streams still alive; then the allocation sites that grew
most between the second and the last round.

    python tools/disconnect_probe.py [--real] [--phases 4] [--requests 600]

--real serves the default model (SmolLM2-135M-Instruct, fetched once) through the real engine;
without it, the test suite's fake engine (the app layer alone, whose fake keeps every request id).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import resource
import sys
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiohttp  # noqa: E402

from tandem.app.config import ServerConfig  # noqa: E402
from tandem.app.serve import add_serve_arguments, server_config_from_args, start_server  # noqa: E402


async def abandon(http: aiohttp.ClientSession, base: str, i: int) -> None:
    if i % 3 < 2:  # streamed, closed after the first event
        path, body = (
            ("/v1/completions", {"prompt": "a"})
            if i % 3 == 0
            else ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        )
        resp = await http.post(f"{base}{path}", json={**body, "max_tokens": 200, "stream": True})
        await resp.content.readuntil(b"\n\n")
        resp.close()
        return
    try:  # not streamed, cut by the client's timeout
        timeout = aiohttp.ClientTimeout(total=0.02)
        async with http.post(
            f"{base}/v1/completions", json={"prompt": "a", "max_tokens": 200}, timeout=timeout
        ) as resp:
            await resp.read()
    except asyncio.TimeoutError:
        pass


async def main(args: argparse.Namespace) -> None:
    if args.real:
        from tandem.runtime.engine import Engine

        p = argparse.ArgumentParser()
        add_serve_arguments(p)
        config = server_config_from_args(p.parse_args(["--port", "0"]), environ={})
        server = await start_server(config, Engine(config.engine))
    else:
        from tests.app.fake_engine import FakeEngine

        server = await start_server(ServerConfig(port=0), FakeEngine(step_delay=0.001))
    base = f"http://127.0.0.1:{server.port}"
    tracemalloc.start(25)
    snapshots = []
    async with aiohttp.ClientSession() as http:
        for phase in range(args.phases):
            for i in range(args.requests):
                await abandon(http, base, i)
            await asyncio.sleep(0.5)
            gc.collect()
            snapshots.append(tracemalloc.take_snapshot())
            traced = tracemalloc.get_traced_memory()[0]
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            streams = len(getattr(server.engine_loop, "_streams", {}))
            print(
                f"round {phase}: traced {traced / 1e6:.2f} MB, max RSS {rss / 1e3:.1f} MB, "
                f"tasks {len(asyncio.all_tasks())}, engine streams {streams}",
                flush=True,
            )
    if len(snapshots) > 2:
        for stat in snapshots[-1].compare_to(snapshots[1], "traceback")[:5]:
            print(stat)
            for line in stat.traceback.format()[-6:]:
                print("   ", line)
    await server.shutdown(1.0)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--real", action="store_true", help="the default model, real engine")
    ap.add_argument("--phases", type=int, default=4)
    ap.add_argument("--requests", type=int, default=600)
    asyncio.run(main(ap.parse_args()))
