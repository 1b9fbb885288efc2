"""Chat templates rendered with Jinja2, with Hugging Face semantics.

Like transformers: a sandboxed environment with ``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` extension,
``raise_exception`` and ``strftime_now`` globals, a ``tojson`` filter that keeps non-ASCII text, and the special
tokens of ``tokenizer_config.json`` as variables. The template comes from ``tokenizer_config.json``
(``chat_template``: a string, or a list of named templates) or from a ``chat_template.jinja`` file.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from freetoken_agent.runtime.errors import TokenizerError
from freetoken_agent.runtime.tokenizer.tokenizer import token_content, read_tokenizer_config

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatTemplate:
    """A compiled chat template plus the special-token variables it may reference."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None) -> None:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        try:
            self._template = env.from_string(source)
        except TemplateError as exc:
            raise TokenizerError(f"invalid chat template: {exc}") from None

    @classmethod
    def from_pretrained(cls, path: str | Path, name: str | None = None) -> ChatTemplate | None:
        """The folder's chat template (``name`` selects among named templates), or None if it has none."""
        path = Path(path)
        config = read_tokenizer_config(path)
        source = config.get("chat_template")
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get(name or "default") or (named.get("tool_use") if name == "tool_use" else None)
            if source is None and named:
                source = next(iter(named.values()))
        if source is None and (path / "chat_template.jinja").is_file():
            source = (path / "chat_template.jinja").read_text(encoding="utf-8")
        if not source:
            return None
        special = {k: v for k in _SPECIAL_KEYS if (v := token_content(config.get(k))) is not None}
        return cls(source, special)

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Render a conversation (OpenAI-style message dicts) to the prompt text."""
        from jinja2 import TemplateError

        variables = {**self.special_tokens, **kwargs}
        try:
            return self._template.render(
                messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **variables
            )
        except TemplateError as exc:
            raise TokenizerError(f"chat template failed: {exc}") from None
