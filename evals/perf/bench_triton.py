"""GPU check for the Triton kernels: dequant-GEMM (q4/q8) vs fp16 ``torch.mm``, the grouped MoE step, the slot
kernels (experts computed from a slot pool's bytes) vs the torch path they replace, and paged decode attention.

    python -m freetoken_agent.evals.perf.bench_triton            # on a CUDA machine: correctness + timings
    python -m freetoken_agent.evals.perf.bench_triton --interpret  # CPU smoke run under TRITON_INTERPRET=1, tiny shapes

Each row first checks the kernel against its plain-torch reference (relative error printed), then times it
(``timing.repeat``, synchronized after every call, median of ``--reps``). GB/s counts quantized weight bytes (codes + scales).

Reusable parts: ``cases(device, interpret)`` builds every (kernel, format, shape, M) case with its call and its
reference; ``errors(out, ref)`` measures their agreement; ``check(interpret)`` gives the agreement rows with a
pass/fail against ``REL_TOL`` and no timings (what ``gpu_check`` reports).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from freetoken_agent.evals.perf.harness import row, run_json_main
from freetoken_agent.evals.perf.timing import repeat

REL_TOL = 5e-3
"""A case passes when ‖kernel − reference‖ / ‖reference‖ is at most this (fp32 accumulation; tl.dot may use TF32)."""


@dataclass(frozen=True)
class Case:
    """One kernel call and its plain-torch reference on the same inputs."""

    kernel: str
    fmt: str
    shape: str
    m: int
    """Rows of the activation (GEMM) or tokens (grouped MoE)."""
    call: Callable[[], torch.Tensor]
    reference: Callable[[], torch.Tensor]
    weight_bytes: int | None = None
    """Quantized weight bytes one call streams (codes + scales), for GB/s; None where not counted."""
    dense: Callable[[], torch.Tensor] | None = None
    """The same product as a dense fp16 (fp32 on the CPU) ``torch.mm``, for comparison timings."""
    baseline: Callable[[], torch.Tensor] | None = None
    """The torch path the kernel replaces (slot kernels: each slot dequantized by torch ops, then fp32 matmuls)."""


def errors(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """``max_abs_err`` (max |out − ref|), ``max_rel_err`` (max |out − ref| / max |ref|) and ``rel_err``
    (‖out − ref‖₂ / ‖ref‖₂)."""
    diff = (out.float() - ref.float()).abs()
    scale = float(ref.abs().max()) or 1.0
    return {"max_abs_err": float(diff.max()), "max_rel_err": float(diff.max()) / scale,
            "rel_err": float(diff.norm() / (ref.float().norm() or 1.0))}


def cases(device: str, interpret: bool) -> Iterator[Case]:
    """Every case, inputs built fresh (random, seeded by the caller's torch RNG) on ``device``; tiny shapes when
    ``interpret`` (the kernels run in the Triton interpreter on the CPU)."""
    from freetoken_agent.runtime.kernels.triton import (
        TritonQuantExperts,
        TritonQuantWeight,
        dequant_matmul,
        moe_forward,
        reference_matmul,
        reference_moe_forward,
    )
    from freetoken_agent.runtime.quant import quantize

    shapes = [(64, 128)] if interpret else [(1536, 2048), (2048, 768), (3072, 4096)]
    ms = [1, 16] if interpret else [1, 16, 256]
    for n, k in shapes:
        w = torch.randn(n, k)
        dense = w.to(device=device, dtype=torch.float16 if device == "cuda" else torch.float32)
        for fmt in ("q4", "q8"):
            qw = TritonQuantWeight.from_blocks(quantize(w, fmt), device)
            nbytes = qw.codes.numel() * qw.codes.element_size() + qw.scales.numel() * 2
            for m in ms:
                x = torch.randn(m, k, device=device)
                xd = x.to(dense.dtype)
                yield Case("triton-dequant-gemm", fmt, f"{n}x{k}", m,
                           lambda x=x, qw=qw: dequant_matmul(x, qw), lambda x=x, qw=qw: reference_matmul(x, qw),
                           nbytes, lambda xd=xd, dense=dense: torch.mm(xd, dense.t()))  # fmt: skip
    e, d, i, top_k = (4, 64, 32, 2) if interpret else (64, 2048, 768, 8)
    for fmt in ("q4", "q8"):
        w13 = TritonQuantExperts.from_float(torch.randn(e, 2 * i, d) / d**0.5, fmt, device)
        w2 = TritonQuantExperts.from_float(torch.randn(e, d, i) / i**0.5, fmt, device)
        for t_tokens in ([3] if interpret else [1, 64, 512]):
            x = torch.randn(t_tokens, d, device=device)
            ids = torch.stack([torch.randperm(e)[:top_k] for _ in range(t_tokens)]).to(device)
            wts = torch.softmax(torch.randn(t_tokens, top_k), -1).to(device)
            yield Case("triton-grouped-moe", fmt, f"E{e} top{top_k} D{d} I{i}", t_tokens,
                       lambda x=x, ids=ids, wts=wts, w13=w13, w2=w2: moe_forward(x, w13, w2, ids, wts),
                       lambda x=x, ids=ids, wts=wts, w13=w13, w2=w2: reference_moe_forward(x, w13, w2, ids, wts))
    yield from _slot_cases(device, interpret)
    yield from _paged_attention_cases(device, interpret)


def _slot_cases(device: str, interpret: bool) -> Iterator[Case]:
    """The slot kernels over a pool's own bytes (GGUF blocks and the C kernels' tiles): a decode step's pairs (the
    per-pair GEMV) and a prefill chunk's (grouped by slot), each against plain torch over the dequantized slots."""
    from freetoken_agent.runtime.kernels.triton import SlotWeights, slots_matmul
    from freetoken_agent.runtime.quant.formats import block_format

    s, n, k, pair_counts = (4, 64, 128, [2, 40]) if interpret else (16, 1536, 2048, [8, 4096])
    for fmt in ("q4_0", "q8_0"):
        f = block_format(fmt)
        w = torch.randn(s, n, k) / k**0.5
        blocks = torch.stack([f.quantize_rows(w[i]) for i in range(s)])
        for packed in (False, True):
            raw = f.storage(blocks, packed)
            deq = torch.stack([f.dequantize(raw[i], n, k, packed) for i in range(s)]).to(device)
            sw = SlotWeights(raw.to(device), n, k, fmt, packed)
            for p in pair_counts:
                x = torch.randn(max(1, p // 8), k, device=device)
                rows = torch.randint(0, x.shape[0], (p,), device=device)
                slots = torch.randint(0, s, (p,), device=device)
                touched = len(set(slots.tolist())) * raw.shape[1]

                def torch_path(x=x, rows=rows, slots=slots, raw=sw.data, packed=packed, f=f) -> torch.Tensor:
                    out = torch.empty(rows.numel(), n, device=x.device)
                    for i in slots.unique().tolist():
                        sel = (slots == i).nonzero().flatten()
                        out[sel] = x[rows[sel]] @ f.dequantize(raw[i], n, k, packed).t()
                    return out

                yield Case("triton-slots", f"{fmt}{'-tiles' if packed else ''}", f"S{s} {n}x{k}", p,
                           lambda x=x, sw=sw, rows=rows, slots=slots: slots_matmul(x, sw, rows, slots),
                           lambda x=x, rows=rows, slots=slots, deq=deq: torch.einsum("pk,pnk->pn", x[rows], deq[slots]),
                           touched, baseline=torch_path)


def _paged_attention_cases(device: str, interpret: bool) -> Iterator[Case]:
    """The paged decode attention kernel over scattered pages (fp32 and fp16 pools; sinks and a sliding window on
    the second case of each)."""
    from freetoken_agent.runtime.kv.triton import paged_attention_decode, reference_paged_attention

    b, h, hkv, d, page, lens = (2, 4, 2, 16, 4, [5, 11]) if interpret else (8, 32, 4, 128, 16, [4096, 1000, 1, 333] * 2)
    max_pages = max(-(-n // page) for n in lens)
    pool_pages = b * max_pages + 3
    table = torch.randperm(pool_pages)[: b * max_pages].view(b, max_pages).int().to(device)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(b, h, d, device=device)
    for kv in (torch.float32, torch.float16):
        k_pool = torch.randn(pool_pages, page, hkv, d).to(device, kv)
        v_pool = torch.randn(pool_pages, page, hkv, d).to(device, kv)
        for sinks, window in ((None, 0), (torch.randn(h, device=device), 3 if interpret else 512)):
            name = f"H{h}/{hkv} D{d} page{page}" + (f" sinks window{window}" if window else "")
            yield Case("triton-paged-attention", "fp32" if kv == torch.float32 else "fp16", name, b,
                       lambda k_pool=k_pool, v_pool=v_pool, sinks=sinks, window=window: paged_attention_decode(
                           q, k_pool, v_pool, table, lens_t, d**-0.5, sinks, window),
                       lambda k_pool=k_pool, v_pool=v_pool, sinks=sinks, window=window: reference_paged_attention(
                           q, k_pool, v_pool, table, lens_t, d**-0.5, sinks, window))


def check(interpret: bool) -> list[dict[str, Any]]:
    """Agreement of every case with its reference: kernel, format, shape, M, the ``errors`` keys and ``passed``
    (``rel_err <= REL_TOL``). On CUDA unless ``interpret`` (set ``TRITON_INTERPRET=1`` before triton is imported)."""
    out = []
    for c in cases("cpu" if interpret else "cuda", interpret):
        err = errors(c.call(), c.reference())
        out.append({"kernel": c.kernel, "format": c.fmt, "shape": c.shape, "M": c.m, **err,
                    "passed": err["rel_err"] <= REL_TOL})
    return out


def _timer(device: str) -> Callable[[Callable[[], object], int], float]:
    """Median seconds per call (one warm-up call); on CUDA every call is synchronized inside the timing."""
    sync = torch.cuda.synchronize if device == "cuda" else None
    return lambda fn, reps: repeat(fn, reps, warmup=1, sync=sync).median


def run(interpret: bool, reps: int) -> list[dict[str, Any]]:
    device = "cpu" if interpret else "cuda"
    timed = _timer(device)
    rows: list[dict[str, Any]] = []
    for c in cases(device, interpret):
        t = timed(c.call, reps)
        r: dict[str, Any] = {"kernel": c.kernel, "format": c.fmt, "shape": c.shape, "M": c.m, "seconds": t}
        if c.weight_bytes is not None:
            r["gbps"] = c.weight_bytes / t / 1e9
        r["rel_err"] = errors(c.call(), c.reference())["rel_err"]
        if c.dense is not None:
            r["dense_fp16_seconds"] = timed(c.dense, reps)
        if c.baseline is not None:
            r["torch_path_seconds"] = timed(c.baseline, reps)
        rows.append(r)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--interpret", action="store_true", help="run on the CPU under TRITON_INTERPRET=1 (tiny shapes)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        print("bench_triton: no CUDA device here; use --interpret for a CPU smoke run", file=sys.stderr)
        return 2
    rows = run(args.interpret, 2 if args.interpret else args.reps)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        for r in rows:
            extra = f" dense-fp16 {r['dense_fp16_seconds'] * 1e6:.0f} us" if "dense_fp16_seconds" in r else ""
            if "torch_path_seconds" in r:
                extra += f" torch-path {r['torch_path_seconds'] * 1e6:.0f} us"
            gb = f" {r['gbps']:.1f} GB/s" if "gbps" in r else ""
            print(f"{r['kernel']:<22} {r['format']:<10} {r['shape']:<22} M={r['M']:<4} {r['seconds'] * 1e6:9.0f} us{gb}"
                  f" rel_err={r['rel_err']:.1e}{extra}")  # fmt: skip
    return 0




@row("triton", "Triton kernels (dequant GEMM, grouped MoE) against their torch references and fp16 mm, on CUDA (--interpret: CPU smoke); flags are bench_triton's", passthrough=True)
def triton_row(args: argparse.Namespace) -> dict[str, Any]:
    return run_json_main(main, args.passthrough)

if __name__ == "__main__":
    raise SystemExit(main())
