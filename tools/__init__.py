"""Typed tool registry and sandboxed coding tools (``freetoken_agent.tools``). Never imports the runtime."""
