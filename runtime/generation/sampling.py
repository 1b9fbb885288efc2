"""Sampling (greedy, temperature, top-k, top-p, seeded) and stop conditions (tokens, strings, length)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from freetoken_agent.runtime.errors import FreeTokenError, SamplingError
from freetoken_agent.runtime.rules import Int, Num, Rule

SAMPLING_RULES: dict[str, Rule] = {
    "max_new_tokens": Int(0),
    "temperature": Num(0),
    "top_k": Int(0),
    "top_p": Num(0, 1, low_open=True),
    "seed": Int(-(2**63), 2**64 - 1, nullable=True),  # what torch.Generator.manual_seed takes
}
"""What each numeric ``SamplingParams`` field may hold; the CLI parses its flags with the same rules."""


class NumericalError(FreeTokenError):
    """The model produced NaN logits (weights with NaN/infinity loaded unchecked, or an fp16 overflow)."""


NAN_LOGITS = ("the model produced NaN logits: a weight holds NaN/infinity (was the checkpoint loaded with "
              "FREETOKEN_CHECK_WEIGHTS=0?) or float16 overflowed (try bfloat16)")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. ``temperature == 0`` is greedy (argmax)."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    """Keep only the k most likely tokens (0: off)."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches p (1.0: off)."""
    seed: int | None = None
    stop: tuple[str, ...] = ()
    """Stop when the generated text contains one of these; the text is cut before it."""
    stop_token_ids: tuple[int, ...] | None = None
    """Token ids that end generation (None: the model's end-of-sequence tokens)."""
    processor: LogitsProcessor | None = field(default=None, compare=False)
    """A per-request hook over each step's logits (a grammar's token mask: ``generation/constraints.py``)."""
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        """Refuse a value of the wrong type or out of range with one ``SamplingError`` naming the field."""
        for name, rule in SAMPLING_RULES.items():
            if (msg := rule.problem(getattr(self, name))) is not None:
                raise SamplingError(f"{name} {msg}")
        if isinstance(self.stop, str) or not isinstance(self.stop, (tuple, list)) \
                or not all(isinstance(s, str) for s in self.stop):
            raise SamplingError(f"stop must be a list of strings, got {self.stop!r:.60}")
        object.__setattr__(self, "stop", tuple(self.stop))
        ids = self.stop_token_ids
        if ids is not None:
            if not isinstance(ids, (tuple, list)) or any(Int(0).problem(t) for t in ids):
                raise SamplingError(f"stop_token_ids must be a list of integers ≥ 0, got {ids!r:.60}")
            object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))


