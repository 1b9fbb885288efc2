"""The benchmarks' one timing helper: decode tokens counted exactly once, repeats, alternation, spread."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
from freetoken_agent.evals.perf.timing import DecodeTiming, Spread, alternate, repeat, timed


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_stamps_of_a_known_step_sequence_count_every_decode_token_once() -> None:
    # prefill yields token 0 at t=2.0; then 5 decode steps of 0.25 s, 0.5 s, 0.25 s, 0.25 s, 0.75 s
    steps = [0.25, 0.5, 0.25, 0.25, 0.75]
    stamps = list(itertools.accumulate([2.0, *steps]))
    t = DecodeTiming.from_stamps(stamps)
    assert t.tokens == 5  # 6 tokens generated, the first one by the prefill: 5 decode tokens
    assert t.seconds == pytest.approx(2.0)
    assert t.tok_s == pytest.approx(2.5)  # not 6 / 2.0 = 3.0: the bias of counting the prefilled token


def test_a_stream_timed_on_a_fake_clock() -> None:
    clock = FakeClock()
    gaps = [0.1 * (i + 1) for i in range(8)]  # token 0 after a 3 s prefill, then 8 decode steps

    def tokens():  # type: ignore[no-untyped-def]
        clock.advance(3.0)
        yield 0
        for i, gap in enumerate(gaps):
            clock.advance(gap)
            yield i + 1

    t = DecodeTiming.from_stream(tokens(), clock)
    assert t.tokens == 8 and t.seconds == pytest.approx(sum(gaps)) and t.tok_s == pytest.approx(8 / sum(gaps))
    assert DecodeTiming.from_stamps([5.0]) == DecodeTiming(0, 0.0) and DecodeTiming(0, 0.0).tok_s is None
    assert DecodeTiming(3, 1.0) + DecodeTiming(5, 3.0) == DecodeTiming(8, 4.0)


def test_an_engine_generation_counts_the_scheduler_decode_steps(tmp_path: Path) -> None:
    from freetoken_agent.runtime.engine import Engine
    from freetoken_agent.runtime.synthetic import write_synthetic

    engine = Engine.from_pretrained(write_synthetic("qwen3_moe", tmp_path / "m", seed=3), speculate=False)
    n = random.randint(3, 9)
    handle = engine.iter_generate([5, 6, 7, 8], max_new_tokens=n + 1, stop_token_ids=[])
    events = list(handle)
    steps = {e.step for e in events[1:]} - {events[0].step}  # steps after the one that produced token 0
    r = engine.generate([5, 6, 7, 8], max_new_tokens=n + 1, stop_token_ids=[])
    engine.close()
    t = DecodeTiming.from_generation(r)
    assert len(r.token_ids) == n + 1 and len(steps) == n == t.tokens
    assert t.seconds == r.decode_s > 0


def test_repeat_warms_up_and_times_each_call() -> None:
    clock = FakeClock()
    durations = iter([9.0, 1.0, 3.0, 2.0])  # the first call (warm-up) is slow and not counted
    calls = []

    def fn() -> None:
        calls.append(1)
        clock.advance(next(durations))

    s = repeat(fn, 3, warmup=1, clock=clock)
    assert len(calls) == 4 and s.runs == (1.0, 3.0, 2.0)
    assert (s.median, s.low, s.high) == (2.0, 1.0, 3.0) and s.relative == pytest.approx(1.0)
    assert Spread.of([4.0]).to_json() == {"median": 4.0, "low": 4.0, "high": 4.0, "runs": [4.0]}
    with pytest.raises(ValueError, match="repeats"):
        repeat(fn, 0)
    with pytest.raises(ValueError, match="at least one"):
        Spread.of([])


def test_alternate_flips_the_order_every_round() -> None:
    order: list[str] = []
    sides = {"a": lambda: order.append("a") or len(order), "b": lambda: order.append("b") or len(order)}
    out = alternate(sides, rounds=3, warmup=1)
    assert order == ["a", "b", "a", "b", "b", "a", "a", "b"]
    assert out == {"a": [3, 6, 7], "b": [4, 5, 8]}
    clock = FakeClock()
    assert timed(lambda: clock.advance(0.5) or "x", clock) == ("x", 0.5)
