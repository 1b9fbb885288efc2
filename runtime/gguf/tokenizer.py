"""The tokenizer and chat template stored in a GGUF file's metadata, as the engine's ``Tokenizer`` / ``ChatTemplate``.

A ``tokenizers.Tokenizer`` is built from ``tokenizer.ggml.*``, the way llama.cpp tokenizes with it:

- ``gpt2`` (byte-level BPE): ``tokens`` + ``merges``; the split regex is chosen by ``tokenizer.ggml.pre`` (the
  pre-tokenizer type llama.cpp's converter identified), then byte-level mapping; llama3-style types skip merges for
  words that are whole tokens (``ignore_merges``, as llama.cpp does for them).
- ``llama`` (SentencePiece): ``tokens`` + ``scores``: BPE whose merges are every split of a piece into two pieces,
  ranked by the merged piece's score (llama.cpp merges the best-scoring bigram first), byte fallback to the
  ``<0xXX>`` tokens, ``▁`` for spaces and a leading ``▁`` unless ``add_space_prefix`` is false.

Control tokens (type 3) become special added tokens, user-defined ones (type 4) plain added tokens; both are matched
in the text before the model runs, like llama.cpp with special-token parsing on. Other vocabulary models (``bert``,
``t5``, ``rwkv``, ...) and pre-tokenizer types not listed in ``PRE_TOKENIZERS`` raise ``TokenizerError`` by name.
"""

from __future__ import annotations

from typing import Any

from freetoken_agent.runtime.errors import TokenizerError
from freetoken_agent.runtime.tokenizer.chat import ChatTemplate
from freetoken_agent.runtime.tokenizer.tokenizer import Tokenizer

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
"""llama.cpp token types (``tokenizer.ggml.token_type``)."""

_GPT2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3 = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
           r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
_QWEN2 = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"""
          r"""\s+(?!\S)|\s+""")
_GPT4O = (r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"""
          r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"""
          r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"""
          r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"""
          r"""\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+""")

PRE_TOKENIZERS: dict[str, tuple[str, bool]] = {
    "default": (_GPT2, False), "gpt2": (_GPT2, False), "gpt-2": (_GPT2, False), "olmo": (_GPT2, False),
    "llama3": (_LLAMA3, True), "llama-v3": (_LLAMA3, True), "llama-bpe": (_LLAMA3, True), "smaug-bpe": (_LLAMA3, False),
    "dbrx": (_LLAMA3, False), "qwen2": (_QWEN2, False), "gpt-4o": (_GPT4O, False),
}
"""``tokenizer.ggml.pre`` → (split regex, ignore_merges), as llama.cpp's ``llama-vocab.cpp`` defines them."""


def _added(tokens: list[str], types: list[int] | None) -> tuple[list[Any], list[Any]]:
    from tokenizers import AddedToken

    special, user = [], []
    for tok, kind in zip(tokens, types or [NORMAL] * len(tokens)):
        if kind == CONTROL:
            special.append(AddedToken(tok, special=True, normalized=False))
        elif kind == USER_DEFINED:
            user.append(AddedToken(tok, special=False, normalized=False))
    return special, user


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)  # a repeated piece keeps its first id, as llama.cpp's text→token map does
    return vocab


