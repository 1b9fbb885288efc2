"""Run a child process in its own process group with a timeout, cancellation and an output cap.

When the command ends (normally, by timeout or by cancellation) the whole process group is killed, so background
children (``sleep 100 &``) never outlive the call or hold its output pipe open. A child that leaves the group on
purpose (``setsid``) escapes the group kill; the tools' OS sandbox (``tools/sandbox``: a PID namespace, or a child
subreaper) ends those too.
"""

from __future__ import annotations

import codecs
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import anyio
from anyio.abc import Process

_ANSI = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_])")
TERM_GRACE_S = 0.3
DRAIN_S = 1.0
POLL_S = 0.05


def clean_terminal_text(text: str) -> str:
    """What a terminal would finally show: colour/cursor escapes removed, ``\r``-redrawn progress lines collapsed."""
    text = _ANSI.sub("", text).replace("\r\n", "\n")
    if "\r" not in text:
        return text
    return "\n".join(line.rsplit("\r", 1)[-1] if "\r" in line.rstrip("\r") else line.rstrip("\r")
                     for line in text.split("\n"))


class OutputBuffer:
    """Keeps the first and last ``max_chars // 2`` characters of a stream and counts what fell in between."""

    def __init__(self, max_chars: int) -> None:
        self.half = max(1, max_chars // 2)
        self.head = ""
        self.tail = ""
        self.dropped = 0
        self.total = 0

    def add(self, text: str) -> None:
        """Append ``text``."""
        self.total += len(text)
        if len(self.head) < self.half:
            room = self.half - len(self.head)
            self.head += text[:room]
            text = text[room:]
        if not text:
            return
        joined = self.tail + text
        if len(joined) > self.half:
            self.dropped += len(joined) - self.half
            joined = joined[-self.half :]
        self.tail = joined

    def render(self) -> str:
        """The kept text, with a marker where characters were dropped."""
        if self.dropped:
            return f"{self.head}\n[... {self.dropped} characters omitted ...]\n{self.tail}"
        return self.head + self.tail

    @property
    def truncated(self) -> bool:
        """True if some output was dropped."""
        return self.dropped > 0


@dataclass
class ProcessOutcome:
    """How a process ended: ``exit_code`` is None when it was killed for a timeout or a cancellation."""

    exit_code: int | None
    output: str
    timed_out: bool
    cancelled: bool
    duration_s: float
    truncated: bool


def kill_group(pid: int, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to the process group led by ``pid``; a group that is already gone is fine."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


async def _terminate_group(process: Process) -> None:
    kill_group(process.pid, signal.SIGTERM)
    with anyio.move_on_after(TERM_GRACE_S):
        await process.wait()
    kill_group(process.pid, signal.SIGKILL)  # stragglers and children that ignore SIGTERM


async def run_process(
    argv: list[str],
    *,
    cwd: str,
    env: dict[str, str],
    timeout_s: float,
    max_chars: int,
    on_output: Callable[[str], None] | None = None,
    cancel_event: threading.Event | None = None,
) -> ProcessOutcome:
    """Run ``argv`` (stdout and stderr merged, stdin closed) and return its capped output and exit status."""
    buffer = OutputBuffer(max_chars)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    start = time.monotonic()
    timed_out = cancelled = False
    process = await anyio.open_process(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=cwd,
        env=env,
        start_new_session=True,
    )
    drained = anyio.Event()

    async def pump() -> None:
        assert process.stdout is not None
        try:
            async for chunk in process.stdout:
                text = decoder.decode(chunk)
                if text:
                    buffer.add(text)
                    if on_output is not None:
                        on_output(text)
        except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass
        finally:
            drained.set()

    try:
        async with anyio.create_task_group() as group:
            group.start_soon(pump)
            deadline = start + timeout_s
            while process.returncode is None:
                if cancel_event is not None and cancel_event.is_set():
                    cancelled = True
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    timed_out = True
                    break
                with anyio.move_on_after(min(POLL_S, remaining)):
                    await process.wait()
            await _terminate_group(process)
            with anyio.move_on_after(DRAIN_S):
                await drained.wait()
            group.cancel_scope.cancel()  # a child that escaped the group may still hold the pipe
    finally:
        with anyio.CancelScope(shield=True):
            if process.returncode is None or not drained.is_set():
                await _terminate_group(process)
            # bounded: a child that escaped the group (setsid) can keep the pipe, and so wait(), open forever
            with anyio.move_on_after(DRAIN_S):
                await process.wait()
            with anyio.move_on_after(DRAIN_S):
                await process.aclose()
    tail = decoder.decode(b"", final=True)
    if tail:
        buffer.add(tail)
    return ProcessOutcome(
        exit_code=None if (timed_out or cancelled) else process.returncode,
        output=clean_terminal_text(buffer.render()),
        timed_out=timed_out,
        cancelled=cancelled,
        duration_s=time.monotonic() - start,
        truncated=buffer.truncated,
    )


def child_env(extra: dict[str, str]) -> dict[str, str]:
    """The environment for tool processes: ours, no pagers or colours, plus ``extra``."""
    env = dict(os.environ)
    env.update({"PAGER": "cat", "GIT_PAGER": "cat", "TERM": "dumb", "NO_COLOR": "1", "PYTHONUNBUFFERED": "1"})
    env.update(extra)
    return env
