"""One MoE layer step at M tokens: our fused C kernels against kt-kernel's AMX MoE (KTransformers), same weights.

Both sides get the same random bf16 experts (``gate``/``up [E, I, D]``, ``down [E, D, I]``), the same hidden states
and the same routing, and quantize the weights themselves. Ours: ``QuantizedExperts.from_float`` (the engine's
packing: gate rows then up rows as one ``w13 [2I, D]`` per expert) in each ``--formats`` format, timed as one
``ops.moe`` call (the fused step the engine runs while no expert reaches the dequantize crossover, reported as
``engine_crossover_tokens``) on every ISA path from ``avx512vnni`` up that ``ops.available_isas()`` lists (the best
one where the CPU has no AVX-512), the ``amx`` path in exact mode (``amx``: what a decode row and deterministic mode
run) and, where the CPU has AMX-BF16, as the engine runs a prompt step by default too (``amx-prompt``: the default
``prompts`` mode inside ``ops.prompt_step()``, i.e. bf16 tiles; ``ops.set_amx_mode``). The peer: ``kt_peer.py``
under kt-kernel's own interpreter (``--peer-python``; it pins another torch), one subprocess per method
(``AMXInt4``, ``AMXInt8``, ``AMXInt4_KGroup``).

Routing: per token, top-k distinct experts drawn from a Zipf-like popularity (expert of rank r has weight
``1 / r**skew`` over a seeded shuffle), weights the softmax of sorted router logits (Qwen3's renormalized top-k).
Reported per M and path: median ms per step (low-high), tokens/s, CPU ms per step, and the max abs error against
the plain-fp32 reference (``kt_peer.reference``) relative to the reference's max abs; ratios are peer ms / our ms
(> 1: ours faster) for our best q4 path against ``AMXInt4`` and ``AMXInt4_KGroup``, and q8 against ``AMXInt8``.
The sides run one after the other (ours, then the peer's processes), not alternated.

    freetoken bench moe-layer --tokens 512 --repeats 5

Legend: ``M``/``T`` tokens, ``E`` experts, ``K`` experts per token, ``D`` hidden, ``I`` expert intermediate.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from freetoken_agent.evals.perf import kt_peer
from freetoken_agent.evals.perf.harness import BenchError, row
from freetoken_agent.evals.perf.timing import repeat

PEER_PYTHON = "/tmp/ktvenv/bin/python"
INSTALL = "python -m venv DIR && DIR/bin/pip install kt-kernel  (then --peer-python DIR/bin/python)"
PAIRS = (("q4", "AMXInt4"), ("q8", "AMXInt8"), ("q4", "AMXInt4_KGroup"))
"""(our format, kt-kernel method) compared in the ratios."""
WARMUP = 2
PEER_TIMEOUT_S = 1800


@dataclass(frozen=True)
class Shape:
    """One MoE layer: ``experts`` of ``hidden`` → ``intermediate`` → ``hidden``, ``top_k`` per token."""

    hidden: int = 2048
    intermediate: int = 768
    experts: int = 64
    top_k: int = 8

    def __str__(self) -> str:
        return f"E={self.experts} top-{self.top_k} D={self.hidden} I={self.intermediate}"


def make_weights(shape: Shape, seed: int) -> dict[str, torch.Tensor]:
    """bf16 experts ``gate``/``up [E, I, D]``, ``down [E, D, I]`` at a trained layer's scale (std 1/sqrt(fan-in))."""
    gen = torch.Generator().manual_seed(seed)
    e, d, i = shape.experts, shape.hidden, shape.intermediate
    return {"gate": (torch.randn(e, i, d, generator=gen) / d**0.5).to(torch.bfloat16),
            "up": (torch.randn(e, i, d, generator=gen) / d**0.5).to(torch.bfloat16),
            "down": (torch.randn(e, d, i, generator=gen) / i**0.5).to(torch.bfloat16)}


