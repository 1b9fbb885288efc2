"""Two builds of the C library's decode weight kernels side by side in one process: old vs new ``.so``.

A decode step's weight traffic for one token, layer after layer as the model makes it: per layer the q|k|v and o
projections (``ft_linear``, Q8_0 by default) and a routed MoE step (``ft_moe``, top-k of E Q4_0 experts, the
experts changing from layer to layer and step to step), every layer's weights its own bytes, so each step streams
``layers`` x (dense + k experts) from memory. Defaults: the 7.5B benchmark model's shapes (24 layers, hidden 2048,
16/4 heads x 128, 64 experts of 768, top-8). Each build is loaded with ctypes (its own pool of ``--threads``); the
two alternate in blocks, the other's workers asleep first (its pool spins for up to 5 ms after its last job, and two
spinning pools would steal each other's cores). Prints GB/s of the bytes read for the whole step, the MoE alone and
the dense products alone, and the new/old speed-up (medians). The builds are ``.so`` files from
``~/.cache/freetoken/kernels`` (``ops.build`` names them by a hash of the sources: build the old sources, copy the
file, build the new ones).

    python -m freetoken_agent.evals.perf.weight_builds OLD.so NEW.so [--threads 2] [--rounds 8] [--dense q8_0]
    freetoken bench weight-builds -- OLD.so NEW.so
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time
from typing import Any

import torch

from freetoken_agent.evals.perf.harness import row, run_json_main

LAYERS, EXPERTS, HIDDEN, INTER, TOP_K, Q_ROWS, KV_ROWS = 24, 64, 2048, 768, 8, 2048, 512


def load(path: str, threads: int) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.ft_set_threads.argtypes = lib.ft_set_spin_us.argtypes = [i32]
    lib.ft_moe.argtypes = [i32, i32, p, i64, p, i64, i64, i64, i64, p, i64, p, p, i64, p]
    lib.ft_linear.argtypes = [i32, p, i64, i64, p, i64, p]
    lib.ft_set_threads(threads)
    return lib


class Step:
    """The weights of ``layers`` layers and the calls of one decode step over them."""

    def __init__(self, layers: int, dense: str, seed: int = 0) -> None:
        from freetoken_agent.runtime.kernels import ops
        from freetoken_agent.runtime.kernels.experts import QuantizedExperts

        gen = torch.Generator().manual_seed(seed)
        one = QuantizedExperts.from_float(torch.randn(1, 2 * INTER, HIDDEN, generator=gen) / 45,
                                          torch.randn(1, HIDDEN, INTER, generator=gen) / 28, "q4")
        self.w13 = [one.w13.expand(EXPERTS, -1).contiguous() for _ in range(layers)]
        self.w2 = [one.w2.expand(EXPERTS, -1).contiguous() for _ in range(layers)]
        qkv_rows = Q_ROWS + 2 * KV_ROWS
        qkv = ops.PackedWeight.from_blocks(ops.quantize(torch.randn(qkv_rows, HIDDEN, generator=gen), dense))
        o = ops.PackedWeight.from_blocks(ops.quantize(torch.randn(HIDDEN, Q_ROWS, generator=gen), dense))
        self.code, self.qkv_rows = qkv.code, qkv_rows
        self.qkv = [qkv.data.clone() for _ in range(layers)]
        self.o = [o.data.clone() for _ in range(layers)]
        self.x, self.out, self.y = torch.randn(1, HIDDEN, generator=gen), torch.empty(1, HIDDEN), torch.empty(1, qkv_rows)
        self.att = torch.randn(1, Q_ROWS, generator=gen)
        self.wts = torch.full((1, TOP_K), 1.0 / TOP_K)
        self.routes = [torch.randperm(EXPERTS, generator=gen)[:TOP_K].reshape(1, TOP_K).contiguous()
                       for _ in range(997)]  # a prime count: a layer meets a different route each step
        self.turn = 0
        self.moe_bytes = layers * TOP_K * (self.w13[0].stride(0) + self.w2[0].stride(0))
        self.dense_bytes = layers * (self.qkv[0].numel() + self.o[0].numel())

    def run(self, lib: ctypes.CDLL, what: str) -> None:
        self.turn += 1
        for layer in range(len(self.w13)):
            if what != "moe":
                lib.ft_linear(self.code, self.qkv[layer].data_ptr(), self.qkv_rows, HIDDEN, self.x.data_ptr(), 1,
                              self.y.data_ptr())
                lib.ft_linear(self.code, self.o[layer].data_ptr(), HIDDEN, Q_ROWS, self.att.data_ptr(), 1,
                              self.out.data_ptr())
            if what != "dense":
                ids = self.routes[(layer * 31 + self.turn) % len(self.routes)]
                w13, w2 = self.w13[layer], self.w2[layer]
                rc = lib.ft_moe(1, 1, w13.data_ptr(), w13.stride(0), w2.data_ptr(), w2.stride(0), EXPERTS, HIDDEN,
                                INTER, self.x.data_ptr(), 1, ids.data_ptr(), self.wts.data_ptr(), TOP_K,
                                self.out.data_ptr())
                if rc:
                    raise SystemExit(f"ft_moe returned {rc}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=8, help="blocks per build (3 timed steps each)")
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--dense", default="q8_0", choices=("q8_0", "q4_0"), help="the projections' format")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.threads < 1 or args.rounds < 2 or args.layers < 1:
        ap.error("--threads and --layers must be at least 1, --rounds at least 2")
    try:
        libs = {"old": load(args.old, args.threads), "new": load(args.new, args.threads)}
    except (OSError, AttributeError) as exc:
        ap.error(f"not a build of the kernels library: {exc}")
    step = Step(args.layers, args.dense)
    rows: list[dict[str, Any]] = []
    if not args.json:
        print("| part | GB per step | old GB/s | new GB/s | speed-up |")
        print("|---|---|---|---|---|")
    for what, nbytes in (("all", step.moe_bytes + step.dense_bytes), ("moe", step.moe_bytes),
                         ("dense", step.dense_bytes)):
        times: dict[str, list[float]] = {"old": [], "new": []}
        for r in range(args.rounds):
            for name in ("old", "new") if r % 2 else ("new", "old"):
                time.sleep(0.02)  # the other build's workers stop spinning
                step.run(libs[name], what)  # this build's workers wake
                for _ in range(3):
                    t0 = time.perf_counter()
                    step.run(libs[name], what)
                    times[name].append(time.perf_counter() - t0)
        old, new = (statistics.median(times[n]) for n in ("old", "new"))
        rows.append({"part": what, "gb": round(nbytes / 1e9, 3), "old_gbps": round(nbytes / old / 1e9, 2),
                     "new_gbps": round(nbytes / new / 1e9, 2), "speedup": round(old / new, 3)})
        if not args.json:
            print(f"| {what} | {nbytes / 1e9:.3f} | {nbytes / old / 1e9:.2f} | {nbytes / new / 1e9:.2f} | "
                  f"{old / new:.3f}x |")
    if args.json:
        print(json.dumps({"threads": args.threads, "rounds": args.rounds, "dense": args.dense, "rows": rows}))
    return 0


@row("weight-builds", "two builds of the C decode weight kernels side by side (old vs new .so): a decode step's "
     "Q8_0 projections and Q4_0 MoE over 24 layers, GB/s and speed-up; flags are weight_builds'", passthrough=True)
def weight_builds_row(args: argparse.Namespace) -> dict[str, Any]:
    return run_json_main(main, args.passthrough)


if __name__ == "__main__":
    raise SystemExit(main())
