"""Per-request logits processors (``SamplingParams.processor``): repetition penalties (OpenAI's frequency/presence
and the multiplicative one of transformers, vLLM and llama.cpp), logit biases, min-p, and a recorder of log
probabilities. Each sees one sequence's logits [V] before the pick and learns the picked token, so they run per
sequence inside the batched sampler like the grammar mask (``constraints.py``); ``Chain`` runs several.

Dimensions: V = the model's vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from freetoken_agent.runtime.generation.sampling import LogitsProcessor


class Chain:
    """Several processors in order (each sees the logits the previous one returned)."""

    def __init__(self, processors: Sequence[LogitsProcessor]) -> None:
        self.processors = list(processors)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        for processor in self.processors:
            logits = processor(logits)
        return logits

    def accept(self, token: int) -> None:
        for processor in self.processors:
            processor.accept(token)


class Penalties:
    """OpenAI's penalties over the tokens generated so far: ``frequency`` × count + ``presence`` × [count > 0]
    subtracted from each such token's logit."""

    def __init__(self, frequency: float, presence: float) -> None:
        self.frequency, self.presence = frequency, presence
        self.counts: dict[int, int] = {}

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.counts:
            return logits
        ids = torch.tensor(list(self.counts), dtype=torch.long)
        counts = torch.tensor(list(self.counts.values()), dtype=torch.float32)
        out = logits.float().clone()  # [V]
        out[ids] -= self.frequency * counts + self.presence
        return out

    def accept(self, token: int) -> None:
        self.counts[token] = self.counts.get(token, 0) + 1


class RepetitionPenalty:
    """The multiplicative repetition penalty (transformers' ``RepetitionPenaltyLogitsProcessor``, vLLM's and
    llama.cpp's ``repetition_penalty``): every token seen so far — in the prompt or generated — has a positive logit
    divided by ``penalty`` and a negative one multiplied by it (``penalty`` > 1 discourages repeats, < 1 favors
    them). Each token counts once however often it occurred."""

    def __init__(self, penalty: float, prompt: Sequence[int] = ()) -> None:
        if not penalty > 0:
            raise ValueError(f"repetition penalty must be > 0, got {penalty!r}")
        self.penalty = penalty
        self.seen: dict[int, None] = dict.fromkeys(int(t) for t in prompt)
        """Token ids seen so far, in first-seen order (a dict as an ordered set)."""
        self._ids: torch.Tensor | None = None  # self.seen as a tensor, rebuilt when a new token joins it

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.seen or self.penalty == 1.0:
            return logits
        if self._ids is None:
            self._ids = torch.tensor(list(self.seen), dtype=torch.long)
        ids = self._ids[(self._ids >= 0) & (self._ids < logits.shape[-1])]
        out = logits.float().clone()  # [V]
        score = out[ids]
        out[ids] = torch.where(score < 0, score * self.penalty, score / self.penalty)
        return out

    def accept(self, token: int) -> None:
        if token not in self.seen:
            self.seen[token] = None
            self._ids = None


class LogitBias:
    """Adds a fixed bias to chosen tokens' logits (OpenAI ``logit_bias``: -100 bans a token, 100 forces it)."""

    def __init__(self, bias: dict[int, float]) -> None:
        self.ids = torch.tensor(list(bias), dtype=torch.long)
        self.values = torch.tensor(list(bias.values()), dtype=torch.float32)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        out = logits.float().clone()  # [V]
        out[self.ids] += self.values
        return out

    def accept(self, token: int) -> None:
        """Stateless."""


class MinP:
    """Drops tokens whose probability (at ``temperature``) is below ``p`` × the top token's."""

    def __init__(self, p: float, temperature: float) -> None:
        self.p, self.temperature = p, temperature

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.temperature <= 0 or self.p <= 0:
            return logits
        logits = logits.float()
        # p_i / p_max = exp((l_i - l_max) / T) < p  ⇔  l_i < l_max + T·ln p
        floor = logits.max() + self.temperature * math.log(self.p)
        return logits.masked_fill(logits < floor, float("-inf"))

    def accept(self, token: int) -> None:
        """Stateless."""


@dataclass(frozen=True)
class TokenLogprob:
    """The picked token's log probability and the ``top`` most likely tokens' (id, log probability)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


class LogprobRecorder:
    """Records, per pick, the log probabilities of the distribution the sampler drew from (after the processors
    before it: biases, penalties, grammar), with the ``top`` most likely tokens. Put it last in a ``Chain``."""

    def __init__(self, top: int) -> None:
        self.top = top
        self.entries: list[TokenLogprob] = []
        self._last: torch.Tensor | None = None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        self._last = torch.log_softmax(logits.float(), dim=-1)  # [V]
        return logits

    def accept(self, token: int) -> None:
        assert self._last is not None, "accept() before the logits were seen"
        logprobs = self._last
        top: tuple[tuple[int, float], ...] = ()
        if self.top:
            values, ids = torch.topk(logprobs, min(self.top, logprobs.shape[-1]))
            top = tuple((int(i), float(v)) for i, v in zip(ids, values))
        self.entries.append(TokenLogprob(token, float(logprobs[token]), top))
