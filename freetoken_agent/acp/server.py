"""``AcpServer``: the Agent Client Protocol (v1) methods over one JSON-RPC connection, with our ``Agent`` behind.

Requests: ``initialize``, ``authenticate``, ``session/new``, ``session/load``, ``session/resume``,
``session/prompt``, ``session/set_mode``, ``session/close``; notification: ``session/cancel``. The model loads in
the background once the client has initialized, so the handshake answers at once.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread

from freetoken_agent.acp.jsonrpc import INTERNAL_ERROR, Connection, RpcError
from freetoken_agent.acp.mcp_bridge import McpHolder
from freetoken_agent.acp.permissions import MODES, AcpToolRegistry, plan_tool
from freetoken_agent.acp.schema import (
    PROTOCOL_VERSION,
    AuthenticateParams,
    InitializeParams,
    ListSessionsParams,
    LoadSessionParams,
    McpServer,
    NewSessionParams,
    PromptParams,
    SessionParams,
    SetModeParams,
)
from freetoken_agent.acp.session import AcpSession, prompt_text
from freetoken_agent.acp.stdio import DEFAULT_MAX_MESSAGE_BYTES, LineReader, MessageWriter
from freetoken_agent.acp.store import SessionStore
from freetoken_agent.agent import CODING_INSTRUCTIONS, Agent, Limits, Sampling
from freetoken_agent.backends.base import Backend, GenerateRequest, SessionBackend
from freetoken_agent.runtime.errors import FreeTokenError

ACP_INSTRUCTIONS = CODING_INSTRUCTIONS + (
    " You are running inside the user's editor: be brief, and for multi-step work keep a plan with update_plan.")


@dataclass
class AcpOptions:
    """How ``freetoken acp`` builds the agent behind each session."""

    backend_factory: Callable[[], tuple[Backend, int]]
    """Builds the backend and returns it with the model's context size in tokens (0 if unknown). Called once, in a
    worker thread, after ``initialize``."""
    limits: Limits = field(default_factory=Limits)
    sampling: Sampling = field(default_factory=Sampling)
    instructions: str = ACP_INSTRUCTIONS
    mode: str = "ask"
    """Initial session mode: ``ask`` (permission before writing/executing), ``auto`` or ``read-only``."""
    sessions_dir: Path | None = None
    """Where sessions are saved for ``session/load`` (None: sessions live only in this process)."""
    trajectory_dir: Path | None = None
    """A folder that gets one trajectory JSONL per prompt turn (None: none)."""
    tool_timeout_s: float = 120.0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES


class _SerialBackend:
    """One generation at a time across sessions (the scripted backend is not reentrant; the engine serializes its
    own). Conversation-scoped hints and ``end_session`` reach a backend that keeps per-conversation state."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self._per_session = isinstance(inner, SessionBackend)
        self._lock = anyio.Lock()

    async def generate(self, request: GenerateRequest) -> Any:
        async with self._lock:
            async for event in self.inner.generate(request):
                yield event

    def hint(self, phase: Any, expected_s: float | None = None, session: str | None = None) -> None:
        if self._per_session:
            self.inner.hint(phase, expected_s, session=session)  # type: ignore[call-arg]
        else:
            self.inner.hint(phase, expected_s)

    def end_session(self, session: str) -> None:
        if self._per_session:
            self.inner.end_session(session)  # type: ignore[attr-defined]

    def stats(self) -> dict[str, Any] | None:
        return self.inner.stats()


