"""Expert-kernel benchmark: our C kernels vs torch vs ggml (when installed) on real MoE expert shapes.

Every path computes ``y [M, N] = x [M, K] @ W^T`` for a weight ``W [N, K]``, cycling through enough copies of
the weight that the working set exceeds the last-level cache, so the numbers are what decode sees when it
streams experts from RAM. Paths are timed round-robin (A/B/C/A/B/C…) and reported as medians, so load from other
processes hits every path alike. GB/s counts the bytes of the weight as stored (codes + scales).

Our kernels run in each block format they compute in (``FORMATS``: Q4_0, Q8_0, GGUF's Q4_K / Q5_K / Q6_K as
Q4_K_M / Q5_K_M files hold them, and MXFP4 as GPT-OSS files do, at 4.5 / 8.5 / 4.5 / 5.5 / 6.56 / 4.25 bits per
weight), so the default shapes — a 2048-hidden, 768-intermediate expert's gate/up and down, the 7.5B benchmark
model's — compare the formats at M=1 (decode) side by side.

Legend: ``N`` weight rows, ``K`` reduction dim, ``M`` tokens, ``T``/``E``/``D``/``I`` as in the MoE layer.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from freetoken_agent.evals.perf.harness import BenchError, row
from freetoken_agent.evals.perf.timing import Spread

SHAPES = ((768, 2048), (2048, 768), (1536, 4096))  # (N, K): gate/up and down of a 2048-hidden model, a larger one
M_VALUES = (1, 4, 16, 64, 256)
FORMATS = ("q4", "q8", "q4_k", "q5_k", "q6_k", "mxfp4")  # our kernels' formats (K-quants where 256 divides K)
FORMAT_ALIASES = {"q4_0": "q4", "q8_0": "q8"}
WORKING_SET = 256 << 20  # bytes cycled per path: well above the L3 of the CPUs we target


@dataclass
class Result:
    """One benchmark row (the ``--json`` schema)."""

    kernel: str
    format: str
    shape: str
    M: int
    threads: int
    gbps: float
    seconds: float
    fraction_of_read_bw: float = 0.0


@dataclass
class Report:
    """All rows plus the memory read bandwidth measured in the same run (per thread count).

    The read bandwidth is timed as one more path inside every row's round-robin (reading as many bytes as the
    q4 weight, from a 256 MiB buffer), so each row's ``fraction_of_read_bw`` compares like with like under the
    same load, and never taken below a 256 MiB streaming read on the same threads timed before the rows (with
    two pools alternating, a short read often ran on one thread); ``memory_read_gbps_by_threads`` is the median
    over rows, ``memory_read_gbps`` the largest.
    """

    memory_read_gbps: float
    memory_read_gbps_by_threads: dict[str, float]
    results: list[Result] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, object]:
        return {**asdict(self), "results": [asdict(r) for r in self.results]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Report:
        return cls(d["memory_read_gbps"], d["memory_read_gbps_by_threads"], [Result(**r) for r in d["results"]],
                   list(d["notes"]))


@dataclass
class Path:
    """A kernel under test: ``run(i)`` computes with weight copy ``i``; ``nbytes`` is one copy's size."""

    kernel: str
    fmt: str
    nbytes: int
    copies: int
    run: Callable[[int], object]


_working_set = [WORKING_SET]


