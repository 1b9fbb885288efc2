"""Token streams for training and evaluation, cached in the work folder so a resumed run reuses them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from freetoken_agent.evals.builtin.data import (
    render_session,
    session_files,
    split_sessions,
    stdlib_sources,
)
from freetoken_agent.evals.builtin.tokenizer import train_tokenizer
from tokenizers import Tokenizer


@dataclass
class Corpus:
    """The tokenizer and the token streams (1-D int64 tensors of documents joined end to end)."""

    tokenizer: Tokenizer
    train: torch.Tensor
    held_out: torch.Tensor
    held_out_sessions: list[str]


def build_corpus(data_dir: Path, work_dir: Path, vocab: int, stdlib_chars: int, holdout_every: int) -> Corpus:
    """Render, tokenize (training a tokenizer on the training text only) and cache; reuse the cache if present."""
    work_dir.mkdir(parents=True, exist_ok=True)
    tok_path, cache_path = work_dir / "tokenizer.json", work_dir / "corpus.pt"
    if tok_path.exists() and cache_path.exists():
        cached = torch.load(cache_path)
        return Corpus(Tokenizer.from_file(str(tok_path)), cached["train"], cached["held_out"], cached["names"])
    split = split_sessions(session_files(data_dir), every=holdout_every)
    train_docs = [render_session(p) for p in split.train] + list(stdlib_sources(stdlib_chars))
    held_docs = [render_session(p) for p in split.held_out]
    tok = train_tokenizer(train_docs, vocab)

    def stream(docs: list[str]) -> torch.Tensor:
        ids = [i for enc in tok.encode_batch(docs) for i in enc.ids]
        return torch.tensor(ids, dtype=torch.int64)

    corpus = Corpus(tok, stream(train_docs), stream(held_docs), [p.name for p in split.held_out])
    tok.save(str(tok_path))
    torch.save({"train": corpus.train, "held_out": corpus.held_out, "names": corpus.held_out_sessions}, cache_path)
    return corpus


def windows(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Non-overlapping windows ``[N, seq_len]`` covering the stream (the tail shorter than a window dropped)."""
    n = stream.numel() // seq_len
    return stream[: n * seq_len].view(n, seq_len)


def sample_batch(stream: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    """``batch`` random windows ``[batch, seq_len]`` of the stream, drawn with ``gen``."""
    starts = torch.randint(0, stream.numel() - seq_len, (batch,), generator=gen)
    return torch.stack([stream[s: s + seq_len] for s in starts.tolist()])