class LogitsProcessor(Protocol):
    """Stateful, one per request: adjusts the logits [V] before each pick and is told the token picked."""

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits to sample from (e.g. -inf where a grammar forbids the token)."""
        ...

    def accept(self, token: int) -> None:
        """The token the sampler picked (advances the processor's state)."""
        ...


_MASK64 = (1 << 64) - 1
_GOLDEN64 = 0x9E3779B97F4A7C15


def position_uniform(key: int, index: int) -> float:
    """A uniform number in [0, 1) for generated position ``index`` of a request keyed ``key`` (the ``index``-th
    output of splitmix64 seeded with ``key``; 53 bits)."""
    x = (key + (index + 1) * _GOLDEN64) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return ((x ^ (x >> 31)) >> 11) * (1.0 / (1 << 53))


class Sampler:
    """Picks the next token from logits [V], reproducibly by seed. A request's ``processor`` sees the logits first
    and learns each pick.

    Each generated position draws its own uniform number u from (seed, position) — ``position_uniform`` — and the
    token is where u falls in the cumulative distribution (inverse CDF). So the token at a position depends only on
    the seed, the position and the distribution there: a seeded request gives the same tokens with speculation on
    or off, whatever was drafted (verification draws the position's token and keeps the draft when they are the
    same, which happens with probability p(draft): the speculative-sampling rule for a draft proposed with
    certainty)."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.key = (params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little")) & _MASK64
        self.index = 0
        """The generated position the next pick is for."""

    def draw(self, probs: torch.Tensor) -> int:
        """The token at this position: where its uniform number falls in ``probs``' cumulative sums."""
        cdf = probs.cumsum(0)
        u = position_uniform(self.key, self.index)
        # the first token whose cumulative mass exceeds u of the total: never one of probability 0
        token = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])]), right=True)[0])
        return min(token, int(probs.shape[-1]) - 1)

    def __call__(self, logits: torch.Tensor) -> int:
        processor = self.params.processor
        if processor is None:
            return self.pick(logits)
        token = self.pick(processor(logits))
        processor.accept(token)
        return token

    def pick(self, logits: torch.Tensor) -> int:
        """The next token from ``logits`` [V] by the request's temperature, top-k, top-p and seed."""
        if self.params.temperature == 0.0:
            token = _argmax(logits)
        else:
            probs = self.distribution(logits)
            assert probs is not None
            token = self.draw(probs)
        self.index += 1
        return token

    def distribution(self, logits: torch.Tensor) -> torch.Tensor | None:
        """The probabilities [V] (fp32, CPU) ``pick`` draws from: temperature, top-k and top-p applied to
        ``logits`` [V]; None when greedy (the pick is the argmax)."""
        p = self.params
        if torch.isnan(logits).any():  # argmax would pick the NaN, multinomial would raise: say why instead
            raise NumericalError(NAN_LOGITS)
        if p.temperature == 0.0:
            return None
        # shifted so the largest is 0: a tiny temperature then gives -inf for the rest, never inf - inf = NaN
        logits = (logits.float() - logits.max().float()) / p.temperature
        if p.top_k > 0 and p.top_k < logits.shape[-1]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            probs = torch.softmax(sorted_logits, dim=-1)
            # drop a token when the mass before it already reaches top_p (always keeps the first)
            drop = probs.cumsum(-1) - probs >= p.top_p
            logits = logits.scatter(0, order[drop], float("-inf"))
        return torch.softmax(logits, dim=-1).cpu()

    def greedy_picks(self, logits: torch.Tensor) -> tuple[list[int], list[float]] | None:
        """Every position's greedy token of ``logits`` [n, V] and its logit, in one pass — what ``verify`` and
        ``__call__`` pick position by position when the request is greedy without a processor; None otherwise. The
        caller takes the tokens it uses with ``take_greedy`` (which checks each one's logit for NaN)."""
        if self.params.temperature != 0.0 or self.params.processor is not None:
            return None
        if _numpy_ok(logits):
            rows = logits.numpy()
            picks = rows.argmax(-1)
            return picks.tolist(), rows[np.arange(picks.shape[0]), picks].tolist()
        picks = torch.argmax(logits, dim=-1)
        return picks.tolist(), logits.gather(1, picks[:, None])[:, 0].tolist()

    def take_greedy(self, token: int, value: float) -> int:
        """Account one position of ``greedy_picks``: ``token`` is this position's pick (NumericalError when its logit
        ``value`` is NaN, as ``pick`` raises)."""
        if math.isnan(value):
            raise NumericalError(NAN_LOGITS)
        self.index += 1
        return token

    def verify(self, logits: torch.Tensor, draft: int) -> tuple[int, bool]:
        """Speculative decoding: the token at a position where ``draft`` was proposed, and whether it is the draft.

        The token is the one ``self(logits)`` gives at this position — the argmax when greedy, else the position's
        own draw (see the class) — and the draft is kept when it is that token: when sampled, with probability
        p(draft) under the request's processed distribution p, the speculative-sampling rule for a draft proposed
        with certainty, and the token is distributed exactly as p. The request's processor sees the logits and
        learns the token, as in ``__call__``."""
        processor = self.params.processor
        if processor is not None:
            logits = processor(logits)
        token = self.pick(logits)
        if processor is not None:
            processor.accept(token)
        return token, token == draft


def _numpy_ok(logits: torch.Tensor) -> bool:
    """Whether ``logits`` can be read as a numpy array in place: fp32 on the CPU, no autograd. numpy's argmax takes
    3-8 us over 1-8 rows of 8,192 logits where torch's takes 9-31 us (2 threads, Zen 4) — a greedy decode pays it
    every token — with the same answer: the first maximum, a NaN counted as the maximum."""
    return logits.dtype is torch.float32 and logits.device.type == "cpu" and not logits.requires_grad


def _argmax(logits: torch.Tensor) -> int:
    """The greedy pick of ``logits`` [V]; NumericalError on NaN logits. One pass: argmax takes a NaN as the maximum,
    so checking the picked value finds any NaN (what ``distribution`` checks with a separate ``isnan``)."""
    if _numpy_ok(logits):
        row = logits.numpy()
        token = int(row.argmax())
        value = float(row[token])
    else:
        token = int(torch.argmax(logits))
        value = float(logits[token])
    if math.isnan(value):
        raise NumericalError(NAN_LOGITS)
    return token


class StopChecker:
    """Finds stop strings in streamed text, holding back a tail that might be the start of one."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.text = ""
        """All text accepted so far (emitted + held back), cut at the stop string once found."""
        self._emitted = 0

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add a text delta; returns (text now safe to emit, whether a stop string was reached)."""
        self.text += delta
        if not self.stops:
            return self._take(len(self.text)), False
        cut = min((i for s in self.stops if (i := self.text.find(s, self._emitted)) != -1), default=-1)
        if cut != -1:
            self.text = self.text[:cut]
            return self._take(cut), True
        hold = max((n for s in self.stops for n in range(1, len(s)) if self.text.endswith(s[:n])), default=0)
        return self._take(len(self.text) - hold), False

    def flush(self) -> str:
        """Release the held-back tail (generation ended without a stop string)."""
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        out = self.text[self._emitted : upto]
        self._emitted = max(self._emitted, upto)
        return out
