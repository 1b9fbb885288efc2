"""Framework overhead per decoded token: the time (or the instructions) a decode step spends outside the kernels.

A decode step's compute is the C kernels (``runtime/kernels``: quantized and fp32 GEMV, fused MoE, attention, norms,
RoPE) and torch's matmul / attention ops; everything else — Python, torch's dispatch of small ops, the scheduler,
sampling, detokenizing — is framework. Greedy tokens are decoded through the real engine path (``Engine.generate``:
scheduler thread, ``ModelRunner``, ``Decoder.forward_batch``), speculation off so every step is one token.

Two measurements:

* ``--mode time`` (default): wall-clock seconds per token, and seconds inside the kernels, timed per call
  (``ops.timed_kernels`` swaps the kernels' library for a timing proxy; torch's ``F.linear``, ``mm``, ``bmm``,
  ``matmul``, ``@`` and ``scaled_dot_product_attention`` are wrapped the same way for the run). Each round decodes
  1 and N + 1 tokens after the same prompt; per-token values are the differences / N (load, prefill and the
  request's set-up cancel). Medians over rounds. The timing wrappers' own cost (~1 µs per call) lands outside.
* ``--mode callgrind``: instruction counts under ``valgrind --tool=callgrind`` (repeatable on a busy machine):
  two runs decode K and 2K tokens, the per-token count is their difference / K, split by where each instruction
  ran — the kernels' library, BLAS/GEMM code (torch's and oneDNN's JIT), everything else (Python, torch dispatch,
  libc). One thread and no spinning workers (``FREETOKEN_CPU_SPIN_US=0``, ``OMP_WAIT_POLICY=PASSIVE``) so idle
  polling does not count as work.

    nice -n 10 python -m freetoken_agent.evals.perf.bench_overhead [--model builtin|synthetic:ARCH|DIR]
        [--quant none|q8|q4] [--threads 2] [--tokens 64] [--rounds 5] [--mode time|callgrind] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from freetoken_agent.evals.perf.harness import row, run_json_main

PROMPT = list(range(5, 37))  # 32 token ids that exist in every vocabulary we load (≥ 1024)


def model_path(name: str) -> Path:
    """``builtin``, ``synthetic:ARCH`` (written once under the cache) or a model folder."""
    if name == "builtin":
        from freetoken_agent.runtime.builtin import builtin_model_dir

        return builtin_model_dir()
    if name.startswith("synthetic:"):
        from freetoken_agent.runtime.synthetic import synthetic_model_dir

        return synthetic_model_dir(name.split(":", 1)[1])
    path = Path(name)
    if not path.exists():
        raise SystemExit(f"bench_overhead: no model at {path}")
    return path


def load(name: str, quant: str, threads: int) -> Any:
    from freetoken_agent.runtime.engine import Engine

    return Engine.from_pretrained(model_path(name), threads=threads, quant=quant, speculate=False, progress=False)


def decode(engine: Any, n: int) -> Any:
    return engine.generate(PROMPT, max_new_tokens=n, stop_token_ids=[])


# ------------------------------------------------------------------------------------------------ wall clock


class OpClock:
    """Wall and CPU seconds (of the calling thread) inside wrapped calls — torch's product and attention ops, the
    scheduler's step, the runner's forward — and their count."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.cpu_seconds = 0.0
        self.calls = 0

    def reset(self) -> None:
        self.seconds = self.cpu_seconds = 0.0
        self.calls = 0


TORCH_OPS = (("torch.nn.functional", "linear"), ("torch.nn.functional", "scaled_dot_product_attention"),
             ("torch", "mm"), ("torch", "bmm"), ("torch", "matmul"), ("torch", "addmm"))


def _timed(fn: Callable[..., Any], clock: OpClock) -> Callable[..., Any]:
    now, cpu = time.perf_counter, time.thread_time

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0, c0 = now(), cpu()
        try:
            return fn(*args, **kwargs)
        finally:
            clock.seconds += now() - t0
            clock.cpu_seconds += cpu() - c0
            clock.calls += 1

    return timed


