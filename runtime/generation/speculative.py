"""Speculative decoding without a second model: drafts from the sequence's own context, verified in the batch.

A coding agent's turns repeat what its context holds — an edit re-emits the lines it replaces, a command re-uses
paths from the last tool result, a test names the module it tests. ``PromptLookup`` finds the recent occurrences of
the sequence's last tokens in its own context (prompt and generated tokens) and proposes the tokens that followed
them: those of the occurrences matching furthest back, as far as they agree (``vote``). The scheduler
(``runtime/scheduler.py``) feeds a decoding sequence's last token plus its k draft tokens as one row of the normal
batched step, takes the logits of all k + 1 positions and keeps the longest prefix the model
agrees with plus the model's own next token (``Sampler.verify``: exact match when greedy, the speculative-sampling
rule when sampled), so the output is distributed exactly as without speculation.

How many tokens to draft is decided per sequence and step by ``DraftPolicy``: the acceptance of a draft token is
modelled as a coin with probability a (drafts of k tokens then give 1 + a + ... + a^k tokens per step), estimated
from the sequence's own recent verifications, pulled toward the acceptance measured in its phase (``code`` turns
copy more than ``plan`` turns); a verified row of k + 1 tokens is priced at what steps of k + 1 tokens measured
while decoding cost against 1-token steps (``StepCost``: mean seconds per step size; ``verify_cost`` fixes a linear
price instead). The policy picks the k with the most tokens per unit of cost, and
k = 0 — plain decode, nothing drafted, nothing verified — when no draft pays. A sequence that stops speculating
forgets its failures slowly (``idle_decay`` per step), so it tries again later. A drafter with several sources (a
draft model behind prompt lookup: ``generation/draft_model.py``) names the source of each next draft; acceptance and
price (a draft model's measured seconds per token) are then kept per source.

What an engine generated before is a second source (``TokenHistory``, SuffixDecoding's global cache): every
finished request's output, with the last few prompt tokens before it, is indexed engine-wide, and ``ContextLookup``
drafts from the occurrences of the sequence's last tokens in its own tokens and in that history together (one vote).
An agent's turns repeat one another across sessions (the same commands, the same edit and test idioms, a retried
request's whole reply), so copies come from there as often as from the context. Only outputs of requests decoded
with speculation on are recorded; drafts are verified as any other, so what a sequence emits never depends on what
other sequences wrote — only how many steps it takes.

Dimensions: L = the sequence's tokens so far, k = draft tokens of one step, H = tokens the history holds.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from freetoken_agent.runtime.errors import OptionError


class Drafter(Protocol):
    """Proposes the tokens likely to follow a sequence (one instance per sequence; it may index incrementally).

    A drafter that computes (a draft model) may also offer ``start(tokens, k)`` → a handle and ``finish(handle)`` →
    the drafts: the scheduler then starts every sequence's proposal of a step before it waits for the first."""

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens to follow ``tokens`` (the sequence's tokens so far; it only ever grows)."""
        ...


def index_ngrams(index: dict[tuple[int, ...], list[int]], tokens: list[int], start: int, stop: int,
                 key: int) -> None:
    """Record in ``index`` each position ``i`` in [start, stop) under the ``key`` tokens before it (keys zipped from
    shifted slices: ~0.30 vs 0.36 ms for a 1,536-token prompt with a slice per position)."""
    if stop <= start:
        return
    get = index.get
    keys = zip(*(tokens[start - key + j : stop - key + j] for j in range(key)))
    for i, k in enumerate(keys, start):
        found = get(k)
        if found is None:
            index[k] = [i]
        else:
            found.append(i)


def match_lengths(source: list[int], tokens: list[int], found: list[int], key: int, candidates: int,
                  max_match: int) -> list[tuple[int, int]]:
    """For the last ``candidates`` positions of ``found`` (each follows an occurrence in ``source`` of ``tokens``'
    last ``key`` tokens), most recent first: (position, how far the match with ``tokens``' end extends back, up to
    ``max_match`` tokens)."""
    n, out = len(tokens), []
    for start in reversed(found[-candidates:]):
        length = key
        while (length < max_match and length < n and start - length - 1 >= 0
               and source[start - length - 1] == tokens[n - length - 1]):
            length += 1
        out.append((start, length))
    return out


AGREEMENT = 0.7
"""A draft goes on past its first token only while the candidates still in it agree this much (the leading next
token's share of their weight): where earlier occurrences of the context went different ways, the draft stops
instead of verifying a guess (see ``vote``)."""

SLACK = 2
"""Candidates whose match reaches back at least the best match's length minus this many tokens vote."""


def vote(candidates: list[tuple[int, list[int], str]], limit: int, agreement: float = AGREEMENT,
         slack: int = SLACK) -> tuple[list[int], int, str | None]:
    """A draft of up to ``limit`` tokens from the continuations of earlier occurrences of the context's end.

    ``candidates``: (match length, continuation, source), in order of preference on ties (the sequence's own and the
    most recent first). Those whose match is within ``slack`` of the longest vote: at each position the token with
    the most weight (match lengths) among the candidates that agree with the draft so far is taken — the first one
    always, later ones while it holds ``agreement`` of that weight — and the candidates that continue otherwise drop
    out. Where the longest match alone decides (prompt lookup's classic rule) a draft runs on through places where the
    context's other occurrences diverge, and those tokens are mostly rejected. Measured on the built-in model decoding
    the recorded turns with a fixed draft price (so the policy's choices do not depend on timing), tokens per unit of
    modelled step cost: +4.8% on ``code`` turns, +6.6% on edits, +1% on ``plan`` over 12 sessions (+1.9 / +3.6 /
    +0.6% over 6); acceptance 0.67 -> 0.74 on ``code``. Returns (draft, the match length of the longest candidate
    that agrees with all of it, its source); ([], 0, None) when there is no candidate."""
    if not candidates:
        return [], 0, None
    floor = max(c[0] for c in candidates) - slack
    groups: dict[tuple[int, ...], list[Any]] = {}  # equal continuations vote as one: [weight, cont, length, source]
    for length, cont, source in candidates:
        if length >= floor:
            group = groups.get(key := tuple(cont))
            if group is None:
                groups[key] = [length, cont, length, source]
            else:
                group[0] += length
                if length > group[2]:  # the group's longest match and its source (the first of equal ones)
                    group[2], group[3] = length, source
    alive = list(groups.values())
    draft: list[int] = []
    for t in range(limit):
        if len(alive) == 1:
            draft.extend(alive[0][1][t:limit])
            break
        tally: dict[int, int] = {}
        for weight, cont, _, _ in alive:
            if t < len(cont):
                tally[cont[t]] = tally.get(cont[t], 0) + weight
        if not tally:
            break
        token = max(tally, key=tally.__getitem__)  # the first of equal weights: the preferred candidate's
        if t and tally[token] < agreement * sum(tally.values()):
            break
        draft.append(token)
        alive = [c for c in alive if t < len(c[1]) and c[1][t] == token]
    best = max(alive, key=lambda c: c[2])  # the first of the longest
    return draft, best[2], best[3]


class PromptLookup:
    """N-gram lookup in the sequence's own tokens (prompt lookup decoding).

    Every position is indexed by the ``key`` tokens before it (incrementally, as the sequence grows). A proposal
    takes the sequence's last ``key`` tokens, looks at their ``candidates`` most recent earlier occurrences, measures
    how far each one's match extends to the left (up to ``max_match`` tokens) and drafts what followed them by
    ``vote``: while they agree, as far as the longest match's continuation goes. A continuation that runs into the end
    of the sequence repeats with the match's period (a loop the model is in)."""

    def __init__(self, key: int = 2, candidates: int = 8, max_match: int = 32) -> None:
        if key < 1:
            raise OptionError(f"the lookup key needs at least one token, got {key}")
        self.key, self.candidates, self.max_match = key, candidates, max_match
        self._index: dict[tuple[int, ...], list[int]] = {}
        """Key (``key`` tokens) → the positions that followed an occurrence of it, ascending."""
        self._indexed = 0
        self.match = 0
        """Tokens the last proposal's match covered (0: none found)."""

    def _update(self, tokens: list[int]) -> None:
        index_ngrams(self._index, tokens, max(self._indexed, self.key), len(tokens), self.key)
        self._indexed = max(self._indexed, len(tokens))

    def prepare(self, tokens: list[int]) -> None:
        """Index ``tokens`` (a prompt, while it is processed) so the first lookup of decoding finds them indexed."""
        self._update(tokens)

    def matches(self, tokens: list[int], limit: int) -> list[tuple[int, list[int], str]]:
        """The earlier occurrences of ``tokens``' last ``key`` tokens, most recent first, as ``vote`` candidates: (match
        length, the ``limit`` tokens that followed, ``context``)."""
        n, g = len(tokens), self.key
        if limit <= 0 or n <= g:
            return []
        self._update(tokens)
        found = self._index.get(tuple(tokens[n - g :]))
        if not found:
            return []
        out = []
        for start, length in match_lengths(tokens, tokens, found, g, self.candidates, self.max_match):
            cont = tokens[start : start + limit]
            period = n - start
            while len(cont) < limit:  # past the end: the loop's period again
                cont.extend(cont[: min(period, limit - len(cont))])
            out.append((length, cont, "context"))
        return out

    def propose(self, tokens: list[int], k: int) -> list[int]:
        draft, self.match, _ = vote(self.matches(tokens, k), k)
        return draft


class TokenHistory:
    """Recent outputs of an engine's requests, indexed by n-gram for drafting (one per engine, shared by its
    sequences; used from the engine's thread).

    Each recorded document is the last ``prompt_tail`` prompt tokens of a request and what it generated, so a reply's
    first tokens can be matched from the prompt's end (``<|im_start|>assistant``...). ``matches`` gives the
    ``candidates`` most recent occurrences of a sequence's last ``key`` tokens, with how far each match extends back
    (up to ``max_match`` tokens) and what followed it, never past the end of its document (``vote`` drafts from
    them). At most about ``capacity`` tokens are kept: when twice that has been recorded the oldest
    documents are dropped and the index is rebuilt (amortized O(1) a token)."""

    def __init__(self, capacity: int = 65536, key: int = 2, candidates: int = 16, max_match: int = 64,
                 prompt_tail: int = 8) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise OptionError(f"the token history needs a capacity of at least one token, got {capacity!r}")
        if key < 1:
            raise OptionError(f"the lookup key needs at least one token, got {key}")
        self.capacity, self.key, self.candidates, self.max_match = capacity, key, candidates, max_match
        self.prompt_tail = prompt_tail
        self._tokens: list[int] = []
        """Documents one after another, each followed by -1 (a token no match or continuation crosses)."""
        self._starts: list[int] = []
        """Where each document begins in ``_tokens``."""
        self._index: dict[tuple[int, ...], list[int]] = {}
        """Key (``key`` tokens) → the positions that followed an occurrence of it, ascending."""
        self.recorded = 0
        """Documents recorded since the history was made (dropped ones included)."""

    @property
    def size(self) -> int:
        """Tokens held (separators excluded)."""
        return len(self._tokens) - len(self._starts)

    def add(self, prompt: list[int], output: list[int]) -> None:
        """Record one request: the tail of its ``prompt`` and its ``output`` (nothing when it generated nothing)."""
        if not output:
            return
        doc = [*prompt[len(prompt) - self.prompt_tail :], *output] if self.prompt_tail > 0 else list(output)
        doc = doc[-self.capacity :]
        self.recorded += 1
        self._starts.append(len(self._tokens))
        self._index_doc(len(self._tokens), doc)
        if len(self._tokens) > 2 * self.capacity:
            self._compact()

    def _index_doc(self, base: int, doc: list[int]) -> None:
        self._tokens.extend(doc)
        self._tokens.append(-1)
        index_ngrams(self._index, self._tokens, base + self.key, base + len(doc) + 1, self.key)

    def _compact(self) -> None:
        """Keep the newest documents that fit in ``capacity`` tokens; rebuild the index over them."""
        ends = [*self._starts[1:], len(self._tokens)]
        keep, total = len(self._starts), 0
        while keep > 0 and total + ends[keep - 1] - 1 - self._starts[keep - 1] <= self.capacity:
            keep -= 1
            total += ends[keep] - 1 - self._starts[keep]
        docs = [self._tokens[a : b - 1] for a, b in zip(self._starts[keep:], ends[keep:])]
        self._tokens, self._starts, self._index = [], [], {}
        for doc in docs:
            self._starts.append(len(self._tokens))
            self._index_doc(len(self._tokens), doc)

    def matches(self, tokens: list[int], limit: int) -> list[tuple[int, list[int], str]]:
        """``vote`` candidates from the history: (match length, up to ``limit`` tokens that followed, never past their
        document's end, ``history``) for the ``candidates`` most recent occurrences of ``tokens``' last tokens."""
        n, g = len(tokens), self.key
        found = self._index.get(tuple(tokens[n - g :])) if n >= g and limit > 0 else None
        if not found:
            return []
        out = []
        for start, length in match_lengths(self._tokens, tokens, found, g, self.candidates, self.max_match):
            cont = self.continuation(start, limit)
            if cont:
                out.append((length, cont, "history"))
        return out

    def continuation(self, position: int, k: int) -> list[int]:
        """Up to ``k`` tokens from ``position`` (what followed an occurrence), stopping at its document's end."""
        out = self._tokens[position : position + k]
        if -1 in out:
            out = out[: out.index(-1)]
        return out

    def snapshot(self) -> dict[str, int]:
        return {"tokens": self.size, "documents": len(self._starts), "recorded": self.recorded,
                "capacity": self.capacity}


class ContextLookup:
    """Prompt lookup in the sequence's own tokens and in the engine's ``TokenHistory`` together: the earlier
    occurrences of the sequence's end in both vote on the draft (``vote``; on equal weight the sequence's own tokens
    win). ``source(tokens)`` names where the draft's longest agreeing match lies — ``context`` or ``history`` — so
    ``DraftPolicy`` keeps each one's acceptance on its own."""

    def __init__(self, history: TokenHistory, key: int = 2, limit: int | None = None) -> None:
        self.local, self.history = PromptLookup(key), history
        self.limit = history.max_match if limit is None else max(1, limit)
        """Tokens a proposal drafts at most (the policy's ``max_draft``; a step's ``source`` and ``propose`` share
        one vote)."""
        self._at: tuple[int, str, list[int]] | None = None  # (len(tokens), source, draft of up to limit)
        self.match = 0

    def _best(self, tokens: list[int]) -> tuple[str, list[int]]:
        n = len(tokens)
        if self._at is None or self._at[0] != n:
            limit = self.limit
            draft, self.match, source = vote(self.local.matches(tokens, limit) + self.history.matches(tokens, limit),
                                             limit)
            self._at = (n, source or "context", draft)
        return self._at[1], self._at[2]

    def source(self, tokens: list[int]) -> tuple[str, float | None]:
        return self._best(tokens)[0], None

    def prepare(self, tokens: list[int]) -> None:
        self.local.prepare(tokens)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        if k <= 0:
            return []
        return self._best(tokens)[1][:k]


PHASE_PRIOR = {"code": 0.55, "plan": 0.4, "tool": 0.3}
"""Acceptance assumed for a phase before any of its drafts were verified: the per-token acceptance a whose
1 + a + a² matches the tokens per step of 2-token drafts with the recorded replies as the model's output (code 1.84,
plan 1.52 over 60k tokens of the recorded trajectories: ``evals/perf/bench_speculative.py``); other or no phase:
``SpeculationConfig.prior``."""


@dataclass
class SpeculationConfig:
    """The engine's speculation settings (``Engine.from_pretrained(speculate=...)``, ``engine.speculation``)."""

    enabled: bool = True
    max_draft: int = 7
    """Draft tokens per step at most (k_max). 7: a row of 8 tokens, the most the CPU kernels' GEMV path takes at
    once (``GEMV_MAX_M``); a ninth token moves a step onto the GEMM path (measured: 1.8x → 3.0x a 1-token step on a
    q4 MoE, ``evals/perf/bench_speculative.py``)."""
    verify_cost: float | None = None
    """Cost of each draft token of a row, in 1-token decode steps (1 + verify_cost · k for a row of k + 1), drafting
    included; None: what rows of each size cost, measured on this machine and model while decoding
    (``StepCost.relative``), plus a draft model's measured seconds per draft token."""
    key: int = 2
    """Tokens of the n-gram looked up in the context."""
    prior: float = 0.35
    """Acceptance assumed for a sequence with no history, in a phase with none."""
    phase_prior: dict[str, float] = field(default_factory=lambda: dict(PHASE_PRIOR))
    prior_weight: float = 3.0
    """How many verified tokens the phase's acceptance counts for against the sequence's own."""
    decay: float = 0.85
    """Weight kept by a sequence's past verifications at each new one (recent acceptance counts most)."""
    idle_decay: float = 0.97
    """Weight kept per step in which the sequence does not speculate (it tries again once its failures fade)."""
    drafter: Callable[[], Drafter] | None = field(default=None, compare=False)
    """Builds each sequence's drafter (None: the draft model's, else ``ContextLookup`` over the sequence and
    ``history``, or ``PromptLookup(key)`` without a history)."""
    draft_model: Any = field(default=None, compare=False)
    """A ``generation.draft_model.DraftModel``: a small model of the same tokenizer drafts instead of prompt lookup
    (``Engine.from_pretrained(draft_model=...)``, ``--draft-model``)."""
    history_tokens: int = 65536
    """Tokens of earlier outputs kept for drafting (``TokenHistory``; 0: drafts from the sequence's own tokens
    only)."""
    history: TokenHistory | None = field(default=None, compare=False)
    """The engine's history of outputs (made from ``history_tokens`` when None; kept when the engine's speculation
    is switched off and on)."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_draft, int) or isinstance(self.max_draft, bool) or not 0 <= self.max_draft <= 64:
            raise OptionError(f"max_draft must be an integer in 0..64, got {self.max_draft!r}")
        if self.verify_cost is not None and not 0 <= self.verify_cost:
            raise OptionError(f"verify_cost must be ≥ 0, got {self.verify_cost!r}")
        for name in ("prior", "decay", "idle_decay"):
            if not 0 <= getattr(self, name) <= 1:
                raise OptionError(f"{name} must be in 0..1, got {getattr(self, name)!r}")
        h = self.history_tokens
        if not isinstance(h, int) or isinstance(h, bool) or h < 0:
            raise OptionError(f"history_tokens must be an integer ≥ 0, got {h!r}")
        if h == 0:
            self.history = None
        elif self.history is None or self.history.capacity != h:
            self.history = TokenHistory(h, key=self.key)

    @classmethod
    def of(cls, value: bool | int | SpeculationConfig | None) -> SpeculationConfig:
        """``True``/``False`` (on with defaults / off), an integer (on, that many draft tokens at most; 0: off), or a
        config."""
        if isinstance(value, SpeculationConfig):
            return value
        if value is None or isinstance(value, bool):
            return cls(enabled=value is not False)
        if isinstance(value, int):
            return cls(enabled=value > 0, max_draft=max(value, 0))
        raise OptionError(f"speculate takes true/false, a number of draft tokens or a SpeculationConfig, "
                          f"got {value!r:.60}")


def unsupported(spec: object) -> str | None:
    """Why a model cannot verify drafts as one row (its forward of k + 1 tokens is not k + 1 single-token steps),
    or None. ``spec``: a ``ModelSpec``."""
    for layer in getattr(spec, "layers", ()):
        moe = getattr(layer, "moe", None)
        if moe is not None and moe.kind == "product_key":
            return "product-key MoE (Doge): its router's reference views the logits across a row's tokens"
    return None


def expected_tokens(accept: float, k: int) -> float:
    """Tokens a step yields with ``k`` draft tokens when each is accepted with probability ``accept`` (in order)."""
    if accept >= 1.0:
        return float(k + 1)
    return (1.0 - accept ** (k + 1)) / (1.0 - accept)


def best_draft_length(accept: float, max_draft: int, verify_cost: float | Callable[[int], float]) -> int:
    """The k in 0..``max_draft`` with the most tokens per unit of step cost (0 when no draft pays). ``verify_cost``:
    each draft token's cost in 1-token steps (a row of k + 1 costs 1 + verify_cost · k), or the relative cost of a
    row of k + 1 tokens as a function of k (``StepCost.relative``)."""
    rel = verify_cost if callable(verify_cost) else (lambda k: 1.0 + verify_cost * k)
    best_k, best = 0, 1.0
    for k in range(1, max_draft + 1):
        gain = expected_tokens(accept, k) / max(rel(k), 1e-9)
        if gain > best + 1e-9:
            best_k, best = k, gain
    return best_k


class StepCost:
    """What a decode step of T tokens costs on this machine and model, measured while decoding.

    Two views of the same observations (decode steps' seconds against their tokens, exponentially decayed):
    a table of mean seconds per step size T, and a least-squares line a + b · T through all of them. The table is
    what prices a draft: the cost of a step does not grow linearly with its tokens — the first draft token moves a
    row off the single-token paths (attention over several queries, more experts read), later ones add less
    (built-in model: 1.12x a 1-token step for 2 tokens, 1.60x for 8; 7.5B q4 MoE: 1.61x, 4.14x for 9) — and a
    line fitted through mostly 1- and 2-token steps priced 8 tokens at 3x. Sizes never seen are interpolated
    between their nearest seen neighbours and extrapolated above the largest with the line's slope."""

    MIN_WEIGHT = 3.0
    """Decayed observations a step size needs before its mean is used."""
    AGING = 0.99
    """Weight every size's observations keep per observed step (its mean is unchanged). A size measured slow a few
    times and then never drafted again — priced out by that very measurement — falls under ``MIN_WEIGHT`` within
    ~50-100 steps and is priced from its neighbours again, so drafting resumes and measures it anew (seen: one slow
    2-token row stopped a whole phase's drafting, 0.93x without speculation over 66 turns). A size measured every
    few steps keeps its weight (every 8th step: ~13)."""
    COLD_STEPS = 4
    """Decode steps after a prompt chunk that the scheduler does not observe: the prefill's own data filled the caches,
    and the first steps after it run slower whatever their size (the built-in model on the recorded turns, AMX Xeon:
    1.5x a warm step for the first, 1.35x / 1.2x / 1.15x the next three), while the first step of a turn is most
    often a verify row (the reply's opening copies the history): observed, they priced drafts up to 1.4x too high."""

    def __init__(self, decay: float = 0.98, default: float = 0.1, max_tokens: int = 64) -> None:
        self.decay, self.default, self.max_tokens = decay, default, max_tokens
        self._sums = [0.0] * 5  # n, Σt, Σs, Σt², Σts
        self._by_size: dict[int, list[float]] = {}  # T → [decayed weight, decayed Σ seconds]
        self._seen: dict[int, float] | None = None  # seconds() until the next observation

    def observe(self, tokens: int, seconds: float) -> None:
        self._seen = None
        d = self.decay
        for i, v in enumerate((1.0, tokens, seconds, tokens * tokens, tokens * seconds)):
            self._sums[i] = self._sums[i] * d + v
        if 1 <= tokens <= self.max_tokens:
            for e in self._by_size.values():  # every size ages each step: one not seen for long drops out
                e[0] *= self.AGING
                e[1] *= self.AGING
            entry = self._by_size.setdefault(tokens, [0.0, 0.0])
            entry[0] += 1.0
            entry[1] += seconds
            if entry[0] > 50.0:  # a running mean over about the last 50 steps of this size
                entry[0], entry[1] = entry[0] * 0.98, entry[1] * 0.98

    def _line(self) -> tuple[float, float] | None:
        n, st, ss, stt, sts = self._sums
        var = n * stt - st * st
        if n < 8 or var <= 1e-9 * max(n * stt, 1.0):  # too few steps, or all of one size: nothing to fit
            return None
        b = (n * sts - st * ss) / var
        a = (ss - b * st) / n
        return (a, b) if a + b > 0 else None

    def estimate(self) -> float:
        """The line's cost of one more token in 1-token steps (``default`` until it can be fitted)."""
        line = self._line()
        if line is None:
            return self.default
        a, b = line
        return min(max(b / (a + b), 0.03), 4.0)  # a floor: timing noise never makes drafts look free

    def seconds(self) -> dict[int, float]:
        """Mean seconds of each step size seen often enough, made non-decreasing in the size: a step of more tokens
        does at least the work of one of fewer, so a size whose mean lies above a larger size's (a few slow steps
        among a size's few observations) takes the larger size's."""
        if self._seen is None:  # once per step: every sequence's draft prices up to max_draft lengths from it
            seen = {t: s / w for t, (w, s) in sorted(self._by_size.items()) if w >= self.MIN_WEIGHT}
            cap = math.inf
            for t in sorted(seen, reverse=True):
                cap = seen[t] = min(seen[t], cap)
            self._seen = seen
        return self._seen

    def relative(self, k: int) -> float:
        """Cost of a step of 1 + k tokens in 1-token steps (never below 1 + 0.03 · k: noise never makes drafts free;
        ``1 + estimate() · k`` until 1-token steps were measured)."""
        floor = 1.0 + 0.03 * k
        if k <= 0:
            return 1.0
        seen = self.seconds()
        one = seen.get(1)
        if one is None or one <= 0:
            return max(1.0 + self.estimate() * k, floor)
        t = 1 + k
        if t in seen:
            return max(seen[t] / one, floor)
        below = max(s for s in seen if s < t)
        above = min((s for s in seen if s > t), default=None)
        if above is not None:  # between two measured sizes
            w = (t - below) / (above - below)
            return max((seen[below] * (1 - w) + seen[above] * w) / one, floor)
        # above the largest measured size: the mean cost of a token up to it; where 1-token steps alone are measured,
        # the fitted line's, at most ``default``. Never a steeper guess: a line through a few slow steps can price a
        # size at many times its cost (seen: 12x a 1-token step for 8 tokens), and a size never drafted is never
        # measured, so an overpriced one would stay so; an underpriced one is tried and corrected.
        slope = (seen[below] - one) / (below - 1) if below > 1 else min(self.estimate(), self.default) * one
        return max((seen[below] + slope * (t - below)) / one, floor)


class PhaseAcceptance:
    """Acceptance per phase (and draft source) across all sequences (decayed counts), the prior of each sequence's
    own estimate."""

    def __init__(self, config: SpeculationConfig) -> None:
        self.config = config
        self._counts: dict[tuple[str | None, str | None], list[float]] = {}  # (phase, source) → [accepted, rejected]

    def estimate(self, phase: str | None, source: str | None = None) -> float:
        prior = self.config.phase_prior.get(phase, self.config.prior) if phase is not None else self.config.prior
        a, r = self._counts.get((phase, source), (0.0, 0.0))
        w = 8.0  # the configured prior counts for this many tokens against what the phase measured
        return (a + w * prior) / (a + r + w)

    def observe(self, phase: str | None, accepted: int, rejected: int, source: str | None = None) -> None:
        counts = self._counts.setdefault((phase, source), [0.0, 0.0])
        counts[0] = counts[0] * 0.99 + accepted
        counts[1] = counts[1] * 0.99 + rejected


class DraftPolicy:
    """One sequence's drafter and its running acceptance (see the module docstring)."""

    def __init__(self, config: SpeculationConfig, phases: PhaseAcceptance, drafter: Drafter | None = None,
                 cost: StepCost | None = None) -> None:
        self.config, self.phases = config, phases
        self.cost = cost if cost is not None else StepCost()
        if drafter is None:
            if config.drafter is not None:
                drafter = config.drafter()
            elif config.draft_model is not None:
                drafter = config.draft_model.drafter(config.history)
            elif config.history is not None:
                drafter = ContextLookup(config.history, config.key, limit=config.max_draft)
            else:
                drafter = PromptLookup(config.key)
        self.drafter: Drafter = drafter
        self._counts: dict[str | None, list[float]] = {}
        """Source of the drafts (None, or what the drafter's ``source`` names: a draft model's ``copy`` / ``model``)
        → decayed counts of this sequence's verified draft tokens: accepted, and rejections (one per step that
        rejected one; the tokens after a rejection were never judged)."""
        self.last_source: str | None = None
        """The source of this step's draft (what the drafter's ``source`` named; None for a drafter without)."""

    def acceptance(self, phase: str | None, source: str | None = None) -> float:
        a, r = self._counts.get(source, (0.0, 0.0))
        w = self.config.prior_weight
        return (a + w * self.phases.estimate(phase, source)) / (a + r + w)

    def prepare(self, tokens: list[int]) -> None:
        """The prompt ``tokens`` are known (its prefill ends): a drafter that indexes its context does it now, with
        the prompt's processing, not in the first decode step."""
        prepare = getattr(self.drafter, "prepare", None)
        if prepare is not None:
            prepare(tokens)

    def draft(self, tokens: list[int], phase: str | None, limit: int) -> list[int]:
        """Draft tokens for this step (at most ``limit``); [] when speculating does not pay or nothing matches."""
        k = self.length(phase, limit, tokens)
        return self.drafter.propose(tokens, k) if k > 0 else []

    def length(self, phase: str | None, limit: int, tokens: list[int] | None = None) -> int:
        """How many tokens to draft this step (at most ``limit``; 0: speculating does not pay). A drafter with
        ``source(tokens)`` → (name, seconds per draft token or None) says where its next draft comes from — a draft
        model: a free copy from the context, or its forwards — and each source is priced and trusted on its own."""
        source, drafting = None, getattr(self.drafter, "seconds_per_token", None)
        which = getattr(self.drafter, "source", None)
        if which is not None and tokens is not None:
            source, drafting = which(tokens)
        self.last_source = source
        cost: float | Callable[[int], float]
        if self.config.verify_cost is not None:  # a fixed price per draft token: drafting included
            cost = self.config.verify_cost
        else:
            cost = self.cost.relative
            one = self.cost.seconds().get(1)
            if drafting and one:  # a draft model's own forwards, measured
                cost = lambda k: self.cost.relative(k) + k * drafting / one  # noqa: E731
        k = min(limit, best_draft_length(self.acceptance(phase, source), self.config.max_draft, cost))
        if k <= 0:
            d = self.config.idle_decay
            for counts in self._counts.values():
                counts[0], counts[1] = counts[0] * d, counts[1] * d
            return 0
        return k

    def observe(self, phase: str | None, drafted: int, accepted: int) -> None:
        """A verification: ``accepted`` of ``drafted`` draft tokens were kept (a prefix of them)."""
        d = self.config.decay
        rejected = 1 if accepted < drafted else 0
        counts = self._counts.setdefault(self.last_source, [0.0, 0.0])
        counts[0] = counts[0] * d + accepted
        counts[1] = counts[1] * d + rejected
        self.phases.observe(phase, accepted, rejected, self.last_source)


@dataclass
class SpeculationStats:
    """What speculation did (``Engine.stats()["speculation"]``)."""

    verify_rows: int = 0
    """Rows that carried draft tokens."""
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    """Tokens those rows produced (accepted drafts + the model's own token; fewer when a stop came first)."""
    replayed: int = 0
    """Positions fed again after a partial rejection (hybrid models: recurrent states rewound to the row's start)."""
    rolled_back: int = 0
    """Positions of rejected drafts dropped from the KV."""
    k_hist: dict[int, int] = field(default_factory=dict)
    """Draft length → rows."""
    by_phase: dict[str, list[int]] = field(default_factory=dict)
    """Phase (``none`` when unannounced) → [drafted, accepted]."""
    by_source: dict[str, list[int]] = field(default_factory=dict)
    """Where drafts came from (``context``, ``history``, a draft model's ``copy`` / ``model``; ``drafter`` for a
    drafter that does not say) → [drafted, accepted]."""

    def record(self, phase: str | None, drafted: int, accepted: int, emitted: int, source: str | None = None) -> None:
        self.verify_rows += 1
        self.drafted += drafted
        self.accepted += accepted
        self.emitted += emitted
        self.k_hist[drafted] = self.k_hist.get(drafted, 0) + 1
        for table, name in ((self.by_phase, phase or "none"), (self.by_source, source or "drafter")):
            counts = table.setdefault(name, [0, 0])
            counts[0] += drafted
            counts[1] += accepted

    def snapshot(self) -> dict:
        rate = round(self.accepted / self.drafted, 4) if self.drafted else None
        return {
            "verify_rows": self.verify_rows, "drafted": self.drafted, "accepted": self.accepted,
            "acceptance_rate": rate, "emitted": self.emitted,
            "tokens_per_row": round(self.emitted / self.verify_rows, 3) if self.verify_rows else None,
            "replayed": self.replayed, "rolled_back": self.rolled_back,
            "k_hist": dict(sorted(self.k_hist.items())),
            "by_phase": {p: {"drafted": d, "accepted": a, "acceptance_rate": round(a / d, 4) if d else None}
                         for p, (d, a) in sorted(self.by_phase.items())},
            "by_source": {p: {"drafted": d, "accepted": a, "acceptance_rate": round(a / d, 4) if d else None}
                          for p, (d, a) in sorted(self.by_source.items())},
        }
