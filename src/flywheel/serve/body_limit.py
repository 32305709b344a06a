"""Request bodies past a size limit are refused with a 413 before they are read whole.

`BodyLimit` is ASGI middleware: a request whose Content-Length exceeds the limit is answered
at once; one that streams past it (chunked, or lying about its length) is cut off at the
limit and answered the same way, before the route sees it. File uploads (`upload_paths`)
have their own, larger limit (TenantLimits.max_file_bytes)."""

from __future__ import annotations

import orjson

from flywheel.errors import OpenAIError


class _TooLarge(Exception):
    pass


class BodyLimit:
    def __init__(self, app, max_bytes: int, upload_max_bytes: int | None = None,
                 upload_paths: tuple[str, ...] = ("/v1/files",)):
        self.app, self.max_bytes = app, max_bytes
        self.upload_max_bytes = upload_max_bytes or max_bytes
        self.upload_paths = upload_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.upload_max_bytes if scope["path"] in self.upload_paths else self.max_bytes
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await self._refuse(send, limit)
        seen = 0
        started = False

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _TooLarge
            return message

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, tracked)
        except _TooLarge:
            if not started:
                await self._refuse(send, limit)

    @staticmethod
    async def _refuse(send, limit: int) -> None:
        err = OpenAIError(f"the request body is over this server's limit of {limit} bytes", status=413,
                          code="request_too_large")
        body = orjson.dumps(err.body())
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