@contextmanager
def timed_torch_ops() -> Iterator[OpClock]:
    """Wrap torch's matmul and attention entry points (module functions and ``Tensor.__matmul__``) with a timer."""
    import importlib

    import torch

    clock = OpClock()
    saved = []
    for mod_name, attr in TORCH_OPS:
        mod = importlib.import_module(mod_name)
        saved.append((mod, attr, getattr(mod, attr)))
    saved.append((torch.Tensor, "__matmul__", torch.Tensor.__matmul__))
    try:
        for owner, attr, fn in saved:
            setattr(owner, attr, _timed(fn, clock))
        yield clock
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)


def measure_time(name: str, quant: str, threads: int, tokens: int, rounds: int) -> dict[str, Any]:
    """Per-token wall, kernel and torch-op seconds (medians of the N+1 vs 1 token differences); the same split in CPU
    seconds of the engine thread, which a busy machine disturbs less (time waiting for a core is not counted)."""
    from freetoken_agent.runtime.kernels import build, ops

    engine = load(name, quant, threads)
    try:
        decode(engine, 4)  # warm-up: kernels built, pages allocated, the prompt cached
        rows: list[dict[str, float]] = []
        kernels_on = build.load() is not None
        step, forward = OpClock(), OpClock()
        engine.scheduler.step = _timed(engine.scheduler.step, step)  # everything the engine thread does per step
        engine.runner.run = _timed(engine.runner.run, forward)  # the forward, for the split
        for _ in range(rounds):
            one: dict[str, float] = defaultdict(float)
            for n in (1, tokens + 1):
                with (ops.timed_kernels() if kernels_on else _no_clock()) as kc, timed_torch_ops() as tc:
                    step.reset()
                    forward.reset()
                    t0 = time.perf_counter()
                    decode(engine, n)
                    wall = time.perf_counter() - t0
                sign = 1.0 if n > 1 else -1.0
                values = {
                    "wall": wall, "step": step.seconds, "forward": forward.seconds,
                    "kernels": kc.total if kc is not None else 0.0, "torch_ops": tc.seconds,
                    "cpu_step": step.cpu_seconds, "cpu_compute": (kc.cpu_total if kc is not None else 0.0) +
                    tc.cpu_seconds, "calls": (sum(kc.calls.values()) if kc is not None else 0) + tc.calls,
                }
                for key, v in values.items():
                    one[key] += sign * v
            r = {k: v / tokens for k, v in one.items()}
            compute = r["kernels"] + r["torch_ops"]
            r.update(outside=r["wall"] - compute, in_forward=r["forward"] - compute, in_step=r["step"] - r["forward"],
                     between=r["wall"] - r["step"], cpu_outside=r["cpu_step"] - r["cpu_compute"])
            rows.append(r)
        # medians of each quantity over rounds, every derived one computed within its round first (on a busy
        # machine the rounds differ by more than the parts, so medians of the parts would not add up)
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        ms = lambda v: round(v * 1e3, 3)  # noqa: E731
        return {
            "model": name, "quant": quant, "threads": threads, "tokens": tokens, "rounds": rounds,
            "layers": engine.spec.num_layers,
            "ms_per_token": ms(med["wall"]),
            "ms_in_kernels": ms(med["kernels"]),
            "ms_in_torch_ops": ms(med["torch_ops"]),
            "ms_outside": ms(med["outside"]),
            "outside_share": round(statistics.median(r["outside"] / r["wall"] for r in rows), 4),
            "ms_outside_in_forward": ms(med["in_forward"]),
            "ms_outside_in_step": ms(med["in_step"]),
            "ms_outside_steps": ms(med["between"]),
            "cpu_ms_outside": ms(med["cpu_outside"]),
            "cpu_ms_step": ms(med["cpu_step"]),
            "timed_calls_per_token": round(med["calls"], 1),
            "rounds_ms_per_token": [ms(r["wall"]) for r in rows],
            "rounds_ms_outside": [ms(r["outside"]) for r in rows],
            "rounds_cpu_ms_outside": [ms(r["cpu_outside"]) for r in rows],
        }
    finally:
        engine.close()


