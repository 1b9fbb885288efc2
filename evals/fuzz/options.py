"""The option fuzzer: every variant of every supported MoE type, checked against transformers.

For each variant (``variants.py``) the tiny random checkpoint is built and saved with transformers; our ``Engine``
loads it, and its fp32 logits must be within ``TOLERANCE`` of transformers' and its greedy tokens identical. A
variant transformers itself rejects (raises while building the config or model, in the forward or in ``generate``, or
gives non-finite logits) is *out of scope*; anything our side gets wrong is a *failure* with a one-line reason.

    python -m freetoken_agent.evals.fuzz.options [--types mixtral qwen3_moe] [--kinds act rope]
        [--per-type N] [--match REGEX] [--seed S] [--json] [--markdown] [--out-of-scope]

prints a table of passed / out-of-scope / failed per type and option kind, then every failure with its reason.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from freetoken_agent.evals.fuzz.tiny import make_model
from freetoken_agent.evals.fuzz.variants import GENERATORS, Variant, sample, variants

TOLERANCE = 1e-4
"""Max abs logit difference (fp32) for a pass, as in the per-type parity tests."""
NOISE = 1e-2
"""Errors between ``TOLERANCE`` and this go to the fp64 arbiter (``_fp64_arbiter``) instead of failing outright."""
PROMPT_LEN = 20
NEW_TOKENS = 8
VOCAB_DRAWN = 512
"""Prompt ids are drawn below this (the tiny configs' vocab size)."""

Status = Literal["pass", "fail", "out_of_scope"]


@dataclass(frozen=True)
class Outcome:
    """The verdict on one variant: ``reason`` is one line (empty on a pass); ``max_error`` when logits compared."""

    model_type: str
    kind: str
    option: str
    value: str
    status: Status
    reason: str = ""
    max_error: float | None = None
    seconds: float = 0.0


def _line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"


def check(variant: Variant, seed: int = 0) -> Outcome:
    """Build ``variant`` with transformers, load it in our engine and compare logits and greedy tokens."""
    from freetoken_agent.runtime.engine import Engine
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one "Writing model shards" bar per variant otherwise
    start = time.perf_counter()

    def done(status: Status, reason: str = "", err: float | None = None) -> Outcome:
        return Outcome(variant.model_type, variant.kind, variant.option, variant.value, status, reason, err,
                       round(time.perf_counter() - start, 2))

    ids = torch.randint(0, VOCAB_DRAWN, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed + 1))
    with warnings.catch_warnings(), tempfile.TemporaryDirectory() as tmp:
        warnings.simplefilter("ignore")
        try:  # transformers is the oracle: whatever it cannot build or run is out of scope
            model = make_model(variant.model_type, seed, **variant.overrides)
            with torch.no_grad():
                ref = model(ids[None]).logits[0].float()
                if not torch.isfinite(ref).all():
                    return done("out_of_scope", "transformers: non-finite logits")
                hf = model.generate(ids[None], do_sample=False, max_new_tokens=NEW_TOKENS,
                                    min_new_tokens=NEW_TOKENS)[0, PROMPT_LEN:].tolist()
            model.save_pretrained(tmp)
        except Exception as exc:  # noqa: BLE001 - any rejection by transformers marks the variant out of scope
            return done("out_of_scope", f"transformers: {_line(exc)}")
        engine = None
        try:
            engine = Engine.from_pretrained(tmp, threads=1)
            ours = engine.logits(ids)
            err = (ours - ref).abs().max().item() if ours.shape == ref.shape else float("inf")
            note = ""
            if not err <= TOLERANCE:
                within, note = _fp64_arbiter(model, ids, ref, ours) if err < NOISE else (False, "")
                if not within:
                    return done("fail", f"max |logit error| {err:.3g} > {TOLERANCE:g}{note}", err)
            tokens = engine.generate(ids, max_new_tokens=NEW_TOKENS, temperature=0.0, stop_token_ids=()).token_ids
            if tokens != hf:
                first = next((i for i, (a, b) in enumerate(zip(tokens, hf)) if a != b), min(len(tokens), len(hf)))
                return done("fail", f"greedy tokens differ from token {first}", err)
            return done("pass", note.removeprefix("; "), err)
        except Exception as exc:  # noqa: BLE001 - every error on our side is a failure to report, not a crash
            return done("fail", _line(exc))
        finally:
            if engine is not None:
                engine.close()


