"""Measured rates for the capacity planner, cached per machine and thread count.

Kernel rates come from microbenchmarks (dense fp32 GEMV GB/s over more weights than the caches hold, GEMM GFLOP/s,
the CPU expert kernel via ``microbench.cpu_expert_gbps``, disk GB/s from the hardware probe). Framework overheads
(Python per layer, per step, per routed expert) cannot be read off a kernel: they are fit from decode and prefill
timings of fixed calibration models (see ``_fit``), never from the models being planned; the same runs give the
in-engine dense and expert GB/s (the microbenchmark values are kept as ``kernel_*``). Cached at ``$FREETOKEN_CACHE/capacity_rates.json``.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from freetoken_agent.runtime.execution.capacity import Rates

TINY: dict[str, Any] = dict(
    model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=256, hidden_size=64,
    intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
    num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    max_position_embeddings=4096, rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
    tie_word_embeddings=False, hidden_act="silu",
)  # fmt: skip


def _cache_file() -> Path:
    root = os.environ.get("FREETOKEN_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "freetoken") / "capacity_rates.json"


def _timed(fn: Any, seconds: float) -> float:
    fn()
    times, t_end = [], time.perf_counter() + seconds
    while time.perf_counter() < t_end or len(times) < 3:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def dense_rates(seconds: float = 0.5) -> tuple[float, float]:
    """(fp32 GEMV GB/s cycling 64 MiB of matrices, fp32 GEMM GFLOP/s at M=64)."""
    import torch

    mats = [torch.randn(1024, 2048) for _ in range(8)]
    x = torch.randn(2048)
    nbytes = sum(m.numel() * 4 for m in mats)
    gemv = _timed(lambda: [m @ x for m in mats], seconds)
    xb = torch.randn(64, 2048)
    gemm = _timed(lambda: [xb @ m.T for m in mats[:2]], seconds)
    return nbytes / gemv / 1e9, 2 * 64 * 2 * 1024 * 2048 / gemm / 1e9


def time_engine(folder: Path, quant: str, threads: int, prompt_len: int, tokens: int,
                rounds: int = 3) -> tuple[float, float]:
    """(decode s/token, prefill s/token) of a checkpoint folder: the best of ``rounds`` generate calls.

    Best, not median: the machine may be shared, and both the fit and the check want the model's own speed.
    """
    import torch

    from freetoken_agent.runtime.engine import Engine
    from freetoken_agent.runtime.kernels import ops

    engine = Engine.from_pretrained(folder, quant=quant, threads=threads)
    if quant != "none":
        ops.set_threads(threads)
    vocab = engine.spec.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
    engine.generate(prompt[:8], max_new_tokens=2, stop_token_ids=[])
    dec, pre = [], []
    for _ in range(rounds):
        r = engine.generate(prompt, max_new_tokens=tokens + 1, stop_token_ids=[])
        dec.append(r.decode_s / tokens)
        pre.append(r.prefill_s / prompt_len)
    return min(dec), min(pre)


def _fit(rates: Rates, threads: int, quant: str) -> Rates:
    """Fit overheads and in-engine rates from calibration models (never the models being planned).

    Tiny models (hidden 64) give the per-layer, per-step and per-expert overheads (2 vs 6 layers, top-1 vs
    top-4); a model with large experts gives the in-engine expert GB/s and one with a large output head the dense
    GEMV GB/s, each as bytes ÷ (time − every other predicted term).
    """
    from freetoken_agent.runtime.execution import capacity
    from freetoken_agent.runtime.execution.capacity_validate import write_random_checkpoint

    prompt = 64
    shapes = {
        "l2": {**TINY, "num_hidden_layers": 2}, "l6": {**TINY, "num_hidden_layers": 6},
        "k1": {**TINY, "num_hidden_layers": 6, "num_experts_per_tok": 1},
        "k4": {**TINY, "num_hidden_layers": 6, "num_experts_per_tok": 4},
        "dense": {**TINY, "num_hidden_layers": 2, "vocab_size": 16384, "hidden_size": 1024, "head_dim": 64},
        "experts": {**TINY, "num_hidden_layers": 2, "hidden_size": 1024, "head_dim": 64, "num_experts": 16,
                    "num_experts_per_tok": 4, "moe_intermediate_size": 1024},
    }  # fmt: skip
    t: dict[str, tuple[float, float]] = {}
    with tempfile.TemporaryDirectory(prefix="ft-calib-") as tmp:
        for name, cfg in shapes.items():
            folder = write_random_checkpoint(cfg, Path(tmp) / name)
            t[name] = time_engine(folder, quant, threads, prompt, 16, rounds=5)
            shutil.rmtree(folder)
    call = max((t["k4"][0] - t["k1"][0]) / (6 * 3), 0.0)
    layer = max((t["l6"][0] - t["l2"][0]) / 4 - 2 * call, 0.0)
    rates.expert_call_s, rates.layer_overhead_s = call, layer
    rates.step_overhead_s = max(t["l2"][0] - 2 * layer - 4 * call, 0.0)
    rates.prefill_layer_overhead_s = max((t["l6"][1] - t["l2"][1]) * prompt / 4, 0.0)

    def residual(name: str, term: str) -> tuple[float, int]:
        size = capacity.model_size(shapes[name], quant)
        p = capacity.plan(size, rates, None, None, prompt + 16, quant=quant)
        others = sum(v for k, v in p.decode_terms.items() if k != term)
        nbytes = size.dense_read_bytes if term == "dense" else size.active_expert_bytes
        return max(t[name][0] - others, 1e-6), nbytes

    secs, nbytes = residual("dense", "dense")
    rates.dense_gbps = nbytes / secs / 1e9
    secs, nbytes = residual("experts", "experts_host")
    rates.expert_gbps_m1 = nbytes / secs / 1e9
    return rates


def calibrate(threads: int = 1, quant: str = "q4", seconds: float = 0.5) -> Rates:
    """Measure every rate the planner uses on this machine at ``threads`` threads."""
    import torch

    from freetoken_agent.runtime import hardware
    from freetoken_agent.runtime.execution import microbench

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        dense, gemm = dense_rates(seconds)
        try:
            from freetoken_agent.runtime.kernels import ops

            ops.set_threads(threads)
        except Exception:  # the C kernels did not build: the microbenchmark times the torch fallback  # noqa: BLE001
            pass
        m1, m16, _kind = microbench.cpu_expert_gbps(hardware.EXPERT_SHAPE, seconds)
        profile = hardware.cached_profile()
        disk = (profile.bench.get("disk_read_gbps") if profile else None) or microbench.disk_read_gbps(
            _cache_file().parent) or 1.0
        gpu = (profile.bench.get("device_gbps") if profile else None)
        rates = Rates(dense_gbps=dense, gemm_gflops=gemm, expert_gbps_m1=m1, expert_gbps_m16=m16, disk_gbps=disk,
                      device_gbps=gpu, kernel_dense_gbps=dense, kernel_expert_gbps_m1=m1,
                      source=f"calibrated, {threads} thread(s)")  # fmt: skip
        return _fit(rates, threads, quant)
    finally:
        torch.set_num_threads(old)


def load_or_calibrate(threads: int = 1, quant: str = "q4", refresh: bool = False) -> Rates:
    """The cached rates of this machine for ``threads``/``quant``, measuring them (about 20 s) when missing."""
    from freetoken_agent.runtime import hardware

    fp = hardware.describe()[0]
    key = f"{fp}|t{threads}|{quant}"
    path = _cache_file()
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    if not refresh and isinstance(cached.get(key), dict):
        try:
            return Rates(**cached[key])
        except TypeError:
            pass
    rates = calibrate(threads, quant)
    cached[key] = asdict(rates)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".json")
    with os.fdopen(fd, "w") as fh:
        json.dump(cached, fh, indent=1)
    os.replace(tmp, path)
    return rates