@contextmanager
def _no_clock() -> Iterator[None]:
    yield None


# ------------------------------------------------------------------------------------------------ callgrind

CALLGRIND_ENV = {"FREETOKEN_CPU_SPIN_US": "0", "OMP_WAIT_POLICY": "PASSIVE", "FREETOKEN_CPU_THREADS": "1",
                 "PYTHONHASHSEED": "0"}
BLAS = re.compile(r"gemm|gemv|mkl_blas|sgemm|cblas|openblas|dnnl|brgemm|cpublas|_jit_|jit_avx|jit_uni", re.I)


def parse_callgrind(path: Path) -> dict[tuple[str, str], int]:
    """Self instruction counts per (object, function) of a callgrind output file (name compression handled; the
    inclusive costs on ``calls=`` lines skipped)."""
    names: dict[str, dict[str, str]] = {"ob": {}, "fn": {}}
    costs: dict[tuple[str, str], int] = defaultdict(int)
    ob = fn = "?"
    skip = False

    def resolve(kind: str, text: str) -> str:
        text = text.strip()
        m = re.match(r"\((\d+)\)\s*(.*)", text)
        if not m:
            return text
        if m.group(2):
            names[kind][m.group(1)] = m.group(2)
            return m.group(2)
        return names[kind].get(m.group(1), "?")

    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            c = line[:1]
            if c.isdigit() or c in "+-*":
                if skip:
                    skip = False
                    continue
                parts = line.split()
                if len(parts) >= 2:
                    costs[(ob, fn)] += int(parts[1])
            elif line.startswith("ob="):
                ob = resolve("ob", line[3:])
            elif line.startswith("fn="):
                fn = resolve("fn", line[3:])
            elif line.startswith("cob="):
                resolve("ob", line[4:])
            elif line.startswith("cfn="):
                resolve("fn", line[4:])
            elif line.startswith("calls="):
                skip = True
    return costs


def classify(ob: str, fn: str) -> str:
    base = os.path.basename(ob)
    if base.startswith("ft_kernels"):
        return "kernels"
    if ob in ("???", "?") or BLAS.search(fn) or "mkl" in base or "openblas" in base:
        return "blas"
    return "outside"


def callgrind_run(name: str, quant: str, tokens: int, out: Path) -> None:
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise SystemExit("bench_overhead: valgrind is not installed (apt-get install -y valgrind)")
    cmd = [valgrind, "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, "-m",
           "freetoken_agent.evals.perf.bench_overhead", "--worker", "--model", name, "--quant", quant,
           "--tokens", str(tokens)]
    proc = subprocess.run(cmd, env={**os.environ, **CALLGRIND_ENV}, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"bench_overhead: the callgrind run failed: {tail}")


def measure_callgrind(name: str, quant: str, tokens: int) -> dict[str, Any]:
    """Instructions per token (2K − K tokens, / K) in the kernels, in BLAS, and outside; top outside functions."""
    with tempfile.TemporaryDirectory(prefix="ft-callgrind-") as tmp:
        runs = {}
        for k in (tokens, 2 * tokens):
            path = Path(tmp) / f"cg-{k}.out"
            callgrind_run(name, quant, k, path)
            runs[k] = parse_callgrind(path)
    diff: dict[tuple[str, str], float] = defaultdict(float)
    for key, v in runs[2 * tokens].items():
        diff[key] += v / tokens
    for key, v in runs[tokens].items():
        diff[key] -= v / tokens
    parts: dict[str, float] = defaultdict(float)
    by_object: dict[str, float] = defaultdict(float)
    outside_fns: dict[str, float] = defaultdict(float)
    for (ob, fn), v in diff.items():
        part = classify(ob, fn)
        parts[part] += v
        if part == "outside":
            by_object[os.path.basename(ob)] += v
            short = fn if len(fn) <= 100 else fn[:97] + "..."  # C++ template names run to kilobytes
            outside_fns[f"{short} [{os.path.basename(ob)}]"] += v
    total = sum(parts.values())
    top = sorted(outside_fns.items(), key=lambda kv: -kv[1])[:15]
    return {
        "model": name, "quant": quant, "threads": 1, "tokens": tokens,
        "instr_per_token": round(total),
        "instr_in_kernels": round(parts["kernels"]),
        "instr_in_blas": round(parts["blas"]),
        "instr_outside": round(parts["outside"]),
        "outside_share": round(parts["outside"] / total, 4) if total > 0 else None,
        "outside_by_object": {k: round(v) for k, v in sorted(by_object.items(), key=lambda kv: -kv[1])[:8]},
        "top_outside_functions": {k: round(v) for k, v in top},
    }


