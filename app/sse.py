"""Server-sent events exactly as OpenAI streams them: `data: {json}\n\n` frames, then `[DONE]`.

An error after the headers went out is sent as one `data:` frame holding an OpenAI error,
then `[DONE]`. The chunks the stream delivered at once go out in one write, and the last ones
share it with the usage chunk and `[DONE]`. A client that goes away (write fails, or the
handler is cancelled) aborts the request through `Generation.close()`.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
from aiohttp import web

from tandem.app.errors import APIError, error_dict
from tandem.app.generation import Generation
from tandem.runtime.loop import EngineDeadError

logger = logging.getLogger(__name__)

DONE_FRAME = b"data: [DONE]\n\n"
SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


def sse_frame(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def stream_sse(request: web.Request, generation: Generation) -> web.StreamResponse:
    """Write a generation as SSE. Always closes the generation (aborting it if unfinished)."""
    response = web.StreamResponse(headers=SSE_HEADERS)
    try:
        await response.prepare(request)
        tail = b""  # held back: goes out with [DONE] in the stream's last write
        try:
            async for batch in generation.chunk_batches():
                frames = b"".join([sse_frame(chunk) for chunk in batch])
                if generation.stream.finished:
                    tail += frames
                else:
                    await response.write(frames)
            if generation.request.include_usage:
                tail += sse_frame(generation.usage_chunk())
        except EngineDeadError as exc:
            tail += sse_frame(APIError(503, str(exc), code="engine_dead").to_dict())
        except APIError as err:  # this request alone failed
            tail += sse_frame(err.to_dict())
        except (ConnectionResetError, OSError):
            raise
        except Exception:  # headers are gone: report in-band (details in the log only)
            logger.exception("error while streaming %s", generation.id)
            tail += sse_frame(error_dict("internal error", "internal_server_error"))
        await response.write(tail + DONE_FRAME)
        await response.write_eof()
    except (ConnectionResetError, OSError):
        logger.info("client went away during %s; aborting", generation.id)
    finally:
        generation.close()
    return response
