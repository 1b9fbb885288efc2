"""``<think>...</think>`` reasoning (Qwen3, DeepSeek-R1, GLM, MiniMax) split out of streamed text, so servers can
answer it as reasoning (OpenAI ``reasoning_content``, Anthropic thinking blocks, Responses reasoning items)."""

from __future__ import annotations

from freetoken_agent.chat.events import TextDelta

OPEN, CLOSE = "<think>", "</think>"


class ThinkSplitter:
    """Streaming: text deltas in, text deltas out with the text between the tags marked ``reasoning`` (the tags
    dropped). A tail that may be the start of a tag is held back until the next delta or :meth:`finish`."""

    def __init__(self) -> None:
        self.inside = False
        self._buf = ""

    def feed(self, delta: TextDelta) -> list[TextDelta]:
        if delta.reasoning:  # a parser that already knows its reasoning channel (harmony)
            return [*self.finish(), delta]
        self._buf += delta.text
        out: list[TextDelta] = []
        while True:
            tag = CLOSE if self.inside else OPEN
            at = self._buf.find(tag)
            if at == -1:
                break
            if at:
                out.append(TextDelta(self._buf[:at], self.inside))
            self._buf = self._buf[at + len(tag):]
            self.inside = not self.inside
        hold = max((n for n in range(1, len(tag)) if self._buf.endswith(tag[:n])), default=0)
        if len(self._buf) > hold:
            out.append(TextDelta(self._buf[: len(self._buf) - hold], self.inside))
            self._buf = self._buf[len(self._buf) - hold:]
        return out

    def finish(self) -> list[TextDelta]:
        """Release what was held back."""
        out = [TextDelta(self._buf, self.inside)] if self._buf else []
        self._buf = ""
        return out