def worker(name: str, quant: str, tokens: int) -> None:
    """The process callgrind watches: load, one short warm-up request, then ``tokens`` greedy tokens."""
    engine = load(name, quant, 1)
    try:
        decode(engine, 2)
        decode(engine, tokens + 1)
    finally:
        engine.close()


# ------------------------------------------------------------------------------------------------ main


def show(r: dict[str, Any]) -> None:
    head = f"{r['model']} quant={r['quant']} threads={r['threads']}"
    if "ms_per_token" in r:
        print(f"{head}: {r['ms_per_token']:.3f} ms/token = kernels {r['ms_in_kernels']:.3f} + torch ops "
              f"{r['ms_in_torch_ops']:.3f} + outside {r['ms_outside']:.3f} ms ({100 * r['outside_share']:.1f}%: "
              f"{r['ms_outside_in_forward']:.3f} in the forward, {r['ms_outside_in_step']:.3f} in the rest of the "
              f"step, {r['ms_outside_steps']:.3f} between steps); engine-thread CPU outside the compute "
              f"{r['cpu_ms_outside']:.3f} ms of {r['cpu_ms_step']:.3f}; {r['timed_calls_per_token']:.0f} timed "
              f"calls/token; rounds {r['rounds_ms_per_token']}")
    else:
        print(f"{head}: {r['instr_per_token']:,} instr/token = kernels {r['instr_in_kernels']:,} + BLAS "
              f"{r['instr_in_blas']:,} + outside {r['instr_outside']:,} ({100 * r['outside_share']:.1f}%)")
        print("  outside by object:", ", ".join(f"{k} {v:,}" for k, v in r["outside_by_object"].items()))
        for fn, v in r["top_outside_functions"].items():
            print(f"    {v:>12,}  {fn}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", help="builtin, synthetic:ARCH or a folder (repeatable; default "
                    "builtin and synthetic:qwen3_moe)")
    ap.add_argument("--quant", default="none", help="routed experts: none, q8, q4 (default none)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64, help="tokens per measurement (callgrind: K)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--mode", choices=("time", "callgrind"), default="time")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    models = args.model or ["builtin", "synthetic:qwen3_moe"]
    if args.worker:
        worker(models[0], args.quant, args.tokens)
        return
    from freetoken_agent.runtime.errors import FreeTokenError

    results = []
    for name in models:
        try:
            if args.mode == "time":
                r = measure_time(name, args.quant, args.threads, args.tokens, args.rounds)
            else:
                r = measure_callgrind(name, args.quant, args.tokens)
        except FreeTokenError as exc:
            raise SystemExit(f"bench_overhead: {name}: {exc}") from None
        results.append(r)
        if not args.json:
            show(r)
    if args.json:
        print(json.dumps(results, indent=2))




@row("overhead", "framework overhead per decoded token: wall time (or instructions) outside the kernels; flags are bench_overhead's", passthrough=True)
def overhead_row(args: argparse.Namespace) -> dict[str, Any]:
    return run_json_main(main, args.passthrough)

if __name__ == "__main__":
    main()
