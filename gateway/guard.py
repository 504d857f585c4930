"""Every request body, checked once before any route reads it.

`BodyGuard` is plain ASGI (Starlette's BaseHTTPMiddleware would hand the app a
`receive` that reports a disconnect once the body is read, cancelling every stream).
It reads the body up to --payload-limit (413 past it, by content-length or as a
chunked body arrives) and refuses, in the route's dialect and naming the field by
its JSON path, what would otherwise reach a route as a framework error or a 500:
bytes that are not UTF-8, JSON nested deeper than MAX_JSON_DEPTH, and strings
carrying a lone surrogate (`"\\ud800"`, valid JSON that no encoder can write back).
Malformed JSON is left to the routes, which report it themselves. The body is then
replayed to the app; later `receive()` calls (the disconnect) pass through.
"""
from __future__ import annotations

import json
import re

from .errors import ErrorKind, GatewayError, dialect_for_path

# Deeper than any real request; below where Python's recursive JSON, schema and template
# code would raise RecursionError (json.loads itself fails near 1000 levels).
MAX_JSON_DEPTH = 128

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
# a JSON string (escapes included), or one structural character
_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{},:]')


class BodyGuard:
    def __init__(self, app, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in _BODY_METHODS:
            return await self.app(scope, receive, send)
        dialect = dialect_for_path(scope["path"])
        headers = dict(scope.get("headers") or ())
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            error = _too_large(f"the body has {int(length)} bytes; the limit is {self.limit}")
            return await error.render(dialect)(scope, receive, send)
        body, complete = await self._read(receive)
        if not complete:
            return None  # the client went away before sending its body
        if body is None:
            error = _too_large(f"the body is over the limit of {self.limit} bytes")
            return await error.render(dialect)(scope, receive, send)
        problem = check_json_body(body)  # whatever its content type: some routes parse any body as JSON
        if problem is not None:
            return await problem.render(dialect)(scope, receive, send)
        await self.app(scope, _replay(body, receive), send)

    async def _read(self, receive) -> tuple[bytes | None, bool]:
        """(body, True); (None, True) once it passes the limit; (b"", False) on a disconnect."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"", False
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                return None, True
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), True


def _too_large(message: str) -> GatewayError:
    return GatewayError(ErrorKind.PAYLOAD_TOO_LARGE, message)


def _replay(body: bytes, receive):
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def check_json_body(raw: bytes) -> GatewayError | None:
    """The 4xx this body earns before any route sees it, or None."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return GatewayError(ErrorKind.VALIDATION, f"the body is not valid UTF-8 (byte {exc.start})")
    too_deep = _path_past_depth(text, MAX_JSON_DEPTH)
    if too_deep is not None:
        return GatewayError(ErrorKind.VALIDATION, f"{too_deep or 'the body'}: JSON nests deeper than "
                            f"{MAX_JSON_DEPTH} levels", too_deep or None)
    if not _SURROGATE_ESCAPE.search(text):
        return None
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None  # malformed JSON: the route reports it
    path = _surrogate_path(value)
    if path is None:
        return None
    return GatewayError(ErrorKind.VALIDATION, f"{path or 'the body'}: a string holds a lone UTF-16 surrogate "
                        "(an unpaired \\ud800-\\udfff escape), which is not a character", path or None)


def _path_past_depth(text: str, max_depth: int) -> str | None:
    """The JSON path ('messages.0.content') of the first container nested deeper than
    `max_depth`, or None. A token scan, so any depth is safe to measure."""
    if text.count("[") + text.count("{") <= max_depth:
        return None
    frames: list[list] = []  # [key or index, is_object, expecting a key]
    for match in _TOKEN.finditer(text):
        token = match.group()
        if token in "[{":
            if len(frames) >= max_depth:
                return _path(frames)
            frames.append([None if token == "{" else 0, token == "{", token == "{"])
        elif token in "]}":
            if frames:
                frames.pop()
        elif not frames:
            continue
        elif token == ",":
            top = frames[-1]
            if top[1]:
                top[2] = True
            else:
                top[0] += 1
        elif token == ":":
            frames[-1][2] = False
        elif frames[-1][1] and frames[-1][2]:  # a string where a key is expected
            frames[-1][0] = _unquote(token)
    return None


def _unquote(token: str) -> str:
    try:
        return json.loads(token)
    except ValueError:
        return token[1:-1]


def _path(frames: list[list], shown: int = 6) -> str:
    """The path to the innermost frame, its first `shown` steps then '...'."""
    steps = [str(frame[0]) for frame in frames if frame[0] is not None]
    return ".".join(steps[:shown]) + (".…" if len(steps) > shown else "")


def _surrogate_path(value) -> str | None:
    """The path of the first string (or key) holding a lone surrogate, or None."""
    stack = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if _has_surrogate(item):
                return path
        elif isinstance(item, dict):
            for key, child in item.items():
                child_path = f"{path}.{key}" if path else str(key)
                if _has_surrogate(key):
                    return child_path
                stack.append((child, child_path))
        elif isinstance(item, list):
            stack.extend((child, f"{path}.{i}" if path else str(i)) for i, child in enumerate(item))
    return None


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
