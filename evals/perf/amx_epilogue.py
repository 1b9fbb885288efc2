"""The floor of the exact AMX mode: what a 32-value block's tile product and its bit-exact fp32 epilogue cost.

Issue 22 asks the AMX prefill path to match kt-kernel's at M = 512. Our default (exact) mode keeps every output
bit-identical to the one-token VNNI kernels, so each Q4_0/Q8_0 block's int32 tile is stored and scaled by its own two
fp32 scales (16 loads, conversions, multiplies and FMAs per 16 x 16 block); kt-kernel's AMXInt4/Int8 scale each row
once and accumulate all of K in the tile. ``amx_epilogue.c`` times the exact mode's inner loop and the same loop with
parts left out (see its header), on one core, in ns and core cycles per block:

    python -m freetoken_agent.evals.perf.amx_epilogue [--iters 20000] [--json]
    freetoken bench amx-epilogue -- [--iters 20000]

On a machine without AMX it says so and exits 0 (nothing to measure).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from freetoken_agent.evals.perf.harness import row, run_json_main

SOURCE = Path(__file__).with_name("amx_epilogue.c")
FLAGS = ["-O2", "-mamx-tile", "-mamx-int8", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma"]


def measure(iters: int = 20000) -> dict[str, Any]:
    """{"modes": {mode: {"ns": ..., "cycles": ...}}, "clock_ghz": ...}, or {"skipped": reason}."""
    from freetoken_agent.runtime.kernels import build, ops

    if "amx" not in ops.available_isas():
        return {"skipped": "this CPU (or its kernel) offers no AMX tiles"}
    cc = build.find_compiler()
    if cc is None:
        return {"skipped": "no C compiler ($CC, cc, gcc, clang)"}
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "amx_epilogue"
        done = subprocess.run([cc, *FLAGS, "-o", str(exe), str(SOURCE)], capture_output=True, text=True)
        if done.returncode != 0:
            return {"skipped": f"{Path(cc).name} could not build the AMX microbenchmark: "
                               f"{(done.stderr.strip().splitlines() or ['?'])[-1]}"}
        out = subprocess.run([str(exe), str(iters)], capture_output=True, text=True, timeout=600)
    if out.returncode == 2:
        return {"skipped": out.stdout.strip()}
    if out.returncode != 0:
        raise RuntimeError(f"amx_epilogue failed: {out.stderr.strip() or out.stdout.strip()}")
    modes: dict[str, dict[str, float]] = {}
    clock = 0.0
    for line in out.stdout.splitlines():
        parts = line.split()
        if parts[0] == "clock":
            clock = float(parts[1])
        else:
            modes[parts[0]] = {"ns": float(parts[1]), "cycles": float(parts[2])}
    return {"modes": modes, "clock_ghz": clock, "iters": iters}


def format_table(r: dict[str, Any]) -> str:
    if "skipped" in r:
        return f"amx_epilogue: skipped: {r['skipped']}"
    lines = [f"AMX exact-mode inner loop, one core, 16 tokens x 16 rows x 32 per block (clock {r['clock_ghz']:.2f} GHz "
             "by a chain of dependent multiplies)", "", "| loop | ns / block | cycles / block |", "|---|---:|---:|"]
    lines += [f"| {mode} | {v['ns']:.2f} | {v['cycles']:.1f} |" for mode, v in r["modes"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=20000, help="passes over 64 blocks per timing (best of 3)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.iters < 1:
        ap.error("--iters must be at least 1")
    r = measure(args.iters)
    print(json.dumps(r) if args.json else format_table(r))
    return 0


@row("amx-epilogue", "the exact AMX mode's inner loop per 16x16x32 block, whole and in parts (tile product, store, "
     "read-back, fp32 epilogue), ns and cycles; flags are amx_epilogue's", passthrough=True)
def amx_epilogue_row(args: argparse.Namespace) -> dict[str, Any]:
    return run_json_main(main, args.passthrough)


if __name__ == "__main__":
    sys.exit(main())
