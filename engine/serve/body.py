"""A request's JSON body, read within limits: application/json only, at most `max_body` bytes,
arriving within the body deadline, bounded in depth; a refusal is an ApiError saying what to fix.
"""
from __future__ import annotations

import asyncio
import json

from starlette.requests import ClientDisconnect, Request

from engine.config import shown
from engine.serve import protocol as P

THREAD_JSON_BYTES = 64 * 2**10   # bodies larger than this are decoded off the event loop


async def read_body(request: Request, limit: int, timeout: float):
    """The body as JSON: application/json only (a browser page cannot send that to another
    site without asking it first), within `max_body` bytes and the body deadline."""
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise P.ApiError(415, f"the body must be JSON sent with Content-Type: application/json, "
                              f"not {shown(media) if media else 'no Content-Type'}", code="unsupported_media_type")
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise P.ApiError(413, f"the request body is {int(declared)} bytes; the limit is {limit} "
                              "(`max_body`); send a shorter prompt", code="body_too_large")
    body = bytearray()
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise P.ApiError(413, f"the request body is over the limit of {limit} bytes "
                                          "(`max_body`); send a shorter prompt", code="body_too_large")
    except TimeoutError:
        raise P.ApiError(408, f"the request body did not arrive within {timeout:g} s "
                              f"({len(body)} bytes came); send it whole, with a Content-Length it "
                              "matches", code="body_timeout") from None
    except ClientDisconnect:
        raise P.ApiError(400, "the client went away before its body arrived") from None
    if not body:
        raise P.ApiError(400, "the request body is empty; send a JSON object")
    if len(body) > THREAD_JSON_BYTES:
        return await asyncio.to_thread(_decode_json, body)
    return _decode_json(body)


def _decode_json(body: bytes | bytearray):
    try:
        value = json.loads(body)
    except RecursionError:
        raise P.ApiError(400, f"the request nests deeper than {P.MAX_JSON_DEPTH} levels; send a flatter "
                              "body", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise P.ApiError(400, f"the request body is not valid JSON ({exc}); send one JSON object "
                              "with Content-Type: application/json", code="invalid_json") from None
    P.check_json_values(value)
    return value