def route(tokens: int, experts: int, top_k: int, skew: float,
          gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids [T, K]`` int64 (distinct per token, drawn from a Zipf-like popularity) and ``weights [T, K]`` fp32
    (softmax of sorted logits: the first id carries the largest weight)."""
    rank = torch.randperm(experts, generator=gen)  # [E]: each expert's popularity rank
    popularity = 1.0 / (rank.double() + 1) ** skew
    ids = torch.multinomial(popularity.float().expand(tokens, -1), top_k, replacement=False, generator=gen)
    logits = torch.randn(tokens, top_k, generator=gen).sort(dim=1, descending=True).values
    return ids, torch.softmax(logits, dim=1)


def make_tokens(shape: Shape, m: int, skew: float, seed: int) -> dict[str, torch.Tensor]:
    """``x [M, D]`` bf16 (unit-scale, as after the layer's norm), ``ids``, ``weights``."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + m)
    x = torch.randn(m, shape.hidden, generator=gen).to(torch.bfloat16)
    ids, weights = route(m, shape.experts, shape.top_k, skew, gen)
    return {"x": x, "ids": ids, "weights": weights}


def our_isas(requested: list[str] | None = None) -> list[str]:
    """The ISA paths to time: ``requested``, else every available one from ``avx512vnni`` up (new paths, e.g.
    AMX, join by themselves), else the best available."""
    from freetoken_agent.runtime.kernels import ops

    available = ops.available_isas()
    if requested:
        missing = [i for i in requested if i not in available]
        if missing:
            raise BenchError(f"--isas: this CPU's kernels run {', '.join(available)}, not {', '.join(missing)}")
        return requested
    return available[available.index("avx512vnni"):] if "avx512vnni" in available else available[-1:]


def _entry(m: int, side: str, path: str, seconds: dict[str, Any], cpu_s: float, error: float,
           **extra: Any) -> dict[str, Any]:
    """One timed path at one M: ``seconds`` a ``Spread.to_json``, ``cpu_s`` CPU seconds per step."""
    med = seconds["median"]
    return {"M": m, "side": side, "path": path, **extra,
            "ms": {k: round(seconds[k] * 1e3, 3) for k in ("median", "low", "high")},
            "tok_s": round(m / med, 1) if med else None, "cpu_ms": round(cpu_s * 1e3, 3), "error": round(error, 5)}


def _variants(isas: list[str]) -> list[tuple[str, str]]:
    """(ISA, label) pairs to time: every ISA (``amx`` in exact mode), and ``amx-prompt`` — the ``amx`` path as a
    prompt step runs it in the default mode, bf16 tiles — where this CPU has AMX-BF16 (``ops.set_amx_mode``)."""
    from freetoken_agent.runtime.kernels import ops

    out = [(isa, isa) for isa in isas]
    if "amx" in isas and ops.amx_bf16_supported():
        out.append(("amx", "amx-prompt"))
    return out


def run_ours(weights: dict[str, torch.Tensor], shape: Shape, inputs: dict[int, dict[str, torch.Tensor]],
             refs: dict[int, torch.Tensor], formats: list[str], isas: list[str], repeats: int) -> list[dict[str, Any]]:
    """Our fused step per format, ISA and M."""
    from freetoken_agent.runtime.kernels import ops
    from freetoken_agent.runtime.kernels.experts import QuantizedExperts

    out: list[dict[str, Any]] = []
    gate_up = torch.cat([weights["gate"], weights["up"]], dim=1)  # [E, 2I, D]: gate rows, then up rows
    for fmt in formats:
        qe = QuantizedExperts.from_float(gate_up, weights["down"], fmt, use_kernels=True)
        for isa, label in _variants(isas):
            ops.set_isa(isa)
            before = ops.set_amx_mode("prompts" if label == "amx-prompt" else "exact") if isa == "amx" else None
            for m, t in inputs.items():
                x, ids, wts = t["x"].float(), t["ids"], t["weights"]

                def step() -> torch.Tensor:
                    with ops.prompt_step() if label == "amx-prompt" else nullcontext():
                        return ops.moe(qe.fmt, qe.w13, qe.w2, (shape.hidden, shape.intermediate), x, ids, wts)

                for _ in range(WARMUP):
                    y = step()
                c0 = resource.getrusage(resource.RUSAGE_SELF)
                spread = repeat(step, repeats, warmup=0)
                c1 = resource.getrusage(resource.RUSAGE_SELF)
                cpu_s = (c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime) / repeats
                error = kt_peer.relative_error(y, refs[m])
                out.append(_entry(m, "ours", f"{fmt} {label}", spread.to_json(), cpu_s, error, format=fmt,
                                  isa=label))
            if before is not None:
                ops.set_amx_mode(before)
        del qe
    return out


def run_peer(peer_python: str, folder: Path, tokens: list[int], methods: list[str], threads: int,
             repeats: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """kt-kernel's side: ``kt_peer.py`` once per method under ``peer_python`` → (the peer's facts, result entries).
    Unavailable peers and failed methods come back as reasons, never as a traceback."""
    facts: dict[str, Any] = {"name": "kt-kernel", "python": peer_python}
    if not Path(peer_python).is_file():
        return {**facts, "available": False, "reason": f"no interpreter at {peer_python}", "install": INSTALL}, []
    entries: list[dict[str, Any]] = []
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    for method in methods:
        cmd = [peer_python, str(Path(kt_peer.__file__)), str(folder), "--method", method,
               "--tokens", ",".join(map(str, tokens)), "--threads", str(threads), "--repeats", str(repeats)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=folder, env=env, timeout=PEER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            entries.append({"side": "kt-kernel", "path": method, "failed": f"timed out after {PEER_TIMEOUT_S} s"})
            continue
        line = next((x for x in reversed(proc.stdout.splitlines()) if x.startswith("RESULT ")), None)
        if line is None:
            tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
            entries.append({"side": "kt-kernel", "path": method,
                            "failed": f"kt_peer.py exited with status {proc.returncode}: {tail}"})
            continue
        result = json.loads(line[len("RESULT "):])
        if not result.get("available"):
            return {**facts, "available": False, "reason": result.get("reason"), "install": INSTALL}, []
        facts.update(available=True, version=result["kt_kernel"], variant=result["variant"], torch=result["torch"])
        if "failed" in result:
            entries.append({"side": "kt-kernel", "path": method, "failed": result["failed"]})
            continue
        for r in result["results"]:
            entries.append(_entry(r["M"], "kt-kernel", method, r["seconds"], r["cpu_s"], r["error"],
                                  load_s=result["load_s"]))
    if "available" not in facts:
        facts.update(available=False, reason="; ".join(e["failed"] for e in entries), install=INSTALL)
    return facts, entries


def ratios(results: list[dict[str, Any]], tokens: list[int]) -> list[dict[str, Any]]:
    """Per M: peer ms / our best ms for each of ``PAIRS`` present (> 1: ours faster)."""
    out = []
    for m in tokens:
        here = [r for r in results if r.get("M") == m and "ms" in r]
        entry: dict[str, Any] = {"M": m}
        for fmt, method in PAIRS:
            ours = [r for r in here if r["side"] == "ours" and r["format"] == fmt]
            peer = [r for r in here if r["side"] == "kt-kernel" and r["path"] == method]
            if ours and peer:
                best = min(ours, key=lambda r: r["ms"]["median"])
                entry[f"{fmt}_vs_{method}"] = round(peer[0]["ms"]["median"] / best["ms"]["median"], 3)
                entry[f"{fmt}_best_path"] = best["path"]
        out.append(entry)
    return out


def load_stats(ids: torch.Tensor, experts: int) -> dict[str, Any]:
    """How skewed one step's routing is: tokens of the busiest expert over the mean, experts with any token."""
    counts = torch.bincount(ids.reshape(-1), minlength=experts).float()
    return {"busiest_over_mean": round(float(counts.max() / counts.mean()), 2), "experts_used": int((counts > 0).sum())}


def measure(shape: Shape, tokens: list[int], *, threads: int = 2, repeats: int = 5, peer: str = "kt-kernel",
            peer_python: str = PEER_PYTHON, formats: list[str] | None = None, isas: list[str] | None = None,
            methods: list[str] | None = None, skew: float = 0.5, seed: int = 0,
            peer_threads: int | None = None) -> dict[str, Any]:
    """The row's report (see the module docstring)."""
    from freetoken_agent.runtime.kernels import build, ops
    from freetoken_agent.runtime.kernels.experts import crossover_tokens
    from freetoken_agent.runtime.kernels.threads import default_threads

    if build.load() is None:
        raise BenchError(f"the C kernels are unavailable: {build.status().reason}")
    formats = formats or ["q4", "q8"]
    methods = methods or list(kt_peer.METHODS)
    isa_list = our_isas(isas)
    torch_threads = torch.get_num_threads()
    ops.set_threads(threads)
    torch.set_num_threads(threads)
    try:
        weights = make_weights(shape, seed)
        inputs = {m: make_tokens(shape, m, skew, seed) for m in tokens}
        refs = {m: kt_peer.reference(t["x"], t["ids"], t["weights"], weights["gate"], weights["up"], weights["down"])
                for m, t in inputs.items()}
        results = run_ours(weights, shape, inputs, refs, formats, isa_list, repeats)
        if peer == "none":
            facts: dict[str, Any] = {"name": None, "available": False, "reason": "--peer none"}
        else:
            with tempfile.TemporaryDirectory(prefix="ft-moe-layer-") as tmp:
                folder = Path(tmp)
                torch.save(weights, folder / "weights.pt")
                for m, t in inputs.items():
                    torch.save(t, folder / f"tokens-{m}.pt")
                    torch.save(refs[m], folder / f"reference-{m}.pt")
                del weights
                facts, entries = run_peer(peer_python, folder, tokens, methods, peer_threads or threads, repeats)
                facts["threads"] = peer_threads or threads
            results += entries
    finally:
        ops.set_isa("best")
        ops.set_threads(default_threads())
        torch.set_num_threads(torch_threads)
    return {"shape": {"experts": shape.experts, "top_k": shape.top_k, "hidden": shape.hidden,
                      "intermediate": shape.intermediate},
            "tokens": tokens, "threads": threads, "repeats": repeats,
            "routing": {"skew": skew, "seed": seed,
                        **{f"M{m}": load_stats(t["ids"], shape.experts) for m, t in inputs.items()}},
            "ours": {"isas": [label for _, label in _variants(isa_list)],
                     "formats": formats, "engine_crossover_tokens": crossover_tokens()},
            "peer": facts, "results": results, "ratios": ratios(results, tokens),
            "notes": ["sides run one after the other (ours, then one kt-kernel process per method), not alternated",
                      "error: max |out - ref| / max |ref|, ref = plain fp32 torch over the same bf16 weights"]}


def format_table(report: dict[str, Any], args: argparse.Namespace | None = None) -> str:
    s, peer = report["shape"], report["peer"]
    lines = [f"moe-layer: E={s['experts']} top-{s['top_k']} D={s['hidden']} I={s['intermediate']}, "
             f"{report['threads']} threads, {report['repeats']} repeats; routing skew {report['routing']['skew']} "
             f"(busiest expert / mean: " + ", ".join(f"M={m} {report['routing'][f'M{m}']['busiest_over_mean']}x"
                                                      for m in report["tokens"]) + ")"]
    if peer.get("available"):
        lines.append(f"peer: kt-kernel {peer['version']} ({peer['variant']} build, torch {peer['torch']}, "
                     f"{peer['threads']} worker threads) via {peer['python']}")
    else:
        install = f"; install: {peer['install']}" if peer.get("install") else ""
        lines.append(f"peer unavailable: {peer.get('reason')}{install}")
    lines += ["", "|    M | side      | path               | ms median (low-high)     |    tok/s |  CPU ms "
                  "| err/max|ref| |",
              "|---:|---|---|---|---:|---:|---:|"]
    timed = sorted((r for r in report["results"] if "ms" in r), key=lambda r: (r["M"], r["side"] != "ours"))
    for r in timed:
        ms = r["ms"]
        lines.append(f"| {r['M']:>4} | {r['side']:<9} | {r['path']:<18} | "
                     f"{_ms(ms['median']):>8} ({_ms(ms['low'])}-{_ms(ms['high'])}) | {r['tok_s']:>8.0f} | "
                     f"{_ms(r['cpu_ms']):>7} | {r['error']:>12.4f} |")
    for r in report["results"]:
        if "failed" in r:
            lines.append(f"|    - | {r['side']:<9} | {r['path']:<18} | failed: {r['failed']} | | | |")
    rat = [r for r in report["ratios"] if len(r) > 1]
    if rat:
        lines += ["", "ratios, peer ms / our best ms (> 1: ours faster):"]
        for r in rat:
            pairs = [f"{fmt} vs {method} {r[f'{fmt}_vs_{method}']:.2f}x" for fmt, method in PAIRS
                     if f"{fmt}_vs_{method}" in r]
            lines.append(f"  M={r['M']}: " + ", ".join(pairs))
    return "\n".join(lines)


def _ms(v: float) -> str:
    return f"{v:.3f}" if v < 1 else f"{v:.1f}" if v >= 100 else f"{v:.2f}"


def headline(report: dict[str, Any]) -> dict[str, Any]:
    m = max(report["tokens"])
    out: dict[str, Any] = {"M": m, "shape": "E{experts}xK{top_k} D{hidden} I{intermediate}".format(**report["shape"])}
    for r in report["results"]:
        if r.get("M") == m and "ms" in r:
            key = f"{r['format']}_{r['isa']}_ms" if r["side"] == "ours" else f"kt_{r['path']}_ms"
            out[key] = r["ms"]["median"]
    for r in report["ratios"]:
        if r["M"] == m:
            out.update({k: v for k, v in r.items() if "_vs_" in k})
    return out


def _csv(text: str | None) -> list[str] | None:
    return [v.strip() for v in text.split(",") if v.strip()] if text else None


def options(p: argparse.ArgumentParser) -> None:
    d = Shape()
    p.add_argument("--tokens", default="512", help="comma-separated token counts M per step (default 512)")
    p.add_argument("--hidden", type=int, default=d.hidden)
    p.add_argument("--intermediate", type=int, default=d.intermediate)
    p.add_argument("--experts", type=int, default=d.experts)
    p.add_argument("--top-k", type=int, default=d.top_k)
    p.add_argument("--threads", type=int, default=2, help="threads of each side (default 2)")
    p.add_argument("--repeats", type=int, default=5, help=f"timed steps per path after {WARMUP} untimed ones")
    p.add_argument("--peer-threads", type=int, default=None,
                   help="kt-kernel's worker threads (default: --threads; its pool also runs a submitting thread)")
    p.add_argument("--peer", choices=("kt-kernel", "none"), default="kt-kernel")
    p.add_argument("--peer-python", default=PEER_PYTHON,
                   help=f"an interpreter with kt-kernel installed (default {PEER_PYTHON}; install: {INSTALL})")
    p.add_argument("--peer-methods", default=None,
                   help=f"kt-kernel methods (default {','.join(kt_peer.METHODS)})")
    p.add_argument("--formats", default=None, help="our formats (default q4,q8)")
    p.add_argument("--isas", default=None, help="our ISA paths (default: every available one from avx512vnni up)")
    p.add_argument("--skew", type=float, default=0.5, help="Zipf exponent of expert popularity (0: uniform)")
    p.add_argument("--seed", type=int, default=0)


@row("moe-layer", "one MoE layer step at M tokens (fused C kernels per ISA) vs kt-kernel's AMX MoE, same weights "
     "and routing: ms, tok/s, error vs fp32", options, format=format_table, headline=headline)
def moe_layer_row(args: argparse.Namespace) -> dict[str, Any]:
    from freetoken_agent.evals.perf.bench_kernels import parse_formats, parse_ints

    tokens = list(parse_ints(args.tokens, "tokens") or ())
    for flag in ("hidden", "intermediate", "experts", "top_k", "threads", "repeats", "peer_threads"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise BenchError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if args.top_k > args.experts:
        raise BenchError(f"--top-k {args.top_k} exceeds --experts {args.experts}")
    methods = _csv(args.peer_methods)
    bad = [m for m in methods or () if m not in kt_peer.METHODS]
    if bad:
        raise BenchError(f"--peer-methods wants some of {', '.join(kt_peer.METHODS)}, got {', '.join(bad)}")
    shape = Shape(args.hidden, args.intermediate, args.experts, args.top_k)
    if not args.json:
        print(f"moe-layer: {shape}, M={tokens}, {args.threads} threads", file=sys.stderr)
    return measure(shape, tokens, threads=args.threads, repeats=args.repeats, peer=args.peer,
                   peer_python=args.peer_python, formats=list(parse_formats(args.formats)) if args.formats else None,
                   isas=_csv(args.isas), methods=methods,
                   skew=args.skew, seed=args.seed, peer_threads=args.peer_threads)


if __name__ == "__main__":
    from freetoken_agent.evals.perf.harness import module_main

    raise SystemExit(module_main("moe-layer"))