def _gpt2(meta: dict[str, Any], tokens: list[str]) -> Any:
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    if pre not in PRE_TOKENIZERS:
        raise TokenizerError(f"GGUF pre-tokenizer type {pre!r} (tokenizer.ggml.pre) is not supported; supported: "
                             f"{', '.join(sorted(PRE_TOKENIZERS))}")
    merges_raw = meta.get("tokenizer.ggml.merges")
    if merges_raw is None:
        raise TokenizerError("GGUF BPE vocabulary without tokenizer.ggml.merges")
    merges = []
    for m in merges_raw:
        left, sep, right = m.partition(" ")
        if not sep:
            raise TokenizerError(f"GGUF merge {m!r} is not two tokens separated by a space")
        merges.append((left, right))
    pattern, ignore_merges = PRE_TOKENIZERS[pre]
    tok = HFTokenizer(models.BPE(_vocab(tokens), merges, ignore_merges=ignore_merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(meta: dict[str, Any], tokens: list[str], types: list[int] | None) -> Any:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers

    scores = meta.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise TokenizerError("GGUF SentencePiece vocabulary without one tokenizer.ggml.scores entry per token")
    kinds = types or [NORMAL] * len(tokens)
    vocab = _vocab(tokens)
    mergeable = {t: i for t, i in vocab.items() if kinds[i] in (NORMAL, UNUSED, USER_DEFINED)}
    merges = []
    for piece, i in mergeable.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in mergeable and right in mergeable:
                merges.append((-float(scores[i]), mergeable[left], mergeable[right], left, right))
    merges.sort()
    unk = next((tokens[i] for i, k in enumerate(kinds) if k == UNKNOWN), None)
    tok = HFTokenizer(models.BPE(vocab, [(m[3], m[4]) for m in merges], unk_token=unk, byte_fallback=True,
                                 fuse_unk=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend("▁")] if prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     *([decoders.Strip(" ", 1, 0)] if prefix else [])])
    return tok


def tokenizer_from_metadata(meta: dict[str, Any]) -> Tokenizer:
    """The engine's ``Tokenizer`` for a GGUF file's ``tokenizer.ggml.*`` metadata (``TokenizerError`` if absent)."""
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if kind is None or tokens is None:
        raise TokenizerError("the GGUF file holds no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens)")
    tokens = [str(t) for t in tokens]
    types = meta.get("tokenizer.ggml.token_type")
    if types is not None and len(types) != len(tokens):
        raise TokenizerError(f"GGUF tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    if kind == "gpt2":
        backend = _gpt2(meta, tokens)
        add_bos_default = False
    elif kind == "llama":
        backend = _sentencepiece(meta, tokens, types)
        add_bos_default = True
    else:
        raise TokenizerError(f"GGUF tokenizer model {kind!r} (tokenizer.ggml.model) is not supported; supported: "
                             "gpt2 (BPE), llama (SentencePiece)")
    special, user = _added(tokens, types)
    backend.add_special_tokens(special)
    backend.add_tokens(user)

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    config = {"bos_token": token("bos"), "eos_token": token("eos"), "unk_token": token("unknown"),
              "pad_token": token("padding"),
              "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)),
              "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False))}
    added = {t.content: vocab_id for t in special + user if (vocab_id := backend.token_to_id(t.content)) is not None}
    return Tokenizer(backend, "tokenizers", config, added)


def chat_template_from_metadata(meta: dict[str, Any], tokenizer: Tokenizer | None) -> ChatTemplate | None:
    """``tokenizer.chat_template`` of the file (None when it has none), with the special tokens as variables."""
    source = meta.get("tokenizer.chat_template")
    if not source:
        return None
    special: dict[str, str] = {}
    if tokenizer is not None:
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            if tokenizer.config.get(key):
                special[key] = tokenizer.config[key]
    return ChatTemplate(str(source), special)


END_OF_GENERATION = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                     "<|end_of_text|>", "<EOT>", "_<EOT>", "<|end▁of▁sentence|>", "<|return|>", "<|call|>",
                     "<end_of_utterance>")
"""Control-token texts llama.cpp treats as end of generation whatever the metadata says (``llama-vocab.cpp``)."""


def stop_token_ids(meta: dict[str, Any]) -> list[int]:
    """Ids llama.cpp stops on: eos, end-of-turn and end-of-message when the file names them, and control tokens
    whose text marks an end of generation (``END_OF_GENERATION``)."""
    ids = []
    for key in ("eos", "eot", "eom"):
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        if i is not None and int(i) not in ids:
            ids.append(int(i))
    tokens, types = meta.get("tokenizer.ggml.tokens") or [], meta.get("tokenizer.ggml.token_type")
    for i, tok in enumerate(tokens):
        if tok in END_OF_GENERATION and (types is None or types[i] == CONTROL) and i not in ids:
            ids.append(i)
    return ids
