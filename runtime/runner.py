"""The model runner: one forward over a ragged batch of sequences, logits of the rows that will be sampled.

The scheduler (``runtime/scheduler.py``) speaks integers — sequences, positions, token budgets — and hands the
runner one ``Row`` per sequence in the step: its cache and the chunk of new tokens (a prefill chunk, or one decode
token). The runner speaks tensors: it runs ``Decoder.forward_batch`` (the one code path that runs the layers) and the
lm_head over only the rows whose logits someone needs. Nothing else in the engine calls the decoder.

Legend: B sequences in the step, T = Σ T_b new tokens, V vocab.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Literal, NamedTuple

import torch

from freetoken_agent.runtime.kernels.ops import prompt_step, torch_heavy
from freetoken_agent.runtime.kv.cache import KVCache
from freetoken_agent.runtime.model.decoder import Decoder

Want = Literal["none", "last", "all", "draft"]


class Row(NamedTuple):
    """One sequence's share of a step."""

    cache: KVCache
    """The sequence's KV (``KVCache`` or ``PagedKVCache``); the chunk's positions continue from its length."""
    tokens: torch.Tensor
    """[T_b] int64 new tokens."""
    want: Want
    """Logits wanted: ``none`` (prefill of a prompt's middle), ``last`` (the next token), ``all`` (verification),
    ``draft`` (speculative decoding: the last ``draft`` + 1 positions: the last real token's and each draft's)."""
    rope_length: int | None = None
    """The sequence's whole known length (length-dependent rotary embeddings turn a chunked prefill by it)."""
    draft: int = 0
    """Draft tokens at the row's end (speculative decoding): a row of one real token and drafts is a decode row."""


class ModelRunner:
    """Runs steps for one decoder. Only the engine's scheduler thread calls ``run``."""

    def __init__(self, decoder: Decoder, decode_torch_threads: int | None = None) -> None:
        self.decoder = decoder
        self.decode_torch_threads = decode_torch_threads
        """Torch threads during decode-only steps (None: unchanged). When the C kernels carry a decode step's big
        products, torch's own ops (norms, RoPE, attention: tiny at one token per sequence) on fewer threads keep two
        spinning pools from taking turns on the same cores."""
        self._saved_threads: int | None = None
        self.steps = 0
        """Forwards run so far."""

    def run(self, rows: list[Row]) -> list[torch.Tensor | None]:
        """One forward over ``rows`` → per row its logits: [1, V] (``last``), [T_b, V] (``all``), [draft + 1, V]
        (``draft``) or None; fp32."""
        prefill = any(int(r.tokens.shape[0]) - r.draft > 1 for r in rows)
        self._threads(decode=not prefill)
        # a step of prompt chunks only (no decode token, no verify row): AMX's default mode runs its bf16 tiles there,
        # while a decode token keeps the bits of its one-token kernels (kernels.ops.set_amx_mode)
        prompts = prefill and all(r.draft == 0 and int(r.tokens.shape[0]) > 1 for r in rows)
        # prefill: torch's threads carry it, so the kernels' idle workers sleep soon instead of polling in their way
        with torch_heavy() if prefill else nullcontext(), prompt_step() if prompts else nullcontext():
            hidden = self.decoder.forward_batch([r.tokens for r in rows], [r.cache for r in rows],
                                                [r.rope_length for r in rows], [r.draft > 0 for r in rows])  # [T, D]
            picks, start = [], 0
            for r in rows:
                n = int(r.tokens.shape[0])
                if r.want == "last":
                    picks.append(hidden[start + n - 1 : start + n])
                elif r.want == "all":
                    picks.append(hidden[start : start + n])
                elif r.want == "draft":
                    picks.append(hidden[start + n - r.draft - 1 : start + n])
                start += n
            logits = self.decoder.logits(torch.cat(picks) if len(picks) > 1 else picks[0]) if picks else None
        self.steps += 1
        out: list[torch.Tensor | None] = []
        at = 0
        for r in rows:
            n = {"none": 0, "last": 1, "all": int(r.tokens.shape[0]), "draft": r.draft + 1}[r.want]
            out.append(logits[at : at + n] if n else None)  # type: ignore[index]
            at += n
        return out

    def _threads(self, decode: bool) -> None:
        n = self.decode_torch_threads
        if n is None:
            return
        if decode and self._saved_threads is None and torch.get_num_threads() != n:
            self._saved_threads = torch.get_num_threads()
            torch.set_num_threads(n)
        elif not decode:
            self.idle()

    def idle(self) -> None:
        """Give torch its threads back (the scheduler calls this when it runs out of work)."""
        if self._saved_threads is not None:
            torch.set_num_threads(self._saved_threads)
            self._saved_threads = None
