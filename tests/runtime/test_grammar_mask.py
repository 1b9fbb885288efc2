"""The grammar mask's bit unpacking (``allowed_tokens``) against a per-token reference, and a grammar's first mask
on a real tokenizer without ``torch.compile`` (which llguidance's own torch helper needs)."""

from __future__ import annotations

import torch
from freetoken_agent.runtime.builtin import builtin_model_dir
from freetoken_agent.runtime.generation.constraints import (
    GrammarProcessor, allowed_tokens, grammar_tokenizer, json_schema_grammar,
)


def reference(words: list[int], vocab: int) -> list[bool]:
    return [t // 32 < len(words) and bool((words[t // 32] >> (t % 32)) & 1) for t in range(vocab)]


def test_bits_unpack_to_the_tokens_they_name() -> None:
    gen = torch.Generator().manual_seed(0)
    for vocab in (1, 31, 32, 33, 100, 8192, 151_669):
        width = (vocab + 31) // 32
        words = torch.randint(-(2**31), 2**31 - 1, (width,), dtype=torch.int32, generator=gen)
        words[0] = -1  # every bit, sign bit included
        if width > 1:
            words[1] = 0
        got = allowed_tokens(words, vocab)
        assert got.dtype == torch.bool and got.shape == (vocab,)
        assert got.tolist() == reference(words.tolist(), vocab)
    # a vocabulary wider than the mask's words: the tokens past them are not allowed
    assert allowed_tokens(torch.tensor([-1], dtype=torch.int32), 40).tolist() == [True] * 32 + [False] * 8


def test_a_json_grammar_masks_the_built_in_vocabulary() -> None:
    path = builtin_model_dir() / "tokenizer.json"
    vocab = 8192
    tokenizer = grammar_tokenizer(path, vocab, (2,))
    proc = GrammarProcessor(tokenizer, json_schema_grammar({"type": "object", "properties": {"a": {"type": "integer"}},
                                                             "required": ["a"], "additionalProperties": False}), vocab)
    logits = torch.randn(vocab)
    out = proc(logits)
    allowed = torch.isfinite(out)
    assert 0 < int(allowed.sum()) < vocab and torch.equal(out[allowed], logits[allowed])
    # the first token of {"a": ...} starts with "{": every allowed token's text does
    from freetoken_agent.runtime.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(builtin_model_dir())
    texts = [tok.decode([int(t)]) for t in torch.nonzero(allowed).flatten()]
    assert texts and all(t.startswith("{") for t in texts)
