"""Constrained decoding's cost per token: the same requests decoded free and under a JSON-Schema grammar.

    python -m freetoken_agent.evals.perf.bench_constrained [--model builtin] [--requests 4] [--tokens 96]

Reports, per run: tokens, decode tok/s, and for the constrained run the mask time per token (llguidance's mask
fill + applying it to the logits) — the overhead the grammar adds to each step. Each request decodes exactly
``--tokens`` tokens (the schema's string has that many characters at least, so neither run stops early).
"""

from __future__ import annotations

import argparse
import time
from typing import Any


def _decode(backend: Any, processor: Any, ids: list[int], tokens: int, seed: int) -> tuple[int, float]:
    """(tokens generated, seconds) for one request, greedy-free sampling at temperature 1."""
    t0 = time.perf_counter()
    result = backend.engine.generate(ids, max_new_tokens=tokens, temperature=1.0, seed=seed, processor=processor,
                                     stop_token_ids=[])
    return len(result.token_ids), time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from freetoken_agent.backends.base import Constraint
    from freetoken_agent.backends.local import LocalEngine
    from freetoken_agent.runtime.models import resolve_model

    backend = LocalEngine.from_pretrained(resolve_model(args.model))
    schema = {"type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string"},
                                                         "minItems": args.tokens}}, "required": ["notes"]}
    ids = backend.engine.tokenizer.encode("Notes on the bug in calc.py:")
    backend.grammar(Constraint("json", schema), [])  # build the grammar tokenizer once, outside the timing
    rows = []
    for label in ("free", "json_schema"):
        n_total, s_total, mask_s, steps = 0, 0.0, 0.0, 0
        for seed in range(args.requests):
            processor = backend.grammar(Constraint("json", schema), []) if label != "free" else None
            n, s = _decode(backend, processor, ids, args.tokens, seed)
            n_total, s_total = n_total + n, s_total + s
            if processor is not None:
                mask_s, steps = mask_s + processor.mask_s, steps + processor.steps
        mask = f"{mask_s / steps * 1000:.3f} ms" if steps else "-"
        rows.append((label, n_total, n_total / s_total, mask))
    print(f"{'run':<12} {'tokens':>7} {'tok/s':>8} {'mask/token':>11}")
    for label, n, rate, mask in rows:
        print(f"{label:<12} {n:>7} {rate:>8.1f} {mask:>11}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
