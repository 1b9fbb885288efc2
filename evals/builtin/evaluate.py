"""Held-out perplexity of a model on a token stream."""

from __future__ import annotations

import math

import torch
from freetoken_agent.evals.builtin.corpus import IGNORE, ChatDocs, chat_batch, windows


@torch.no_grad()
def perplexity(model, stream: torch.Tensor, seq_len: int, max_windows: int | None = None,
               batch: int = 8) -> tuple[float, int]:
    """``(perplexity, tokens scored)`` of next-token prediction over non-overlapping ``seq_len`` windows.

    Each window is scored independently (no context carried across windows), so the first token of each window
    is never a target; ``max_windows`` limits the cost (evenly spaced windows) for the during-training checks.
    """
    rows = windows(stream, seq_len)
    if max_windows is not None and rows.shape[0] > max_windows:
        rows = rows[torch.linspace(0, rows.shape[0] - 1, max_windows).long()]
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, rows.shape[0], batch):
        ids = rows[i: i + batch]
        logits = model(input_ids=ids).logits.float()  # [B, S, V]
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum")
        total += float(loss)
        count += ids[:, 1:].numel()
    model.train(was_training)
    return math.exp(total / max(count, 1)), count


@torch.no_grad()
def chat_perplexity(model, docs: ChatDocs, batch: int = 8) -> tuple[float, int]:
    """``(perplexity, tokens scored)`` of the labelled (assistant) tokens of whole chat documents."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(docs.ids), batch):
        rows = ChatDocs(docs.ids[i: i + batch], docs.labels[i: i + batch])
        ids, labels, mask = chat_batch(rows, len(rows.ids), None)
        logits = model(input_ids=ids, attention_mask=mask).logits.float()  # [B, S, V]
        targets = labels[:, 1:].reshape(-1)
        total += float(torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), targets, ignore_index=IGNORE, reduction="sum"))
        count += int((targets != IGNORE).sum())
    model.train(was_training)
    return math.exp(total / max(count, 1)), count
