"""Constrained decoding: a grammar's token mask applied per request inside the batched sampler.

The grammar engine is llguidance (CPU, Rust; masks computed lazily over a token trie, so a step costs well under a
millisecond for JSON schemas on 150k-token vocabularies). A request carries a :class:`GrammarProcessor` as its
``SamplingParams.processor``: before each pick the tokens the grammar forbids get -inf, and the picked token
advances the grammar's state — so the text is in the grammar whatever the temperature, and end-of-sequence is
allowed only where the grammar may stop. Grammars come from a JSON Schema (:func:`json_schema_grammar`) or Lark
text with embedded ``%json`` schemas (:func:`lark_grammar`).

Dimensions: V = the model's vocabulary (logits), W = ceil(V / 32) (the mask's int32 words).
"""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from freetoken_agent.runtime.errors import FreeTokenError


class GrammarError(FreeTokenError):
    """A grammar or JSON Schema the engine cannot constrain to (or a model without a usable tokenizer)."""


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.torch
    except ImportError:
        raise GrammarError("constrained decoding needs llguidance: pip install llguidance") from None
    return llguidance


JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""JSON is written as ``json.dumps`` writes it (what models see in chat templates), not in free whitespace."""


@functools.lru_cache(maxsize=4)
def grammar_tokenizer(tokenizer_json: Path, vocab: int, eos: tuple[int, ...]) -> Any:
    """llguidance's view of a ``tokenizer.json``, built and warmed once per file: the first mask over a vocabulary
    precomputes its token trie and slices (seconds on a busy CPU), which no request should wait for."""
    ll = _llguidance()
    try:
        tokenizer = ll.LLTokenizer(str(tokenizer_json), n_vocab=vocab, eos_token=list(eos))
    except (ValueError, RuntimeError) as exc:
        raise GrammarError(f"cannot read {tokenizer_json} for constrained decoding: {exc}") from None
    GrammarProcessor(tokenizer, json_schema_grammar({"type": "string"}), vocab)(torch.zeros(vocab))
    return tokenizer


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """A grammar for one JSON value valid under ``schema`` (compact, no whitespace between tokens)."""
    ll = _llguidance()
    try:
        return ll.LLMatcher.grammar_from_json_schema(json.dumps(styled(schema)))
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"cannot constrain to this JSON Schema: {exc}") from None


def styled(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with the JSON layout (``JSON_STYLE``) the grammar should produce."""
    return {**schema, "x-guidance": {**JSON_STYLE, **schema.get("x-guidance", {})}}


def lark_grammar(text: str) -> str:
    """A grammar from Lark text (``%json {...}`` embeds a JSON Schema)."""
    return _llguidance().LLMatcher.grammar_from_lark(text)


_BITS = torch.arange(8, dtype=torch.uint8)


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[V] bool from a grammar engine's token bitmask (int32 [ceil(V/32)], token t allowed when bit t % 32 of word
    t // 32 is set). Plain torch: ``llguidance.torch.apply_token_bitmask_inplace`` is a ``torch.compile`` kernel that
    costs every server process 10-26 s and a C compiler on its first constrained request."""
    words = bitmask.contiguous()
    if sys.byteorder == "little":  # byte k of a word holds its bits 8k .. 8k+7
        bits = (words.view(torch.uint8).unsqueeze(-1) >> _BITS) & 1  # [4W, 8]
    else:
        bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1  # [W, 32]
    allowed = bits.flatten()[:vocab].bool()
    if allowed.shape[0] < vocab:  # tokens past the mask's words are never allowed
        allowed = torch.cat([allowed, allowed.new_zeros(vocab - allowed.shape[0])])
    return allowed


class GrammarProcessor:
    """A ``LogitsProcessor`` holding one request's grammar state (see ``SamplingParams.processor``)."""

    def __init__(self, tokenizer: Any, grammar: str, vocab: int) -> None:
        ll = _llguidance()
        self._torch = ll.torch
        self.matcher = ll.LLMatcher(tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(f"the grammar is not usable: {self.matcher.get_error()}")
        self.vocab = vocab
        self.mask = self._torch.allocate_token_bitmask(1, vocab)  # [1, W] int32
        self.steps = 0
        self.mask_s = 0.0
        """Seconds spent computing and applying masks (the constraint's whole cost per request)."""

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [V] with -inf wherever the grammar forbids the token."""
        t0 = time.perf_counter()
        self._torch.fill_next_token_bitmask(self.matcher, self.mask, 0)
        out = logits.float().clone()  # [V]
        out.masked_fill_(~allowed_tokens(self.mask[0], out.shape[0]), float("-inf"))
        self.mask_s += time.perf_counter() - t0
        return out

    def accept(self, token: int) -> None:
        """Advance the grammar by the picked token (always one the mask allowed)."""
        self.steps += 1
        if not self.matcher.consume_token(token):
            raise GrammarError(f"token {token} broke the grammar: {self.matcher.get_error()}")

    @property
    def accepting(self) -> bool:
        """Whether the text so far is a complete sentence of the grammar."""
        return bool(self.matcher.is_accepting())
