"""The stdio transport: newline-delimited JSON over the process's real stdout and stdin.

:func:`reserve_stdout` keeps the real stdout for the protocol and points file descriptor 1 at stderr, so a stray
``print``, a library's progress bar or a native library's log can never corrupt the protocol stream. It must run
before anything that might write to stdout is imported.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

READ_CHUNK = 1 << 16
DEFAULT_MAX_MESSAGE_BYTES = 16 * 2**20


def reserve_stdout() -> int:
    """Return a private duplicate of the real stdout for the protocol; fd 1 (and ``sys.stdout``) become stderr."""
    sys.stdout.flush()
    protocol_fd = os.dup(1)  # non-inheritable: tool subprocesses never see the protocol pipe
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return protocol_fd


@dataclass(frozen=True)
class Oversized:
    """A line longer than the limit; its bytes were dropped."""

    size: int


class LineReader:
    """Reads newline-terminated messages from a file descriptor (a blocking read runs in a worker thread).

    Lines longer than ``max_bytes`` are dropped as they stream in (memory stays bounded) and reported as one
    :class:`Oversized` item. A final line without a newline is delivered at end of input.
    """

    def __init__(self, fd: int, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        self.fd = fd
        self.max_bytes = max_bytes
        self._buffer = bytearray()
        self._dropping = 0  # > 0 while skipping an oversized line: the bytes dropped so far
        self._ready: list[bytes | Oversized] = []
        self._eof = False

    def __aiter__(self) -> LineReader:
        return self

    async def __anext__(self) -> bytes | Oversized:
        while not self._ready:
            if self._eof:
                raise StopAsyncIteration
            chunk = await anyio.to_thread.run_sync(os.read, self.fd, READ_CHUNK, abandon_on_cancel=True)
            if not chunk:
                self._eof = True
                if self._dropping:
                    self._ready.append(Oversized(self._dropping))
                elif self._buffer:
                    self._ready.append(bytes(self._buffer))
                self._buffer.clear()
            else:
                self._split(chunk)
        return self._ready.pop(0)

    def _split(self, chunk: bytes) -> None:
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            piece = chunk[start:] if end < 0 else chunk[start:end]
            if self._dropping:
                self._dropping += len(piece)
            elif len(self._buffer) + len(piece) > self.max_bytes:
                self._dropping = len(self._buffer) + len(piece)
                self._buffer.clear()
            else:
                self._buffer += piece
            if end < 0:
                return
            if self._dropping:
                self._ready.append(Oversized(self._dropping))
                self._dropping = 0
            else:
                self._ready.append(bytes(self._buffer))
                self._buffer.clear()
            start = end + 1


def encode(message: dict[str, Any]) -> bytes:
    """One protocol line. ASCII-only JSON: no raw newline or unpaired surrogate can reach the stream."""
    return (json.dumps(message, ensure_ascii=True, separators=(",", ":"), allow_nan=False) + "\n").encode("ascii")


class MessageWriter:
    """Serializes messages in the order :meth:`send` is called and writes them from one task (never interleaved)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        send, receive = anyio.create_memory_object_stream[bytes](math.inf)
        self._send: MemoryObjectSendStream[bytes] = send
        self._receive: MemoryObjectReceiveStream[bytes] = receive

    def send(self, message: dict[str, Any]) -> None:
        """Queue ``message`` (raises ``TypeError``/``ValueError`` here if it is not JSON-serializable)."""
        self._send.send_nowait(encode(message))

    async def run(self) -> None:
        """Write queued lines until :meth:`close`; each batch of ready lines goes out in one write."""
        async with self._receive:
            async for line in self._receive:
                batch = [line]
                while True:
                    try:
                        batch.append(self._receive.receive_nowait())
                    except (anyio.WouldBlock, anyio.EndOfStream):
                        break
                try:
                    await anyio.to_thread.run_sync(_write_all, self.fd, b"".join(batch))
                except OSError as exc:  # the client went away: nothing more can be said to it
                    print(f"freetoken acp: stdout closed ({exc.strerror or exc}); stopping", file=sys.stderr)
                    return

    def close(self) -> None:
        """No more messages; :meth:`run` returns once the queue is written."""
        self._send.close()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]
