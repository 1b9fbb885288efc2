"""Token streams for training and evaluation, cached in the work folder so a resumed run reuses them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import random

import torch
from freetoken_agent.evals.builtin.chat import assistant_mask_spans, chat_conversation
from freetoken_agent.evals.builtin.data import (
    render_session,
    session_files,
    session_messages,
    split_sessions,
    stdlib_sources,
)
from freetoken_agent.evals.builtin.template import BASH_TOOL, render
from freetoken_agent.evals.builtin.tokenizer import train_tokenizer
from tokenizers import Tokenizer

IGNORE = -100
"""Label of a token that is not scored (``transformers``' ignore index)."""
CHAT_HELD_OUT = 96
"""Most chat conversations kept for evaluation (each checkpoint scores them all)."""


@dataclass
class ChatDocs:
    """Conversations as ``ids`` and ``labels`` (1-D int64 each; labels are the ids on assistant turns, else
    :data:`IGNORE`), one document per conversation, never cut into windows."""

    ids: list[torch.Tensor]
    labels: list[torch.Tensor]


@dataclass
class Corpus:
    """The tokenizer, the token streams (1-D int64 tensors of documents joined end to end) and the chat documents."""

    tokenizer: Tokenizer
    train: torch.Tensor
    held_out: torch.Tensor
    held_out_sessions: list[str]
    chat: ChatDocs
    chat_held_out: ChatDocs


def session_openings(sessions: list[Path], turns: int = 1) -> list[str]:
    """Each session's start as a whole document: system prompt, task and the first ``turns`` assistant turns (with
    the tool results between them). Random windows of the stream rarely begin at a task, so without these the chat
    conversations would teach that every first answer is plain text; these keep the agent's first step."""
    texts = []
    for path in sessions:
        messages = session_messages(path)
        assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if assistant:
            texts.append(render(messages[: assistant[min(turns, len(assistant)) - 1] + 1], tools=[BASH_TOOL])
                         + "<|endoftext|>")
    return texts


def chat_docs(tok: Tokenizer, count: int, seed: int, openings: list[str] = ()) -> ChatDocs:
    """``count`` conversations from :func:`chat_conversation` (seeded) plus ``openings`` (as they are), tokenized,
    assistant turns labelled, sorted by length (so that :func:`chat_batch` draws neighbours and pads little)."""
    rng = random.Random(seed)
    texts = [render(*chat_conversation(rng)) + "<|endoftext|>" for _ in range(count)] + list(openings)
    texts.sort(key=len)
    ids, labels = [], []
    for text, enc in zip(texts, tok.encode_batch(texts)):
        spans = assistant_mask_spans(text)
        row = torch.tensor(enc.ids, dtype=torch.int64)
        scored = torch.tensor([any(a <= start < b for a, b in spans) for start, _ in enc.offsets])
        ids.append(row)
        labels.append(torch.where(scored, row, torch.full_like(row, IGNORE)))
    return ChatDocs(ids, labels)


def build_corpus(data_dir: Path, work_dir: Path, vocab: int, stdlib_chars: int, holdout_every: int,
                 chat_count: int = 0, tokenizer: Tokenizer | None = None) -> Corpus:
    """Render, tokenize (training a tokenizer on the training text only, unless ``tokenizer`` is given) and cache;
    reuse the cache if present.

    Training sessions get their closing text turn (:func:`render_session`); ``chat_count`` conversations are made
    for training and a quarter as many, at most :data:`CHAT_HELD_OUT` (another seed), for evaluation."""
    work_dir.mkdir(parents=True, exist_ok=True)
    tok_path, cache_path = work_dir / "tokenizer.json", work_dir / "corpus.pt"
    if tok_path.exists() and cache_path.exists():
        cached = torch.load(cache_path)
        return Corpus(Tokenizer.from_file(str(tok_path)), cached["train"], cached["held_out"], cached["names"],
                      ChatDocs(*cached["chat"]), ChatDocs(*cached["chat_held_out"]))
    split = split_sessions(session_files(data_dir), every=holdout_every)
    train_docs = [render_session(p, closing=True) for p in split.train] + list(stdlib_sources(stdlib_chars))
    held_docs = [render_session(p) for p in split.held_out]
    tok = tokenizer if tokenizer is not None else train_tokenizer(train_docs, vocab)
    if tok.get_vocab_size() != vocab:
        raise ValueError(f"the tokenizer has {tok.get_vocab_size()} ids, the model {vocab}")

    def stream(docs: list[str]) -> torch.Tensor:
        ids = [i for enc in tok.encode_batch(docs) for i in enc.ids]
        return torch.tensor(ids, dtype=torch.int64)

    # each training session's opening, repeated so that about a third of the chat documents are agent first steps
    openings = session_openings(split.train) * max(1, chat_count // (2 * max(len(split.train), 1)))
    corpus = Corpus(tok, stream(train_docs), stream(held_docs), [p.name for p in split.held_out],
                    chat_docs(tok, chat_count, seed=1, openings=openings if chat_count else []),
                    chat_docs(tok, min(chat_count // 4, CHAT_HELD_OUT), seed=2))
    tok.save(str(tok_path))
    torch.save({"train": corpus.train, "held_out": corpus.held_out, "names": corpus.held_out_sessions,
                "chat": (corpus.chat.ids, corpus.chat.labels),
                "chat_held_out": (corpus.chat_held_out.ids, corpus.chat_held_out.labels)}, cache_path)
    return corpus


def windows(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Non-overlapping windows ``[N, seq_len]`` covering the stream (the tail shorter than a window dropped)."""
    n = stream.numel() // seq_len
    return stream[: n * seq_len].view(n, seq_len)


def sample_batch(stream: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    """``batch`` random windows ``[batch, seq_len]`` of the stream, drawn with ``gen``."""
    starts = torch.randint(0, stream.numel() - seq_len, (batch,), generator=gen)
    return torch.stack([stream[s: s + seq_len] for s in starts.tolist()])


def chat_batch(docs: ChatDocs, batch: int, gen: torch.Generator | None,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``batch`` neighbouring documents from a start drawn with ``gen`` (the first ``batch`` when ``gen`` is None),
    right-padded: ``(ids, labels, attention_mask)``, each ``[batch, longest]``."""
    batch = min(batch, len(docs.ids))
    start = 0 if gen is None else int(torch.randint(0, len(docs.ids) - batch + 1, (1,), generator=gen))
    picks = list(range(start, start + batch))
    longest = max(docs.ids[i].numel() for i in picks)
    ids = torch.zeros(batch, longest, dtype=torch.int64)  # pad: <|endoftext|>
    labels = torch.full((batch, longest), IGNORE, dtype=torch.int64)
    mask = torch.zeros(batch, longest, dtype=torch.int64)
    for row, i in enumerate(picks):
        n = docs.ids[i].numel()
        ids[row, :n], labels[row, :n], mask[row, :n] = docs.ids[i], docs.labels[i], 1
    return ids, labels, mask
