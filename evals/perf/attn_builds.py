"""Two builds of the C library's attention kernel side by side in one process: old vs new ``ft_attn_queries_kv``.

Each build is loaded with ctypes (its own pool of ``--threads``, idle spinning off so the two pools do not steal
from each other) and called alternately on the same random cache, for decode steps (1 query) and short rows (a
verify row of speculative decoding); prints a markdown table of median milliseconds and the speed-up. The builds
are ``.so`` files from ``~/.cache/freetoken/kernels`` (``ops.build`` names them by a hash of the sources: build the
old sources, note the file, build the new ones). Two paths are two libraries with their own pools; a path the
process has loaded already (the engine's own build) would share that library's settings, so copy it first.

``--cold`` reads a buffer of twice the last-level cache between calls (untimed), so every call streams its cache
from memory as in a model's decode step, where the layers' weights pass through the cache between two attention
calls of a layer; without it an 8k-key cache (17 MB) sits in a large L3 and the row measures L3 bandwidth.

    python -m freetoken_agent.evals.perf.attn_builds OLD.so NEW.so [--threads 2] [--repeats 40] [--cold] [--json]
        [--isa avx2]  # both builds on one ISA path (default: cpuid's best)
        [--caches fp32,fp16,bf16]  # the cache element types timed (default fp32,fp16)
    freetoken bench attn-builds -- OLD.so NEW.so
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from freetoken_agent.evals.perf.harness import row, run_json_main

SHAPES = [(16, 4, 128, 4096, 1), (32, 4, 128, 4096, 1), (16, 4, 128, 8192, 1), (16, 16, 128, 4096, 1),
          (16, 4, 128, 32, 1), (16, 4, 128, 4096, 8), (4, 2, 64, 1024, 8)]
"""(query heads, kv heads, head dim, keys, queries)."""


CACHES = {"fp32": (torch.float32, 0), "fp16": (torch.float16, 1), "bf16": (torch.bfloat16, 2),
          "fp8": (torch.float8_e4m3fn, 3)}
"""``--caches``: the cache's torch dtype and the library's kv_type code."""


ISAS = {"best": None, "portable": 0, "avx2": 1, "avx512": 2}
"""``--isa``: the library's ISA path (``ft_set_isa``); ``best`` keeps what it picks from cpuid."""


def load(path: str, threads: int, isa: str = "best") -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    if ISAS[isa] is not None:
        lib.ft_set_isa.argtypes = [ctypes.c_int]
        if lib.ft_set_isa(ISAS[isa]) != ISAS[isa]:
            raise OSError(f"{path}: this CPU has no {isa} path")
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.ft_attn_queries_kv.argtypes = [p, i64, p, p, ctypes.c_int, p, p, i64, i64, i64, i64, i64, i64,
                                       ctypes.c_float, p, p]
    lib.ft_set_threads.argtypes = lib.ft_set_spin_us.argtypes = [ctypes.c_int]
    lib.ft_set_threads(threads)
    lib.ft_set_spin_us(0)
    return lib


def last_level_cache_bytes(folder: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """The largest cache this CPU reports in sysfs (bytes); 64 MiB where it reports none."""
    best = 0
    for size in folder.glob("index*/size"):
        text = size.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            best = max(best, int(text.rstrip("KMG")) * scale)
        except ValueError:
            continue
    return best or 64 << 20


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--cold", action="store_true", help="evict the caches between calls (read 2x the LLC)")
    ap.add_argument("--isa", choices=list(ISAS), default="best",
                    help="the ISA path both builds run (default: cpuid's best)")
    ap.add_argument("--caches", default="fp32,fp16",
                    help="cache element types to time, comma-separated: " + ", ".join(CACHES))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    caches = [c.strip() for c in args.caches.split(",") if c.strip()]
    if not caches or any(c not in CACHES for c in caches):
        ap.error(f"--caches: pick from {', '.join(CACHES)}")
    if args.threads < 1 or args.repeats < 6:
        ap.error("--threads must be at least 1 and --repeats at least 6")
    try:
        libs = {"old": load(args.old, args.threads, args.isa), "new": load(args.new, args.threads, args.isa)}
    except (OSError, AttributeError) as exc:
        ap.error(f"not a build of the kernels library: {exc}")
    rows: list[dict[str, Any]] = []
    flush = torch.ones(2 * last_level_cache_bytes() // 4) if args.cold else None
    if not args.json:
        print("| cache | heads (q/kv x dim) | keys | queries | old ms | new ms | speed-up |")
        print("|---|---|---|---|---|---|---|")
    for cache in caches:
        dtype, code = CACHES[cache]
        for h, hkv, dh, s, t in SHAPES:
            k, v = torch.randn(s, hkv, dh).to(dtype), torch.randn(s, hkv, dh).to(dtype)
            q, out = torch.randn(t, h, dh), torch.empty(t, h, dh)
            hi = torch.arange(s - t, s) + 1
            lo = torch.zeros_like(hi)
            times: dict[str, list[float]] = {"old": [], "new": []}
            for r in range(args.repeats):
                for name in ("old", "new") if r % 2 else ("new", "old"):
                    if flush is not None:
                        flush.sum()
                    t0 = time.perf_counter()
                    rc = libs[name].ft_attn_queries_kv(q.data_ptr(), t, k.data_ptr(), v.data_ptr(), code,
                                                       lo.data_ptr(), hi.data_ptr(), h, hkv, dh, dh, hkv * dh,
                                                       hkv * dh, ctypes.c_float(0.1), None, out.data_ptr())
                    times[name].append(time.perf_counter() - t0)
                    if rc != 0:
                        raise SystemExit(f"{name}: ft_attn_queries_kv returned {rc}")
            old, new = (statistics.median(times[n][5:]) * 1e3 for n in ("old", "new"))
            rows.append({"cache": cache, "heads": h, "kv_heads": hkv, "head_dim": dh, "keys": s, "queries": t,
                         "old_ms": round(old, 4), "new_ms": round(new, 4), "speedup": round(old / new, 3)})
            if not args.json:
                print(f"| {cache} | {h}/{hkv} x {dh} | {s} | {t} | {old:.3f} | {new:.3f} | {old / new:.2f}x |")
    if args.json:
        print(json.dumps({"threads": args.threads, "repeats": args.repeats, "cold": args.cold, "rows": rows}))
    return 0


@row("attn-builds", "two builds of the C attention kernel side by side (old vs new .so): decode steps and short rows, "
     "ms and speed-up; flags are attn_builds'", passthrough=True)
def attn_builds_row(args: argparse.Namespace) -> dict[str, Any]:
    return run_json_main(main, args.passthrough)


if __name__ == "__main__":
    raise SystemExit(main())
