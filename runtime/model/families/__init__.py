"""Adapters for the architectures beyond the core twelve, grouped by family; importing registers them."""

from freetoken_agent.runtime.model.families import hybrid, llama4, mla, sigmoid, softmax  # noqa: F401
