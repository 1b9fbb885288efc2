"""kt-kernel (KTransformers' CPU MoE kernels) as the peer of the ``moe-layer`` row: one MoE layer step, timed.

kt-kernel pins its own torch, so this file runs under kt-kernel's interpreter, as a script:

    /tmp/ktvenv/bin/python evals/perf/kt_peer.py FOLDER --method AMXInt4 --tokens 1,32,512 --threads 2 --repeats 5

It imports only the standard library, torch and kt_kernel (never ``freetoken_agent``); the row imports it for
``reference`` and ``relative_error``, so both sides are checked by the same plain-torch code. ``FOLDER`` holds
``weights.pt`` (bf16 ``gate [E, I, D]``, ``up [E, I, D]``, ``down [E, D, I]``) and, per token count M,
``tokens-M.pt`` (``x [M, D]`` bf16, ``ids [M, K]`` int64, ``weights [M, K]`` fp32) and optionally
``reference-M.pt`` (the fp32 output; computed here when absent). Prints one line ``RESULT {json}``: per M the
seconds per step (median, low, high: ``timing.py`` beside this file, loaded by path), CPU seconds per step, and the
max abs error against the reference relative to the reference's max abs. kt-kernel prints to stdout itself, hence
the prefix.

Methods (``METHODS``): ``AMXInt4`` and ``AMXInt8`` quantize the bf16 weights themselves when they load
(``load_weights_task`` with bf16 pointers: per-row int4 / int8); ``AMXInt4_KGroup`` takes weights already in
group-quantized int4 (its ``RAWINT4`` checkpoint format: symmetric, one bf16 scale per 32 values, nibbles offset by
8, low nibble first), which ``kgroup_quantize`` writes: the format closest to our Q4_0 (one scale per 32 values).

kt-kernel's shape rules (its AMX buffers): ``max_len`` (the most tokens one step holds) a multiple of 32 (``M_STEP``),
D and I multiples of 64 for ``AMXInt8`` and of 128 for the int4 methods; anything else fails at construction
("max_m and k must be multiple of M_STEP and K_STEP", "n or k is not aligned to N_STEP or B_K_STEP").

Legend: ``T``/``M`` tokens, ``E`` experts, ``K`` experts per token, ``D`` hidden, ``I`` expert intermediate.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import resource
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

METHODS = {"AMXInt4": "AMXInt4_MOE", "AMXInt8": "AMXInt8_MOE", "AMXInt4_KGroup": "AMXInt4_KGroup_MOE"}
"""Our name of each kt-kernel method → its class in ``kt_kernel_ext.moe``."""
GROUP = 32  # values per scale of AMXInt4_KGroup, as our Q4_0
M_STEP = 32  # kt-kernel's max_len must be a multiple of this
WARMUP = 2  # the first forward after loading ran 3x slower than the next ones


class PeerError(Exception):
    """kt-kernel cannot run a method here: one line for the report."""


def reference(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
              down: torch.Tensor) -> torch.Tensor:
    """The MoE layer step in plain fp32 torch: ``sum_k weights[t, k] * down_e(silu(gate_e x_t) * up_e x_t)`` with
    ``e = ids[t, k]``. ``x [T, D]``, ``ids``/``weights [T, K]``, ``gate``/``up [E, I, D]``, ``down [E, D, I]``
    (any float dtype; computed in fp32) → ``[T, D]`` fp32."""
    x = x.float()
    out = torch.zeros(x.shape[0], x.shape[1])
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)  # [n] each: the tokens routed to e and at which slot
        xe = x[tok]  # [n, D]
        h = torch.nn.functional.silu(xe @ gate[e].float().t()) * (xe @ up[e].float().t())  # [n, I]
        out.index_add_(0, tok, (h @ down[e].float().t()) * weights[tok, slot, None].float())  # [n, D]
    return out


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Max abs error of ``out`` against ``ref``, relative to ``ref``'s max abs."""
    scale = float(ref.abs().max())
    return float((out.float() - ref).abs().max()) / scale if scale else float((out.float() - ref).abs().max())