def _fp64_arbiter(model: Any, ids: torch.Tensor, ref: torch.Tensor, ours: torch.Tensor) -> tuple[bool, str]:
    """Is our fp32 result at least as close to transformers' own fp64 result as transformers' fp32 one is?

    A chunked recurrence in transformers (Gated DeltaNet, Mamba scans) differs from the exact one by fp32 rounding
    that can exceed ``TOLERANCE`` on a random tiny model; the fp64 forward of the same weights arbitrates."""
    try:
        model = model.double()
        if hasattr(model, "set_experts_implementation"):
            model.set_experts_implementation("eager")  # the grouped kernels take no fp64
        with torch.no_grad():
            exact = model(ids[None]).logits[0]
    except Exception as exc:  # noqa: BLE001 - no arbiter: the tolerance stands
        return False, f"; no fp64 arbiter ({_line(exc)})"
    ours_err = (ours.double() - exact).abs().max().item()
    ref_err = (ref.double() - exact).abs().max().item()
    note = f"; vs transformers fp64: ours {ours_err:.2g}, transformers fp32 {ref_err:.2g}"
    return ours_err <= max(TOLERANCE, ref_err), note


def plan(types: Iterable[str], kinds: tuple[str, ...] | None = None, per_type: int | None = None,
         seed: int = 0) -> list[Variant]:
    """The variants to run: all of each type's, or a seeded sample of ``per_type`` spread over option kinds."""
    out: list[Variant] = []
    for model_type in types:
        found = variants(model_type, kinds)
        out += sample(found, per_type, seed) if per_type is not None else found
    return out


def sweep(todo: list[Variant], seed: int = 0) -> Iterator[Outcome]:
    """Check each variant in turn (one torch thread: the sweep is meant to share a machine)."""
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    for variant in todo:
        yield check(variant, seed)


def table(outcomes: list[Outcome]) -> str:
    """Per type and option kind: ``passed/tried`` (out of scope and failed counted separately), then failures."""
    kinds = list(GENERATORS)
    rows: dict[str, dict[str, list[int]]] = {}
    for o in outcomes:
        cell = rows.setdefault(o.model_type, {}).setdefault(o.kind, [0, 0, 0, 0])
        cell[0] += 1
        cell[{"pass": 1, "out_of_scope": 2, "fail": 3}[o.status]] += 1
    head = f"{'type':<20}" + "".join(f"{k:>15}" for k in kinds) + f"{'tried':>7}{'pass':>6}{'oos':>6}{'fail':>6}"
    lines = ["cell = passed/in-scope (+out of scope)", head]
    for model_type in sorted(rows):
        cells, totals = [], [0, 0, 0, 0]
        for k in kinds:
            c = rows[model_type].get(k)
            if c is None:
                cells.append(f"{'-':>15}")
                continue
            totals = [a + b for a, b in zip(totals, c)]
            text = f"{c[1]}/{c[1] + c[3]}" + (f" (+{c[2]})" if c[2] else "")
            cells.append(f"{text:>15}")
        lines.append(f"{model_type:<20}" + "".join(cells) + "".join(f"{t:>{w}}" for t, w in zip(totals, (7, 6, 6, 6))))
    n = [len(outcomes), *(sum(o.status == s for o in outcomes) for s in ("pass", "out_of_scope", "fail"))]
    lines.append(f"{'all':<20}" + " " * 15 * len(kinds) + "".join(f"{t:>{w}}" for t, w in zip(n, (7, 6, 6, 6))))
    arbitrated = [o for o in outcomes if o.status == "pass" and o.reason]
    if arbitrated:
        lines += ["", f"passed by the fp64 arbiter (error > {TOLERANCE:g}, but no more than transformers' own):"]
        lines += [f"  {o.model_type}:{o.option}={o.value}: {o.reason}" for o in arbitrated]
    failures = [o for o in outcomes if o.status == "fail"]
    if failures:
        lines += ["", "failures:"]
        lines += [f"  {o.model_type}:{o.option}={o.value}: {o.reason}" for o in failures]
    return "\n".join(lines)


