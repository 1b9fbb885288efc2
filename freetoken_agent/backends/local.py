"""``LocalEngine``: the in-process runtime as a backend — the model's own chat template, streaming, phase hints."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from typing import Any

from freetoken_agent.backends.base import GenerateRequest, GenerationDone, TextBackend, TextChunk
from freetoken_agent.chat import detect_format
from freetoken_agent.events import Usage
from freetoken_agent.phases import Phase


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: tool-call arguments as objects, not JSON strings."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            fixed = []
            for call in calls:
                fn = dict(call.get("function", {}))
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"] or "{}")
                    except json.JSONDecodeError:
                        pass  # keep the text; the template renders it as is
                fixed.append({**call, "function": fn})
            message = {**message, "tool_calls": fixed}
        out.append(message)
    return out


class LocalEngine(TextBackend):
    """A backend around a runtime ``Engine`` in this process.

    The prompt is rendered with the model's chat template (tools included); tool calls are parsed in the format
    the template reveals (or ``tool_format``); phase hints go to the engine.
    """

    def __init__(self, engine: Any, tool_format: str | None = None) -> None:
        self.engine = engine
        config = {"model_type": getattr(getattr(engine, "spec", None), "model_type", "")}
        self.tool_format = tool_format or detect_format(engine.chat_template, config)
        self._eos = set(engine.eos_token_ids)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str], device: str = "cpu", dtype: str = "float32",
                        tool_format: str | None = None) -> LocalEngine:
        """Load a Hugging Face model folder with the runtime engine."""
        from freetoken_agent.runtime.engine import Engine

        return cls(Engine.from_pretrained(path, device=device, dtype=dtype, require_tokenizer=True), tool_format)

    def hint(self, phase: Phase, expected_s: float | None = None) -> None:
        self.engine.hint(phase, expected_s)

    def stats(self) -> dict[str, Any] | None:
        return self.engine.stats()

    def render(self, request: GenerateRequest) -> str:
        """The prompt text for ``request``."""
        if request.prompt is not None:
            return request.prompt
        return self.engine.render_chat(template_messages(request.messages), request.tools or None,
                                       add_generation_prompt=True)

    async def stream_text(self, request: GenerateRequest) -> AsyncIterator[TextChunk | GenerationDone]:
        ids = self.engine.tokenizer.encode(self.render(request))
        greedy = request.temperature <= 0 or request.top_p <= 0
        sampling = {"max_new_tokens": request.max_tokens, "temperature": 0.0 if greedy else request.temperature,
                    "top_p": 1.0 if greedy else request.top_p, "seed": request.seed, "stop": tuple(request.stop)}
        count, finish = 0, "length"
        async for event in self.engine.stream(ids, **sampling):
            count += 1
            text = event.text
            if event.finish_reason == "stop" and event.token_id in self._eos:
                eos_text = self.engine.tokenizer.decode([event.token_id])
                text = text[: -len(eos_text)] if eos_text and text.endswith(eos_text) else text
            if text:
                yield TextChunk(text)
            finish = event.finish_reason or finish
        yield GenerationDone(finish, Usage(len(ids), count))
