"""A real ACP client (the ``agent-client-protocol`` package) driving ``freetoken acp`` in a subprocess."""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import acp
from acp.schema import AllowedOutcome, DeniedOutcome, ReadTextFileResponse, RequestPermissionResponse

REPO = Path(__file__).resolve().parents[2]
SHUTDOWN_S = 20.0  # how long the client waits for the agent to exit after closing its stdin (then terminates it)


def freetoken_command() -> list[str]:
    """The installed ``freetoken`` entry point (falls back to ``python -m freetoken_agent.cli``)."""
    found = shutil.which("freetoken")
    return [found] if found else [sys.executable, "-m", "freetoken_agent.cli"]


def child_env() -> dict[str, str]:
    env = dict(acp.default_environment())
    env.update({"PYTHONPATH": str(REPO), "FREETOKEN_THREADS": "1", "OMP_NUM_THREADS": "1",
                "XDG_STATE_HOME": env.get("XDG_STATE_HOME", "/nonexistent-state")})
    return env


def write_script(folder: Path, turns: list[Any], delay_s: float = 0.0, name: str = "script.json") -> Path:
    """A ``--scripted`` file: the model outputs to play, one per model call."""
    path = folder / name
    path.write_text(json.dumps({"turns": turns, "delay_s": delay_s}), encoding="utf-8")
    return path


def tool_call(name: str, arguments: dict[str, Any], text: str = "") -> str:
    """A model turn in the Hermes/Qwen format calling ``name``."""
    return f'{text}<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


@dataclass
class RecordingClient:
    """An ACP client that records every update and answers permission requests from a list of option ids.

    ``answers``: option ids to pick, in order (``"cancelled"`` answers with the cancelled outcome); when it runs
    out, requests are rejected. ``on_update`` runs on each update (e.g. to cancel mid-stream).
    """

    answers: list[str] = field(default_factory=list)
    updates: list[tuple[str, Any]] = field(default_factory=list)
    permissions: list[Any] = field(default_factory=list)
    on_update: Callable[[Any], Any] | None = None
    on_permission: Callable[[], Any] | None = None  # awaited before answering (e.g. to cancel the turn)
    buffers: dict[str, str] = field(default_factory=dict)  # path -> unsaved editor text (fs/read_text_file)
    reads: list[tuple[str, int | None, int | None]] = field(default_factory=list)

    async def request_permission(self, options: list[Any], session_id: str, tool_call: Any,
                                 **kwargs: Any) -> RequestPermissionResponse:
        self.permissions.append((session_id, tool_call, options))
        if self.on_permission is not None:
            await self.on_permission()
        choice = self.answers.pop(0) if self.answers else "reject-once"
        if choice == "cancelled":
            return RequestPermissionResponse(outcome=DeniedOutcome(outcome="cancelled"))
        return RequestPermissionResponse(outcome=AllowedOutcome(outcome="selected", option_id=choice))

    async def read_text_file(self, path: str, session_id: str, limit: int | None = None, line: int | None = None,
                             **kwargs: Any) -> ReadTextFileResponse:
        self.reads.append((path, line, limit))
        if path not in self.buffers:
            raise acp.RequestError.resource_not_found(path)
        lines = self.buffers[path].splitlines(keepends=True)[(line or 1) - 1:]
        return ReadTextFileResponse(content="".join(lines[:limit] if limit else lines))

    async def session_update(self, session_id: str, update: Any, **kwargs: Any) -> None:
        self.updates.append((session_id, update))
        if self.on_update is not None:
            result = self.on_update(update)
            if hasattr(result, "__await__"):
                await result

    def kinds(self) -> list[str]:
        """The ``sessionUpdate`` tag of every update, in order."""
        return [u.session_update for _, u in self.updates]

    def text(self, kind: str = "agent_message_chunk") -> str:
        return "".join(u.content.text for _, u in self.updates if u.session_update == kind)

    def tool_updates(self, tool_call_id: str) -> list[Any]:
        return [u for _, u in self.updates if getattr(u, "tool_call_id", None) == tool_call_id]


@asynccontextmanager
async def acp_agent(*args: str, client: RecordingClient | None = None, stderr_path: Path | None = None
                    ) -> AsyncIterator[tuple[Any, Any, RecordingClient]]:
    """Spawn ``freetoken acp ARGS`` and yield (connection, process, client)."""
    client = client or RecordingClient()
    command = freetoken_command()
    stderr_file = open(stderr_path or os.devnull, "wb")  # noqa: SIM115 - closed below
    try:
        async with acp.spawn_agent_process(client, command[0], *command[1:], "acp", *args, env=child_env(),
                                           transport_kwargs={"stderr": stderr_file.fileno(),
                                                             "shutdown_timeout": SHUTDOWN_S}) as (conn, process):
            yield conn, process, client
    finally:
        stderr_file.close()


async def start_session(conn: Any, cwd: Path) -> str:
    """``initialize`` then ``session/new`` in ``cwd``; returns the session id."""
    await conn.initialize(protocol_version=acp.PROTOCOL_VERSION)
    return (await conn.new_session(cwd=str(cwd), mcp_servers=[])).session_id