class AcpServer:
    """Serves ACP over ``read_fd``/``write_fd`` until the client closes its end."""

    def __init__(self, options: AcpOptions, read_fd: int, write_fd: int) -> None:
        self.options = options
        requests = {"initialize": self.initialize, "authenticate": self.authenticate,
                    "session/new": self.new_session, "session/load": self.load_session,
                    "session/resume": self.resume_session, "session/list": self.list_sessions,
                    "session/prompt": self.prompt, "session/set_mode": self.set_mode,
                    "session/close": self.close_session}
        self.conn = Connection(LineReader(read_fd, options.max_message_bytes), MessageWriter(write_fd), requests,
                               {"session/cancel": self.cancel})
        self.sessions: dict[str, AcpSession] = {}
        self._mcp: dict[str, McpHolder] = {}
        self._group: anyio.abc.TaskGroup | None = None
        self._loaded = anyio.Event()
        self._loading = False
        self._backend: _SerialBackend | None = None
        self._context_size = 0
        self._load_error: str | None = None
        self._client_reads = False  # the client offered fs/read_text_file in initialize
        self.store = SessionStore(options.sessions_dir) if options.sessions_dir is not None else None

    async def run(self) -> None:
        async with anyio.create_task_group() as group:
            self._group = group
            await self.conn.serve(on_eof=self._client_left)
            group.cancel_scope.cancel()

    def _client_left(self) -> None:
        """stdin closed: cancel running turns (their prompts answer ``cancelled``) and stop MCP servers."""
        for session in self.sessions.values():
            session.cancel()
        for holder in self._mcp.values():
            holder.stop()

    # ------------------------------------------------------------------------------------------------ model
    def _start_loading(self) -> None:
        if not self._loading and self._group is not None:
            self._loading = True
            self._group.start_soon(self._load)

    async def _load(self) -> None:
        try:
            backend, size = await anyio.to_thread.run_sync(self.options.backend_factory, abandon_on_cancel=True)
        except Exception as exc:  # a bad model folder, a broken checkpoint: every prompt reports it
            self._load_error = str(exc) if isinstance(exc, FreeTokenError) else f"{type(exc).__name__}: {exc}"
            print(f"freetoken acp: the model did not load: {self._load_error}", file=sys.stderr)
        else:
            self._backend, self._context_size = _SerialBackend(backend), size
        finally:
            self._loaded.set()

    async def _agent(self, session: AcpSession) -> Agent:
        self._start_loading()
        await self._loaded.wait()
        if self._backend is None:
            raise RpcError(INTERNAL_ERROR, f"the model did not load: {self._load_error}")
        opts = self.options
        trajectory = None
        if opts.trajectory_dir is not None:  # a folder: one file per run (the CLI created it)
            trajectory = str(opts.trajectory_dir) + os.sep
        return Agent(backend=self._backend, tools=session.registry or [], instructions=opts.instructions,
                     workspace=session.workspace.root, limits=opts.limits, sampling=opts.sampling,
                     trajectory=trajectory, tool_timeout_s=opts.tool_timeout_s)

    # ------------------------------------------------------------------------------------------- handshake
    async def initialize(self, params: dict[str, Any]) -> dict[str, Any]:
        request = InitializeParams.model_validate(params)
        self._client_reads = request.client_capabilities.fs.read_text_file
        self._start_loading()
        from freetoken_agent import __version__

        session_caps: dict[str, Any] = {"close": {}}
        if self.store is not None:
            session_caps.update(resume={}, list={})
        return {
            "protocolVersion": PROTOCOL_VERSION,
            "agentCapabilities": {
                "loadSession": self.store is not None,
                "promptCapabilities": {"image": False, "audio": False, "embeddedContext": True},
                "mcpCapabilities": {"http": False, "sse": False},
                "sessionCapabilities": session_caps,
            },
            "authMethods": [],
            "agentInfo": {"name": "freetoken-agent", "title": "FreeToken Agent", "version": __version__},
        }

    async def authenticate(self, params: dict[str, Any]) -> dict[str, Any]:
        AuthenticateParams.model_validate(params)
        return {}  # no authentication is needed: the model runs on this machine

    # -------------------------------------------------------------------------------------------- sessions
    def _modes(self, session: AcpSession) -> dict[str, Any]:
        return {"currentModeId": session.mode,
                "availableModes": [{"id": key, "name": name, "description": text}
                                   for key, (name, text) in MODES.items()]}

    def _cwd(self, cwd: str) -> Path:
        path = Path(cwd)
        if not path.is_absolute():
            raise RpcError.invalid_params(f"cwd must be an absolute path, got {cwd[:200]!r}")
        if not path.is_dir():
            raise RpcError.invalid_params(f"cwd {cwd[:200]!r} is not a folder")
        return path

    async def _open(self, session: AcpSession, servers: list[McpServer]) -> None:
        tools: list[Any] = []
        if servers:
            holder = self._mcp[session.id] = McpHolder(session.id)
            assert self._group is not None
            tools = await holder.start(self._group, servers, str(session.workspace.root))
        from freetoken_agent.tools import coding_tools

        session.client_reads_buffers = self._client_reads
        session.registry = AcpToolRegistry([*coding_tools(), plan_tool(session.send), *tools], session)
        self.sessions[session.id] = session
        self._start_loading()

    async def new_session(self, params: dict[str, Any]) -> dict[str, Any]:
        request = NewSessionParams.model_validate(params)
        session = AcpSession(self.conn, self._cwd(request.cwd), mode=self.options.mode,
                             store=self.store)
        await self._open(session, request.mcp_servers)
        session.save()
        return {"sessionId": session.id, "modes": self._modes(session)}

    def _store(self) -> SessionStore:
        if self.store is None:
            raise RpcError.not_found("this agent does not keep sessions (it was started with --no-sessions)")
        return self.store

    async def _reopen(self, session_id: str, cwd: str, servers: list[McpServer]) -> AcpSession:
        live = self.sessions.get(session_id)
        if live is not None:
            return live
        record = self._store().load(session_id)
        session = AcpSession(self.conn, self._cwd(cwd), session_id=session_id, mode=self.options.mode,
                             store=self.store)
        session.restore(record)
        await self._open(session, servers)
        return session

    async def load_session(self, params: dict[str, Any]) -> dict[str, Any]:
        request = LoadSessionParams.model_validate(params)
        session = await self._reopen(request.session_id, request.cwd, request.mcp_servers)
        await session.replay()
        return {"modes": self._modes(session)}

    async def list_sessions(self, params: dict[str, Any]) -> dict[str, Any]:
        request = ListSessionsParams.model_validate(params)
        return self._store().list(request.cwd, request.cursor)

    async def resume_session(self, params: dict[str, Any]) -> dict[str, Any]:
        request = LoadSessionParams.model_validate(params)
        session = await self._reopen(request.session_id, request.cwd, request.mcp_servers)
        return {"modes": self._modes(session)}

    def _session(self, session_id: str) -> AcpSession:
        session = self.sessions.get(session_id)
        if session is None:
            raise RpcError.not_found(f"unknown session {session_id[:100]!r}")
        return session

    async def close_session(self, params: dict[str, Any]) -> dict[str, Any]:
        session = self._session(SessionParams.model_validate(params).session_id)
        session.cancel()
        self.sessions.pop(session.id, None)
        holder = self._mcp.pop(session.id, None)
        if holder is not None:
            holder.stop()
        return {}

    async def set_mode(self, params: dict[str, Any]) -> dict[str, Any]:
        request = SetModeParams.model_validate(params)
        session = self._session(request.session_id)
        if request.mode_id not in MODES:
            raise RpcError.invalid_params(f"unknown mode {request.mode_id[:100]!r}; modes: {', '.join(MODES)}")
        session.mode = request.mode_id
        session.send({"sessionUpdate": "current_mode_update", "currentModeId": session.mode})
        return {}

    # ---------------------------------------------------------------------------------------------- prompts
    async def prompt(self, params: dict[str, Any]) -> dict[str, Any]:
        request = PromptParams.model_validate(params)
        session = self._session(request.session_id)
        task = prompt_text(request.prompt, session.workspace)
        if not task.strip():
            raise RpcError.invalid_params("the prompt is empty")
        return await session.prompt(task, self._agent, lambda: self._context_size)

    async def cancel(self, params: dict[str, Any]) -> None:
        session = self.sessions.get(SessionParams.model_validate(params).session_id)
        if session is not None:
            session.cancel()