def _copies(nbytes: int) -> int:
    return max(2, min(512, -(-_working_set[0] // max(1, nbytes))))


def _alloc(nbytes: int) -> torch.Tensor:
    """Weight memory for every path: 2 MiB pages (as the engine keeps its weights) or ordinary, per ``run``."""
    from freetoken_agent.runtime.kernels import hugepages

    return hugepages.empty(nbytes) if _huge[0] else torch.empty(nbytes, dtype=torch.uint8)


_huge = [True]


def _packed(w: torch.Tensor, fmt: str) -> Any:
    """``w`` in ``fmt`` in the kernels' tiles (Q4_0/Q8_0 by the C quantizer, the others by their torch ones)."""
    from freetoken_agent.runtime.kernels import ops
    from freetoken_agent.runtime.quant import quantize
    from freetoken_agent.runtime.quant.formats import block_format

    if fmt in ("q4", "q8"):
        return ops.PackedWeight.from_blocks(quantize(w, fmt, refine=False))
    return ops.PackedWeight.from_rows(fmt, block_format(fmt).quantize_rows(w), w.shape[1])


def our_paths(n: int, k: int, m: int, x: torch.Tensor, formats: tuple[str, ...] = FORMATS) -> list[Path]:
    """Our C GEMV in each of ``formats`` (K-quants where ``k`` is a multiple of 256) and, from M=16, the prefill
    path (C dequantize to fp32 + torch.mm)."""
    from freetoken_agent.runtime.kernels import ops

    paths = []
    w = torch.randn(n, k)
    for fmt in formats:
        if fmt.endswith("_k") and k % 256:
            continue
        pw = _packed(w, fmt)
        copies = _copies(pw.nbytes)
        big = _alloc(pw.nbytes * copies)
        big.view(copies, pw.nbytes).copy_(pw.data.view(1, -1).expand(copies, -1))
        views = [ops.PackedWeight(pw.fmt, n, k, big[i * pw.nbytes : (i + 1) * pw.nbytes]) for i in range(copies)]
        paths.append(Path("freetoken-c", fmt, pw.nbytes, copies, lambda i, v=views: ops.linear(v[i], x)))
        if m >= 16:
            buf = torch.empty(n, k)

            def dequant_mm(i: int, v: list[ops.PackedWeight] = views, buf: torch.Tensor = buf) -> torch.Tensor:
                return torch.mm(x, ops.dequantize(v[i], buf).t())

            paths.append(Path("freetoken-dequant-mm", fmt, pw.nbytes, copies, dequant_mm))
    copies = _copies(n * k * 4)
    dense = [torch.randn(n, k) for _ in range(copies)]
    paths.append(Path("torch-linear", "fp32", n * k * 4, copies, lambda i: torch.nn.functional.linear(x, dense[i])))
    return paths


def time_paths(
    paths: list[Path], reps: int, budget_s: float, batch: int = 5, pause_s: float = 0.010, warm_s: float = 0.0005
) -> list[float]:
    """Median seconds per call of each path, timed round-robin in batches.

    Each round runs every path after a pause longer than any pool polls (ggml's threadpool polls ~7.7 ms after a
    call, libgomp's a few ms, ours 5 ms): every path starts with its pool asleep, none competes with the next
    path. Then untimed calls for ``warm_s`` (at least one) wake the path's pool: a woken thread joins some
    100 µs later on this VM, and one call of 30 µs ran before it arrived. Then ``batch`` timed calls, each on the
    next weight copy, measure the steady state a decode step sees (its kernel calls come back to back).
    """
    times: list[list[float]] = [[] for _ in paths]
    cursor = [0] * len(paths)
    start = time.perf_counter()
    for r in range(max(1, reps // batch)):
        for j, p in enumerate(paths):
            time.sleep(pause_s)
            t_warm = time.perf_counter()
            while True:
                cursor[j] += 1
                p.run(cursor[j] % p.copies)
                if time.perf_counter() - t_warm >= warm_s:
                    break
            for _ in range(batch):
                cursor[j] += 1
                i = cursor[j] % p.copies
                t0 = time.perf_counter()
                p.run(i)
                times[j].append(time.perf_counter() - t0)
        if r >= 2 and time.perf_counter() - start > budget_s:
            break
    return [Spread.of(t).median for t in times]


def read_path(nbytes: int, buf: torch.Tensor) -> Path:
    """Streaming read of ``nbytes`` (one weight's size) from a different place of ``buf`` each call."""
    from freetoken_agent.runtime.kernels import ops

    copies = max(1, buf.numel() // nbytes)
    lib = ops._lib()
    base = buf.data_ptr()
    return Path("memory-read", "-", nbytes, copies, lambda i: lib.ft_read_bandwidth(base + i * nbytes, nbytes, 1))


def moe_layer_paths(threads: int) -> list[Path]:
    """One MoE layer step for one token (E=64, top-8, D=2048, I=768, q4): fused C call vs a Python loop of GEMVs."""
    from freetoken_agent.runtime.kernels import ops
    from freetoken_agent.runtime.kernels.experts import QuantizedExperts

    e, d, i, k = 64, 2048, 768, 8
    one = QuantizedExperts.from_float(torch.randn(1, 2 * i, d) / 45, torch.randn(1, d, i) / 28, "q4")
    w13, w2 = _alloc(one.w13.numel() * e).view(e, -1), _alloc(one.w2.numel() * e).view(e, -1)
    w13.copy_(one.w13.expand(e, -1))
    w2.copy_(one.w2.expand(e, -1))
    qe = QuantizedExperts("q4", w13, w2, d, i, packed=True)
    x = torch.randn(1, d)
    gen = torch.Generator().manual_seed(0)
    routes = [torch.randperm(e, generator=gen)[:k].reshape(1, k) for _ in range(64)]
    wts = torch.full((1, k), 1.0 / k)
    expert_bytes = qe.nbytes // e

    def loop(j: int) -> torch.Tensor:
        out = torch.zeros(1, d)
        for slot, ex in enumerate(routes[j].flatten().tolist()):
            h = ops.linear(ops.PackedWeight("q4_0", 2 * i, d, qe.w13[ex]), x)
            a = torch.nn.functional.silu(h[:, :i]) * h[:, i:]
            out += wts[0, slot] * ops.linear(ops.PackedWeight("q4_0", d, i, qe.w2[ex]), a)
        return out

    return [
        Path("freetoken-moe-fused", "q4", expert_bytes * k, 64, lambda j: qe.forward(x, routes[j], wts)),
        Path("freetoken-moe-pyloop", "q4", expert_bytes * k, 64, loop),
    ]


def run(
    shapes: tuple[tuple[int, int], ...] = SHAPES,
    m_values: tuple[int, ...] = M_VALUES,
    thread_counts: tuple[int, ...] | None = None,
    with_ggml: bool = True,
    reps: int = 60,
    budget_s: float = 3.0,
    progress: Callable[[str], None] | None = None,
    working_set: int = WORKING_SET,
    moe_layer: bool = True,
    huge_pages: bool = True,
    formats: tuple[str, ...] = FORMATS,
) -> Report:
    """Run the benchmark; ``thread_counts`` defaults to (1, all usable CPUs).

    ``working_set``: bytes of weight copies each path cycles through (default 256 MiB, beyond any L3); ``formats``:
    the block formats our kernels run in (``FORMATS``).
    """
    from freetoken_agent.runtime.kernels import build, ops
    from freetoken_agent.runtime.kernels.threads import usable_cpus

    from . import ggml_peer

    if build.load() is None:
        raise RuntimeError(f"the C kernels are unavailable: {build.status().reason}")
    _working_set[0] = working_set
    _huge[0] = huge_pages
    cpus = usable_cpus()
    threads = thread_counts or tuple(sorted({1, cpus}))
    peer = ggml_peer.load() if with_ggml else None
    notes = [f"isa={build.status().isa}", f"cpus={cpus}", f"loadavg={_loadavg()}",
             f"weights in {'2 MiB' if huge_pages else '4 KiB'} pages (every path)"]
    notes.append(f"ggml={peer.version}" if peer else f"ggml: {ggml_peer.unavailable_reason() if with_ggml else 'off'}")
    torch_threads = torch.get_num_threads()
    bw: dict[str, float] = {}
    results: list[Result] = []
    read_buf = _alloc(max(working_set, 64 << 20)).fill_(1)
    try:
        for th in threads:
            ops.set_threads(th)
            torch.set_num_threads(th)
            reads: list[float] = []
            stream = ops.read_bandwidth_gbps(min(256 << 20, read_buf.numel()), reps=5)
            warm = True  # the first row timed after a thread-count switch ran up to 20% slow: time it twice
            for n, k in shapes:
                for m in m_values:
                    x = torch.randn(m, k)
                    paths = our_paths(n, k, m, x, formats)
                    if peer is not None:
                        paths += peer.paths(n, k, m, x, th, _copies, alloc=_alloc)
                    paths.append(read_path(paths[0].nbytes, read_buf))
                    if warm:
                        time_paths(paths, reps, budget_s)
                        warm = False
                    secs = time_paths(paths, reps, budget_s)
                    # a one-weight read is slowed by whatever ran before it in the round-robin (another pool's
                    # spinning threads hold the second core): never rate against less than a long streaming read
                    read_gbps = max(paths[-1].nbytes / secs[-1] / 1e9, stream)
                    reads.append(read_gbps)
                    for p, sec in zip(paths[:-1], secs[:-1]):
                        gbps = p.nbytes / sec / 1e9
                        results.append(Result(p.kernel, p.fmt, f"{n}x{k}", m, th, gbps, sec, gbps / read_gbps))
                    if progress:
                        progress(f"threads={th} {n}x{k} M={m} done")
                    del paths
                    if peer is not None:
                        peer.release()
            bw[str(th)] = sorted(reads)[len(reads) // 2]
            layer = moe_layer_paths(th) if moe_layer else []
            for p, sec in zip(layer, time_paths(layer, reps, budget_s)):
                gbps = p.nbytes / sec / 1e9
                results.append(Result(p.kernel, p.fmt, "E64xK8 D2048 I768", 1, th, gbps, sec, gbps / bw[str(th)]))
    finally:
        torch.set_num_threads(torch_threads)
        from freetoken_agent.runtime.kernels.threads import default_threads

        ops.set_threads(default_threads())
    notes.append(f"loadavg_after={_loadavg()}")
    return Report(max(bw.values()), bw, results, notes)


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def format_table(report: Report) -> str:
    """A plain-text table, one line per row, grouped as measured."""
    bw = ", ".join(f"{v:.1f} GB/s ({t} thr)" for t, v in report.memory_read_gbps_by_threads.items())
    lines = [f"memory read bandwidth: {bw}", "; ".join(report.notes), ""]
    lines.append(f"{'kernel':<22} {'format':<6} {'shape':<18} {'M':>4} {'thr':>3} {'GB/s':>7} {'time':>10} {'%bw':>5}")
    for r in report.results:
        lines.append(
            f"{r.kernel:<22} {r.format:<6} {r.shape:<18} {r.M:>4} {r.threads:>3} {r.gbps:>7.2f} "
            f"{r.seconds * 1e6:>8.0f}us {100 * r.fraction_of_read_bw:>4.0f}%"
        )
    return "\n".join(lines)


def format_markdown(report: Report) -> str:
    """Markdown tables for RESULTS.md: per thread count, one row per (shape, M), one column per kernel path."""
    out = []
    cols = ["freetoken-c/q4", "ggml-q4_0/q4_0", "freetoken-c/q4_k", "ggml-q4_k/q4_k", "freetoken-c/q5_k",
            "freetoken-c/q6_k", "freetoken-c/mxfp4", "freetoken-c/q8", "ggml-q8_0/q8_0", "freetoken-dequant-mm/q4",
            "torch-linear/fp32"]  # fmt: skip
    threads = sorted({r.threads for r in report.results})
    for th in threads:
        rows = [r for r in report.results if r.threads == th]
        bw = report.memory_read_gbps_by_threads.get(str(th), 0.0)
        out.append(f"**{th} thread(s)** — µs per call (GB/s, % of read bandwidth measured in the same row); "
                   f"median read bandwidth {bw:.1f} GB/s\n")  # fmt: skip
        present = [c for c in cols if any(f"{r.kernel}/{r.format}" == c for r in rows)]
        out.append("| shape N×K | M | " + " | ".join(present) + " | q4 ours / best ggml 4-bit | q8 ours / ggml |")
        out.append("|---" * (len(present) + 4) + "|")
        keys = sorted({(r.shape, r.M) for r in rows if "x" in r.shape and " " not in r.shape},
                      key=lambda k: (SHAPE_ORDER.get(k[0], 9), k[1]))  # fmt: skip
        for shape, m in keys:
            cell = {f"{r.kernel}/{r.format}": r for r in rows if r.shape == shape and r.M == m}
            vals = []
            for c in present:
                r = cell.get(c)
                vals.append(f"{r.seconds * 1e6:.0f} ({r.gbps:.1f}, {100 * r.fraction_of_read_bw:.0f}%)" if r else "—")
            best4 = min((cell[c].seconds for c in ("ggml-q4_0/q4_0", "ggml-q4_k/q4_k") if c in cell), default=None)
            q4 = cell.get("freetoken-c/q4")
            q8, g8 = cell.get("freetoken-c/q8"), cell.get("ggml-q8_0/q8_0")
            r4 = f"{best4 / q4.seconds:.2f}×" if best4 and q4 else "—"
            r8 = f"{g8.seconds / q8.seconds:.2f}×" if q8 and g8 else "—"
            out.append(f"| {shape} | {m} | " + " | ".join(vals) + f" | {r4} | {r8} |")
        formats = format_comparison(rows)
        if formats:
            out.append("\n" + formats)
        layer = [r for r in rows if r.shape.startswith("E64")]
        if layer:
            out.append("\nWhole MoE layer, one token (E=64, top-8, D=2048, I=768, q4): " + ", ".join(
                f"{r.kernel} {r.seconds * 1e6:.0f} µs" for r in layer))  # fmt: skip
        out.append("")
    return "\n".join(out)


SHAPE_ORDER = {f"{n}x{k}": i for i, (n, k) in enumerate(SHAPES)}


def format_comparison(rows: list[Result]) -> str:
    """Our GEMV at M=1 per block format, one line per shape: µs per call, and weight bytes per µs relative to q4."""
    ours = [r for r in rows if r.kernel == "freetoken-c" and r.M == 1]
    shapes = sorted({r.shape for r in ours}, key=lambda s: SHAPE_ORDER.get(s, 9))
    present = [f for f in FORMATS if any(r.format == f for r in ours)]
    if len(present) < 2:
        return ""
    lines = ["Our GEMV by block format, M=1 — µs per call (GB/s of the weight as stored)",
             "| shape N×K | " + " | ".join(present) + " |", "|---" * (len(present) + 1) + "|"]
    for shape in shapes:
        cell = {r.format: r for r in ours if r.shape == shape}
        vals = [f"{cell[f].seconds * 1e6:.0f} ({cell[f].gbps:.1f})" if f in cell else "—" for f in present]
        lines.append(f"| {shape} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--markdown", action="store_true", help="print markdown tables (for evals/perf/RESULTS.md)")
    p.add_argument("--quick", action="store_true", help="one shape (768x2048), M=1 and 16, short timing")
    p.add_argument("--threads", default=None, help="comma-separated thread counts (default: 1 and all CPUs)")
    p.add_argument("--no-ggml", action="store_true", help="skip the ggml peer rows even if llama-cpp-python is here")
    p.add_argument("--shapes", default=None,
                   help="comma-separated NxK weight shapes (default: 768x2048,2048x768,1536x4096)")
    p.add_argument("--m", default=None, help="comma-separated token counts M (default: 1,4,16,64,256)")
    p.add_argument("--working-set-mb", type=int, default=256, help="MiB of weight copies cycled per path (default 256)")
    p.add_argument("--no-moe-layer", action="store_true", help="skip the whole-MoE-layer rows")
    p.add_argument("--formats", default=None,
                   help=f"comma-separated block formats of our kernels (default: {','.join(FORMATS)}; the K-quants "
                        "only on shapes whose K is a multiple of 256)")
    p.add_argument("--pages", choices=("2m", "4k"), default="2m",
                   help="page size of every path's weight copies, ours and ggml's alike (default 2m: the engine "
                        "keeps its weights in 2 MiB pages; 4k: ordinary allocations)")


def parse_ints(text: str | None, what: str) -> tuple[int, ...] | None:
    """Comma-separated positive integers of flag ``--what`` (None stays None)."""
    if text is None:
        return None
    try:
        vals = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise BenchError(f"--{what} must be comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise BenchError(f"--{what} needs positive integers, got {text!r}")
    return vals


def parse_formats(text: str) -> tuple[str, ...]:
    """Comma-separated names of ``--formats`` (each one of ``FORMATS``; ``q4_0`` / ``q8_0`` name ``q4`` / ``q8``)."""
    vals = tuple(FORMAT_ALIASES.get(v, v) for v in (v.strip().lower() for v in text.split(",")) if v)
    bad = [v for v in vals if v not in FORMATS]
    if not vals or bad:
        raise BenchError(f"--formats wants some of {', '.join(FORMATS)}, got {text!r}")
    return vals


def parse_shapes(text: str) -> tuple[tuple[int, int], ...]:
    shapes = []
    for item in text.split(","):
        parts = item.lower().strip().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise BenchError(f"--shapes wants NxK pairs like 768x2048, got {item!r}")
        shapes.append((int(parts[0]), int(parts[1])))
    return tuple(shapes)


def _format(report: dict[str, Any], args: argparse.Namespace) -> str:
    r = Report.from_json(report)
    return format_markdown(r) if args.markdown else format_table(r)


def _headline(report: dict[str, Any]) -> dict[str, Any]:
    one = [r for r in report["results"] if r["M"] == 1 and r["kernel"] == "freetoken-c" and r["format"] == "q4"]
    best = max(one, key=lambda r: r["fraction_of_read_bw"], default=None)
    out: dict[str, Any] = {"read_gbps": round(report["memory_read_gbps"], 2)}
    if best:
        out.update(q4_m1_gbps=round(best["gbps"], 2), q4_m1_of_read_bw=round(best["fraction_of_read_bw"], 3),
                   shape=best["shape"], threads=best["threads"])
    return out


@row("kernels", "CPU expert kernels (ours, torch, ggml) on real expert shapes: GB/s and share of read bandwidth",
     options, format=_format, headline=_headline)
def kernels_row(args: argparse.Namespace) -> dict[str, Any]:
    import sys

    kwargs: dict[str, Any] = {"thread_counts": parse_ints(args.threads, "threads"), "with_ggml": not args.no_ggml}
    if args.quick:
        kwargs.update(shapes=((768, 2048),), m_values=(1, 16), reps=20, budget_s=1.0)
    if args.shapes:
        kwargs["shapes"] = parse_shapes(args.shapes)
    if args.m:
        kwargs["m_values"] = parse_ints(args.m, "m")
    if args.formats:
        kwargs["formats"] = parse_formats(args.formats)
    if args.working_set_mb < 1:
        raise BenchError(f"--working-set-mb must be at least 1, got {args.working_set_mb}")
    try:
        report = run(progress=None if args.json else lambda s: print(s, file=sys.stderr), working_set=args.working_set_mb << 20,
                     moe_layer=not args.no_moe_layer, huge_pages=args.pages == "2m", **kwargs)
    except RuntimeError as exc:
        raise BenchError(str(exc)) from None
    return report.to_json()


if __name__ == "__main__":
    from freetoken_agent.evals.perf.harness import module_main

    raise SystemExit(module_main("kernels"))