def markdown(outcomes: list[Outcome]) -> str:
    """Per type: variants tried, passed, out of scope (transformers rejects them), failed — a Markdown table."""
    rows: dict[str, list[int]] = {}
    for o in outcomes:
        cell = rows.setdefault(o.model_type, [0, 0, 0, 0])
        cell[0] += 1
        cell[{"pass": 1, "out_of_scope": 2, "fail": 3}[o.status]] += 1
    lines = ["| type | tried | passed | out of scope | failed |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {t} | {c[0]} | {c[1]} | {c[2]} | {c[3]} |" for t, c in sorted(rows.items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from freetoken_agent.runtime.model.adapters import supported_architectures

    parser = argparse.ArgumentParser(prog="python -m freetoken_agent.evals.fuzz.options", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("--types", nargs="*", help="model types (default: every supported MoE type)")
    parser.add_argument("--kinds", nargs="*", choices=list(GENERATORS), help="option kinds (default: all)")
    parser.add_argument("--per-type", type=int, help="a seeded sample of this many variants per type (default: all)")
    parser.add_argument("--match", help="only variants whose TYPE:OPTION=VALUE name matches this regex")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON outcome per line instead of the table")
    parser.add_argument("--markdown", action="store_true", help="also print the per-type counts as a Markdown table")
    parser.add_argument("--out-of-scope", action="store_true", help="also list out-of-scope variants and why")
    parser.add_argument("--report", metavar="JSONL", help="print the table of a finished --json sweep (runs nothing)")
    args = parser.parse_args(argv)
    if args.report:
        outcomes = [Outcome(**json.loads(line)) for line in Path(args.report).read_text().splitlines() if line.strip()]
        print(table(outcomes) + ("\n\n" + markdown(outcomes) if args.markdown else ""))
        return 1 if any(o.status == "fail" for o in outcomes) else 0
    supported = supported_architectures()
    types = args.types or supported
    unknown = [t for t in types if t not in supported]
    if unknown:
        print(f"not supported by the engine: {', '.join(unknown)}", file=sys.stderr)
        return 2
    todo = plan(types, tuple(args.kinds) if args.kinds else None, args.per_type, args.seed)
    if args.match:
        todo = [v for v in todo if re.search(args.match, v.name)]
    print(f"{len(todo)} variants of {len(types)} types", file=sys.stderr)
    outcomes = []
    for i, outcome in enumerate(sweep(todo, args.seed), 1):
        outcomes.append(outcome)
        if args.json:
            print(json.dumps(asdict(outcome)), flush=True)
        else:
            mark = {"pass": ".", "fail": "F", "out_of_scope": "o"}[outcome.status]
            print(mark, end="\n" if i % 80 == 0 else "", file=sys.stderr, flush=True)
    if not args.json:
        print(file=sys.stderr)
        print(table(outcomes))
        if args.markdown:
            print("\n" + markdown(outcomes))
        if args.out_of_scope:
            print("\nout of scope (transformers rejects):")
            for o in outcomes:
                if o.status == "out_of_scope":
                    print(f"  {o.model_type}:{o.option}={o.value}: {o.reason}")
    return 1 if any(o.status == "fail" for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
