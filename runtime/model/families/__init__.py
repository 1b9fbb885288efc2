"""Adapters for the architectures beyond the core twelve, grouped by family; importing registers them."""

from freetoken_agent.runtime.model.families import hybrid, llama4, mla, sigmoid, softmax  # noqa: F401
from freetoken_agent.runtime.model.families import inkling  # noqa: F401,E402
from freetoken_agent.runtime.model.families import deepseek_v4  # noqa: F401,E402
from freetoken_agent.runtime.model.families import gemma4  # noqa: F401,E402
from freetoken_agent.runtime.model.families import zaya  # noqa: F401,E402
from freetoken_agent.runtime.model.families import qwen4  # noqa: F401,E402
from freetoken_agent.runtime.model.families import ergo  # noqa: F401,E402
