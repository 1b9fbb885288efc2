"""JSON-RPC 2.0 over newline-delimited stdio: dispatch incoming requests and notifications, send our own requests.

Every malformed input that deserves a reply gets exactly one error response (``id`` null when the request's id
cannot be read); notifications never get one. A handler's failure becomes an error response, never a crash.
"""

from __future__ import annotations

import itertools
import json
import sys
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
import pydantic

from freetoken_agent.acp.stdio import LineReader, MessageWriter, Oversized

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
AUTH_REQUIRED = -32000  # ACP: authentication required
RESOURCE_NOT_FOUND = -32002  # ACP: e.g. an unknown session

Handler = Callable[[dict[str, Any]], Awaitable[Any]]
RequestId = str | int | None


class RpcError(Exception):
    """An error response: ``code`` (JSON-RPC / ACP), a one-line ``message`` and optional ``data``."""

    def __init__(self, code: int, message: str, data: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data

    @classmethod
    def invalid_params(cls, message: str) -> RpcError:
        return cls(INVALID_PARAMS, message)

    @classmethod
    def not_found(cls, message: str) -> RpcError:
        return cls(RESOURCE_NOT_FOUND, message)

    def to_wire(self) -> dict[str, Any]:
        error: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.data is not None:
            error["data"] = self.data
        return error


def describe_validation(method: str, exc: pydantic.ValidationError) -> str:
    """A one-line summary of what is wrong with a request's params."""
    parts = []
    for err in exc.errors()[:3]:
        where = ".".join(str(p) for p in err["loc"]) or "params"
        parts.append(f"{where}: {err['msg']}")
    more = f" (and {exc.error_count() - 3} more)" if exc.error_count() > 3 else ""
    return f"invalid params for {method}: " + "; ".join(parts) + more


def _valid_id(value: Any) -> bool:
    return (isinstance(value, (str, int)) and not isinstance(value, bool)) or value is None


@dataclass
class _Pending:
    done: anyio.Event = field(default_factory=anyio.Event)
    result: Any = None
    error: dict[str, Any] | None = None


class Connection:
    """One peer over a line reader and a message writer.

    ``requests`` and ``notifications`` map method names to async handlers taking the params object; a request
    handler's return value is the result. Each incoming message runs in its own task, started in arrival order.
    """

    def __init__(self, reader: LineReader, writer: MessageWriter, requests: dict[str, Handler],
                 notifications: dict[str, Handler]) -> None:
        self.reader = reader
        self.writer = writer
        self.requests = requests
        self.notifications = notifications
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count(1)
        self._group: anyio.abc.TaskGroup | None = None
        self._inflight = 0  # requests being handled

    async def serve(self, on_eof: Callable[[], None] | None = None, grace_s: float = 5.0) -> None:
        """Handle messages until stdin closes; then call ``on_eof`` (e.g. to cancel running turns), give requests
        in flight ``grace_s`` seconds to answer, stop the rest, and write out every queued message."""
        async with anyio.create_task_group() as outer:
            outer.start_soon(self.writer.run)
            async with anyio.create_task_group() as handlers:
                self._group = handlers
                async for line in self.reader:
                    self._receive(line)
                for pending in self._pending.values():
                    pending.error = {"code": INTERNAL_ERROR, "message": "the client closed the connection"}
                    pending.done.set()
                if on_eof is not None:
                    on_eof()
                with anyio.move_on_after(grace_s):
                    while self._inflight:
                        await anyio.sleep(0.01)
                handlers.cancel_scope.cancel()
            self.writer.close()

    # ----------------------------------------------------------------------------------------------- outgoing
    def notify(self, method: str, params: dict[str, Any]) -> None:
        """Send a notification (queued in order; never blocks). Values JSON cannot hold are sent as text."""
        message = {"jsonrpc": "2.0", "method": method, "params": params}
        try:
            self.writer.send(message)
        except (TypeError, ValueError):
            self.writer.send(json.loads(json.dumps(message, default=str)))

    async def request(self, method: str, params: dict[str, Any]) -> Any:
        """Send a request and wait for its result; an error response raises :class:`RpcError`."""
        request_id = next(self._ids)
        pending = self._pending[request_id] = _Pending()
        try:
            self.writer.send({"jsonrpc": "2.0", "id": request_id, "method": method, "params": params})
            await pending.done.wait()
        finally:
            self._pending.pop(request_id, None)
        if pending.error is not None:
            raise RpcError(int(pending.error.get("code", INTERNAL_ERROR)), str(pending.error.get("message", "")),
                           pending.error.get("data"))
        return pending.result

    def _reply_error(self, request_id: RequestId, code: int, message: str, data: Any = None) -> None:
        self.writer.send({"jsonrpc": "2.0", "id": request_id, "error": RpcError(code, message, data).to_wire()})

    # ----------------------------------------------------------------------------------------------- incoming
    def _receive(self, line: bytes | Oversized) -> None:
        if isinstance(line, Oversized):
            self._reply_error(None, INVALID_REQUEST, f"message of {line.size} bytes is larger than the limit "
                                                     f"({self.reader.max_bytes} bytes); it was dropped")
            return
        if not line.strip():
            return  # blank lines between messages are tolerated
        try:
            message = json.loads(line)
        except (ValueError, RecursionError) as exc:  # bad JSON, bad UTF-8, absurd nesting
            self._reply_error(None, PARSE_ERROR, f"parse error: {str(exc)[:200]}")
            return
        if isinstance(message, list):
            self._reply_error(None, INVALID_REQUEST, "batch requests are not supported: send one message per line")
            return
        if not isinstance(message, dict):
            self._reply_error(None, INVALID_REQUEST, f"a message must be a JSON object, got {type(message).__name__}")
            return
        has_id = "id" in message
        request_id = message.get("id")
        if has_id and not _valid_id(request_id):
            self._reply_error(None, INVALID_REQUEST, "id must be a string, an integer or null")
            return
        if message.get("jsonrpc") != "2.0":
            self._reply_error(request_id, INVALID_REQUEST, 'jsonrpc must be "2.0"')
            return
        if "method" not in message:
            if has_id and ("result" in message or "error" in message):
                self._response(message)
            else:
                self._reply_error(request_id, INVALID_REQUEST, "a message needs a method (or a result/error)")
            return
        method = message["method"]
        if not isinstance(method, str):
            self._reply_error(request_id, INVALID_REQUEST, "method must be a string")
            return
        params = message.get("params", {})
        assert self._group is not None
        if not has_id:
            handler = self.notifications.get(method)
            if handler is not None and isinstance(params, dict):
                self._group.start_soon(self._run_notification, method, handler, params)
            return  # a notification never gets a reply, whatever is wrong with it
        if not isinstance(params, dict):
            self._reply_error(request_id, INVALID_PARAMS, f"params of {method} must be an object")
            return
        handler = self.requests.get(method)
        if handler is None:
            self._reply_error(request_id, METHOD_NOT_FOUND, f"method not found: {method[:100]}")
            return
        self._inflight += 1  # counted from now, so a request not yet started still gets its grace at EOF
        self._group.start_soon(self._run_request, request_id, method, handler, params)

    def _response(self, message: dict[str, Any]) -> None:
        pending = self._pending.get(message["id"]) if isinstance(message["id"], int) else None
        if pending is None:
            print(f"freetoken acp: ignoring a response to unknown request id {message['id']!r}", file=sys.stderr)
            return
        error = message.get("error")
        if error is not None:
            pending.error = error if isinstance(error, dict) else {"code": INTERNAL_ERROR, "message": str(error)}
        else:
            pending.result = message.get("result")
        pending.done.set()

    async def _run_request(self, request_id: RequestId, method: str, handler: Handler,
                           params: dict[str, Any]) -> None:
        try:
            result = await handler(params)
        except RpcError as exc:
            self._reply_error(request_id, exc.code, exc.message, exc.data)
        except pydantic.ValidationError as exc:
            self._reply_error(request_id, INVALID_PARAMS, describe_validation(method, exc))
        except Exception as exc:  # a bug in a handler: the client gets one line, the log gets the traceback
            traceback.print_exc(file=sys.stderr)
            self._reply_error(request_id, INTERNAL_ERROR, f"internal error in {method}: {type(exc).__name__}: {exc}")
        else:
            try:
                self.writer.send({"jsonrpc": "2.0", "id": request_id, "result": result})
            except (TypeError, ValueError) as exc:
                self._reply_error(request_id, INTERNAL_ERROR, f"internal error in {method}: unserializable "
                                                              f"result ({exc})")
        finally:
            self._inflight -= 1

    async def _run_notification(self, method: str, handler: Handler, params: dict[str, Any]) -> None:
        try:
            await handler(params)
        except (RpcError, pydantic.ValidationError) as exc:
            print(f"freetoken acp: ignoring notification {method}: {exc}", file=sys.stderr)
        except Exception:
            traceback.print_exc(file=sys.stderr)
