"""One tokenizer interface over Hugging Face ``tokenizer.json`` files and tiktoken BPE vocabularies."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from freetoken_agent.runtime.errors import TokenizerError

# The split pattern of cl100k/o200k-style vocabularies, used when a tiktoken folder does not name its own.
_DEFAULT_TIKTOKEN_PATTERN = (
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"""
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"""
    r"""\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_TIKTOKEN_FILES = ("tiktoken.model", "tokenizer.model.tiktoken")


def token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def read_tokenizer_config(path: Path) -> dict[str, Any]:
    file = path / "tokenizer_config.json"
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"cannot parse {file}: {exc}") from None
    return data if isinstance(data, dict) else {}


class Tokenizer:
    """Encode/decode text for a model folder. Special tokens come from ``tokenizer_config.json``."""

    def __init__(self, backend: Any, kind: str, config: dict[str, Any], special: dict[str, int]) -> None:
        self._backend, self.kind, self.config = backend, kind, config
        self.special_tokens = special
        """Special/added token text → id."""
        self._special_ids = set(special.values())
        self.bos_token = token_content(config.get("bos_token"))
        self.eos_token = token_content(config.get("eos_token"))
        self.add_bos = bool(config.get("add_bos_token", False))

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        config = read_tokenizer_config(path)
        if (path / "tokenizer.json").is_file():
            return cls._from_tokenizers(path / "tokenizer.json", config)
        for name in _TIKTOKEN_FILES:
            if (path / name).is_file():
                return cls._from_tiktoken(path / name, config)
        raise TokenizerError(
            f"no tokenizer in {path}: expected tokenizer.json or a tiktoken vocabulary ({', '.join(_TIKTOKEN_FILES)})"
        )

    @classmethod
    def _from_tokenizers(cls, file: Path, config: dict[str, Any]) -> Tokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        try:
            backend = HFTokenizer.from_file(str(file))
        except Exception as exc:  # tokenizers raises a generic Exception on malformed files
            raise TokenizerError(f"cannot load {file}: {exc}") from None
        special = {tok.content: idx for idx, tok in backend.get_added_tokens_decoder().items()}
        return cls(backend, "tokenizers", config, special)

    @classmethod
    def _from_tiktoken(cls, file: Path, config: dict[str, Any]) -> Tokenizer:
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        try:
            ranks = load_tiktoken_bpe(str(file))
        except Exception as exc:  # base64/format errors surface as assorted exception types
            raise TokenizerError(f"cannot load tiktoken vocabulary {file}: {exc}") from None
        special: dict[str, int] = {}
        for idx, entry in (config.get("added_tokens_decoder") or {}).items():
            content = token_content(entry)
            if content is not None:
                special[content] = int(idx)
        backend = tiktoken.Encoding(
            name=file.parent.name,
            pat_str=config.get("pat_str", _DEFAULT_TIKTOKEN_PATTERN),
            mergeable_ranks=ranks,
            special_tokens=special,
        )
        return cls(backend, "tiktoken", config, special)

    # ------------------------------------------------------------------------------------------------ api

    @property
    def vocab_size(self) -> int:
        if self.kind == "tokenizers":
            return self._backend.get_vocab_size(with_added_tokens=True)
        return self._backend.n_vocab

    def token_id(self, text: str | None) -> int | None:
        if text is None:
            return None
        if text in self.special_tokens:
            return self.special_tokens[text]
        if self.kind == "tokenizers":
            return self._backend.token_to_id(text)
        return None

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.token_id(self.eos_token)
        return [] if eos is None else [eos]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. Special-token text inside ``text`` maps to its special id (chat prompts)."""
        if self.kind == "tokenizers":
            ids = self._backend.encode(text, add_special_tokens=False).ids
        else:
            ids = self._backend.encode(text, allowed_special="all")
        if add_special_tokens and self.add_bos and (bos := self.token_id(self.bos_token)) is not None:
            ids = [bos, *ids]
        return list(ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special_ids]
        if self.kind == "tokenizers":
            return self._backend.decode(list(ids), skip_special_tokens=False)
        return self._backend.decode(list(ids), errors="replace")


class IncrementalDecoder:
    """Turns a growing list of token ids into text deltas without splitting multi-byte characters."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # ids before this index are fully emitted
        self._emitted = ""  # text of ids[_prefix:] already emitted

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids[self._prefix :], self.skip)
        if text.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 sequence: wait for the next token
        delta = text[len(self._emitted) :]
        # Re-anchor on the newest few ids so decode cost stays O(1) per token.
        if len(self.ids) - self._prefix > 8:
            self._prefix = len(self.ids) - 4
            self._emitted = self.tokenizer.decode(self.ids[self._prefix :], self.skip)
        else:
            self._emitted = text
        return delta
