"""The HTTP server for any backend (``freetoken serve``: OpenAI chat/completions/Responses and Anthropic Messages),
and a helper to run one in a thread."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

from freetoken_agent.server.app import OpenAIServer

__all__ = ["OpenAIServer", "is_loopback", "serve", "serve_in_thread"]


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or name) only reaches this machine."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _server(backend: Any, model_id: str, log_level: str, default_max_tokens: int = 1024,
            api_key: str | None = None) -> Any:
    import uvicorn

    app = OpenAIServer(backend, model_id, default_max_tokens, api_key).app()
    return uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="off", timeout_graceful_shutdown=2))


def serve(backend: Any, model_id: str, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
          default_max_tokens: int = 1024, api_key: str | None = None) -> None:
    """Serve ``backend`` until interrupted (blocking); with ``api_key`` every route needs it."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    _server(backend, model_id, log_level, default_max_tokens, api_key).run(sockets=[sock])


@contextlib.contextmanager
def serve_in_thread(backend: Any, model_id: str = "freetoken", host: str = "127.0.0.1",
                    api_key: str | None = None) -> Iterator[str]:
    """Run a server on a free port in a background thread; yields its API root (``http://127.0.0.1:PORT/v1``)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    server = _server(backend, model_id, "warning", api_key=api_key)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the OpenAI-compatible server did not start")
        time.sleep(0.01)
    try:
        yield f"http://{host}:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=5)
        sock.close()
