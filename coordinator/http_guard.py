"""The HTTP API's front door (pure ASGI): the token before any body is read, and bodies capped while they are read.

FastAPI reads and parses a request's body before its dependencies run, so a route's token check
came after an unauthenticated 200 MB body had been taken into memory. This middleware answers
first: a request that could change state (any method but GET/HEAD/OPTIONS) without the API token
gets 401 before one byte of its body is read, and any body above `max_body` gets 413, from its
Content-Length when it has one, else as soon as the bytes read pass the cap.
"""
from __future__ import annotations

import hmac
import json

SAFE_METHODS = {"GET", "HEAD", "OPTIONS"}
MAX_BODY = 64 * 1024  # the largest body a route takes (an evaluation's metrics) is well under a kilobyte


def token_matches(header: bytes | None, token: str) -> bool:
    scheme, _, given = (header or b"").decode("latin-1").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


async def _respond(send, status: int, detail: str, extra: list | None = None) -> None:
    body = json.dumps({"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close"), *(extra or [])]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class HttpGuard:
    """ASGI middleware: `app.add_middleware(HttpGuard, token=..., max_body=...)`."""

    def __init__(self, app, token: str, max_body: int = MAX_BODY):
        self.app, self.token, self.max_body = app, token, max_body

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if scope["method"] not in SAFE_METHODS and not token_matches(headers.get(b"authorization"), self.token):
            return await _respond(send, 401, "missing or wrong API token: send Authorization: Bearer TOKEN "
                                             "(the token is in STATE/api-token)", [(b"www-authenticate", b"Bearer")])
        length = headers.get(b"content-length")
        if length is not None and (not length.strip().isdigit() or int(length) > self.max_body):
            return await _respond(send, 413, f"request body above {self.max_body} bytes")
        received, started, refused = 0, False, False

        async def capped_receive():
            nonlocal received, started, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body:  # answer now; the app sees a client that went away
                    refused = True
                    if not started:
                        started = True
                        await _respond(send, 413, f"request body above {self.max_body} bytes")
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message):
            nonlocal started
            if refused:
                return  # the 413 has gone out; whatever the app makes of the disconnect is not sent
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, capped_receive, guarded_send)