def kgroup_quantize(w: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` → kt-kernel's RAWINT4 bytes ``[N, K/2]`` uint8 and scales ``[N, K/group]`` bf16: per group of
    ``group`` values, scale = max abs / 7, q = round(w / scale) in [-8, 7] stored as q + 8, low nibble first."""
    n, k = w.shape
    if k % group or k % 2:
        raise PeerError(f"AMXInt4_KGroup needs rows of a multiple of {group} values, got {k}")
    g = w.float().reshape(n, k // group, group)
    scale = (g.abs().amax(dim=-1, keepdim=True) / 7).to(torch.bfloat16).float()  # the scale the kernel will read
    q = torch.where(scale > 0, torch.round(g / scale.clamp_min(1e-30)), 0.0).clamp(-8, 7)
    nib = (q.to(torch.int16) + 8).to(torch.uint8).reshape(n, k)
    return (nib[:, 0::2] | (nib[:, 1::2] << 4)).contiguous(), scale.squeeze(-1).to(torch.bfloat16).contiguous()


def kgroup_dequantize(packed: torch.Tensor, scales: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """The fp32 ``[N, K]`` values ``kgroup_quantize``'s bytes stand for."""
    n = packed.shape[0]
    q = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(n, -1).float() - 8  # [N, K]
    return (q.reshape(n, -1, group) * scales.float().unsqueeze(-1)).reshape(n, -1)


def _timing() -> ModuleType:
    """``timing.py`` beside this file (the benchmarks' one timing helper; standard library only), by path: this
    interpreter has no ``freetoken_agent``."""
    name = "_ft_timing"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("timing.py"))
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the file runs
        spec.loader.exec_module(module)
    return sys.modules[name]


def _build(kt: ModuleType, method: str, w: dict[str, torch.Tensor], top_k: int, max_len: int,
           cpu: Any) -> tuple[Any, list[Any]]:
    """kt-kernel's MoE module for ``method`` over the bf16 weights ``w``, loaded (quantized) on ``cpu``'s pool;
    returns it and the tensors it reads from, which must outlive it."""
    cls = getattr(kt.moe, METHODS[method], None)
    if cls is None:
        raise PeerError(f"{METHODS[method]} is not compiled into this kt-kernel build ({_variant()})")
    experts, inter, hidden = w["gate"].shape
    cfg = kt.moe.MOEConfig(experts, top_k, hidden, inter, 0)  # 0: no GPU-experts mask
    cfg.max_len = max_len
    cfg.pool = cpu.backend_
    keep: list[Any] = []
    if method == "AMXInt4_KGroup":
        for proj in ("gate", "up", "down"):
            q = [kgroup_quantize(w[proj][e]) for e in range(experts)]
            keep.append(q)
            setattr(cfg, f"{proj}_projs", [[b.data_ptr() for b, _ in q]])  # [numa][expert]
            setattr(cfg, f"{proj}_scales", [[s.data_ptr() for _, s in q]])
        cfg.quant_config.bits = 4
        cfg.quant_config.group_size = GROUP
        cfg.quant_config.zero_point = False
    else:
        cfg.gate_proj, cfg.up_proj, cfg.down_proj = (w[p].data_ptr() for p in ("gate", "up", "down"))
    try:
        moe = cls(cfg)
    except RuntimeError as exc:
        raise PeerError(f"{METHODS[method]}: {exc}") from None
    logical = torch.arange(experts, dtype=torch.int64)  # physical → logical expert ids: identity
    keep.append(logical)
    cpu.submit(moe.load_weights_task(logical.data_ptr()))
    cpu.sync()
    return moe, keep


def _variant() -> str:
    import kt_kernel

    return str(getattr(kt_kernel, "__cpu_variant__", "?"))


def measure(folder: Path, method: str, tokens: list[int], threads: int, repeats: int) -> dict[str, Any]:
    """Build ``method`` over ``folder``'s weights and time one step per token count; the ``RESULT`` object."""
    try:
        import kt_kernel
        from kt_kernel import kt_kernel_ext as kt
    except Exception as exc:  # an import error of a compiled extension can be any exception; it becomes the reason
        return {"available": False, "reason": f"cannot import kt_kernel: {type(exc).__name__}: {exc}"}
    timing = _timing()
    torch.set_num_threads(threads)
    head = {"available": True, "kt_kernel": getattr(kt_kernel, "__version__", "?"), "variant": _variant(),
            "torch": torch.__version__, "method": method, "class": METHODS[method], "threads": threads}
    w = torch.load(folder / "weights.pt", mmap=True, weights_only=True)
    top_k = torch.load(folder / f"tokens-{tokens[0]}.pt", weights_only=True)["ids"].shape[1]
    max_len = -(-max(tokens) // M_STEP) * M_STEP
    cpu = kt.CPUInfer(threads)
    t0 = time.perf_counter()
    try:
        moe, keep = _build(kt, method, w, top_k, max_len, cpu)
    except PeerError as exc:
        return {**head, "failed": str(exc)}
    head["load_s"] = round(time.perf_counter() - t0, 3)
    results = []
    for m in tokens:
        t = torch.load(folder / f"tokens-{m}.pt", weights_only=True)
        x = t["x"].to(torch.bfloat16).contiguous()  # [M, D]
        ids, wts = t["ids"].long().contiguous(), t["weights"].float().contiguous()  # [M, K] each
        out = torch.zeros(m, x.shape[1], dtype=torch.bfloat16)
        bsz = torch.tensor([m], dtype=torch.int32)

        def step() -> None:
            cpu.submit(moe.forward_task(bsz.data_ptr(), ids.shape[1], ids.data_ptr(), wts.data_ptr(), x.data_ptr(),
                                        out.data_ptr(), False))
            cpu.sync()

        for _ in range(WARMUP):
            step()
        c0 = resource.getrusage(resource.RUSAGE_SELF)
        spread = timing.repeat(step, repeats, warmup=0)
        c1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu_s = (c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime) / repeats
        ref_file = folder / f"reference-{m}.pt"
        ref = (torch.load(ref_file, weights_only=True) if ref_file.is_file()
               else reference(x, ids, wts, w["gate"], w["up"], w["down"]))
        results.append({"M": m, "seconds": spread.to_json(), "cpu_s": round(cpu_s, 6),
                        "error": relative_error(out, ref)})
    del keep
    return {**head, "results": results}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--method", choices=sorted(METHODS), required=True)
    p.add_argument("--tokens", required=True, help="comma-separated token counts M (a tokens-M.pt each)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    tokens = [int(v) for v in args.tokens.split(",") if v.strip()]
    result = measure(args.folder, args.method, tokens, args.threads, args.repeats)
    sys.stdout.flush()  # kt-kernel's own prints (C++ stdout) come first; the result is one line after them
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
