"""Measured rates for the capacity planner, cached per machine and thread count.

Kernel rates come from microbenchmarks (dense fp32 GEMV GB/s over more weights than the caches hold, GEMM GFLOP/s,
the CPU expert kernel via ``microbench.cpu_expert_gbps``, disk GB/s from the hardware probe). Framework overheads
(Python per layer, per step, per routed expert) cannot be read off a kernel: they are fit from decode and prefill
timings of fixed calibration models (see ``_fit``), never from the models being planned; the same runs give the
in-engine dense and expert GB/s (the microbenchmark values are kept as ``kernel_*``). Cached at ``$FREETOKEN_CACHE/capacity_rates.json``.
"""

from __future__ import annotations

import contextlib
import json
import os
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


def time_engines(folders: dict[str, Path], quant: str, threads: int, prompt_len: int = 64, tokens: int = 16,
                 rounds: int = 5) -> dict[str, tuple[float, float]]:
    """(decode s/token, prefill s/token) per checkpoint folder: all engines loaded, then ``rounds`` rounds that
    time each once in turn (A/B/C... alternating), keeping each one's best.

    Alternating puts every model under the same load; best, not median: on a shared machine the best run is the
    least disturbed, and the fit and the check both want the models' own speed.
    """
    import torch
    from freetoken_agent.runtime.engine import Engine
    from freetoken_agent.runtime.kernels import ops

    engines = {name: Engine.from_pretrained(f, quant=quant, threads=threads) for name, f in folders.items()}
    if quant != "none":
        ops.set_threads(threads)
    torch.set_num_threads(threads)
    prompts = {}
    for name, engine in engines.items():
        gen = torch.Generator().manual_seed(0)
        prompts[name] = torch.randint(0, engine.spec.vocab_size, (prompt_len,), generator=gen).tolist()
        engine.generate(prompts[name][:8], max_new_tokens=2, stop_token_ids=[])
    best = {name: (float("inf"), float("inf")) for name in engines}
    for _ in range(rounds):
        for name, engine in engines.items():
            r = engine.generate(prompts[name], max_new_tokens=tokens + 1, stop_token_ids=[])
            d, p = best[name]
            best[name] = (min(d, r.decode_s / tokens), min(p, r.prefill_s / prompt_len))
    return best


CALIBRATION: dict[str, dict[str, Any]] = {
    "l2": {**TINY, "num_hidden_layers": 2}, "l6": {**TINY, "num_hidden_layers": 6},
    "k1": {**TINY, "num_hidden_layers": 6, "num_experts_per_tok": 1},
    "k4": {**TINY, "num_hidden_layers": 6, "num_experts_per_tok": 4},
    "e16": {**TINY, "num_hidden_layers": 6, "num_experts": 16},
    "dense": {**TINY, "num_hidden_layers": 2, "hidden_size": 1024, "head_dim": 64, "intermediate_size": 4096,
              "mlp_only_layers": [0, 1]},
    "experts": {**TINY, "num_hidden_layers": 2, "hidden_size": 1024, "head_dim": 64, "num_experts": 16,
                "num_experts_per_tok": 4, "moe_intermediate_size": 1024},
    "medium": {**TINY, "num_hidden_layers": 3, "vocab_size": 2048, "hidden_size": 512, "intermediate_size": 1024,
               "num_attention_heads": 8, "head_dim": 64, "num_experts": 16, "num_experts_per_tok": 2,
               "moe_intermediate_size": 512},
}  # fmt: skip
"""The calibration models: tiny ones (hidden 64) give the per-tensor, per-step and per-expert overheads (2 vs 6
layers, top-1 vs top-4, 4 vs 16 experts for prefill); ``experts`` (large experts) gives the in-engine expert rates and ``dense`` (two large dense
MLP layers) the dense GEMV / GEMM rates, each as bytes ÷ (time − every other predicted term); ``medium`` (a mid-size
model) gives the residual scale between that sum and a measured time (``Rates.decode_scale``/``prefill_scale``)."""


def fit(rates: Rates, t: dict[str, tuple[float, float]], quant: str, prompt: int = 64) -> Rates:
    """Fit overheads and in-engine rates from the calibration models' timings ``t`` (see ``CALIBRATION``)."""
    from freetoken_agent.runtime.execution import capacity

    tensors = {n: capacity.model_size(CALIBRATION[n], quant).layer_tensors for n in ("l2", "l6")}
    call = max((t["k4"][0] - t["k1"][0]) / (6 * 3), 0.0)
    per_tensor = max(((t["l6"][0] - t["l2"][0]) - 4 * 2 * call) / (tensors["l6"] - tensors["l2"]), 0.0)
    rates.expert_call_s, rates.tensor_overhead_s = call, per_tensor
    rates.step_overhead_s = max(t["l2"][0] - tensors["l2"] * per_tensor - 4 * call, 0.0)
    pre_call = max((t["e16"][1] - t["l6"][1]) * prompt / (6 * 12), 0.0)
    rates.prefill_expert_call_s = pre_call
    rates.prefill_tensor_overhead_s = max(((t["l6"][1] - t["l2"][1]) * prompt - 4 * 4 * pre_call)
                                          / (tensors["l6"] - tensors["l2"]), 0.0)

    def residual(name: str, term: str, phase: int) -> tuple[float, capacity.ModelSize]:
        size = capacity.model_size(CALIBRATION[name], quant)
        p = capacity.plan(size, rates, None, None, prompt + 16 if phase == 0 else prompt, quant=quant,
                          prefill_chunk=prompt)
        terms = p.decode_terms if phase == 0 else p.prefill_terms
        return max(t[name][phase] - sum(v for k, v in terms.items() if k != term), 1e-7), size

    secs, size = residual("dense", "dense", 0)
    rates.dense_gbps = size.dense_read_bytes / secs / 1e9
    secs, size = residual("experts", "experts_host", 0)
    rates.expert_gbps_m1 = size.active_expert_bytes / secs / 1e9
    secs, size = residual("dense", "dense", 1)
    rates.gemm_gflops = 2 * (size.dense_params_read - size.head_params) / secs / 1e9
    secs, size = residual("experts", "experts_host", 1)
    rates.expert_gbps_m16 = size.active_expert_bytes / secs / 16 / 1e9
    size = capacity.model_size(CALIBRATION["medium"], quant)
    dec = capacity.plan(size, rates, None, None, prompt + 16, quant=quant)
    pre = capacity.plan(size, rates, None, None, prompt, quant=quant, prefill_chunk=prompt)
    rates.decode_scale = t["medium"][0] * dec.decode_tok_s
    rates.prefill_scale = t["medium"][1] * pre.prefill_tok_s
    return rates


def measure_with_calibration(extra: dict[str, dict[str, Any]], threads: int, quant: str, rounds: int = 5,
                             tokens: int = 16,
                             keep: Path | None = None) -> tuple[Rates, dict[str, tuple[float, float]]]:
    """Calibrate and time the ``extra`` configs in the same alternating rounds: (fitted rates, extra timings)."""
    from freetoken_agent.runtime.execution.capacity_validate import (
        write_random_checkpoint,
    )

    base = kernel_rates(threads)
    with tempfile.TemporaryDirectory(prefix="ft-calib-") as tmp:
        root = keep or Path(tmp)
        configs = {**CALIBRATION, **extra}
        folders = {name: write_random_checkpoint(cfg, root / name) for name, cfg in configs.items()}
        import torch

        old = torch.get_num_threads()
        try:
            t = time_engines(folders, quant, threads, tokens=tokens, rounds=rounds)
        finally:
            torch.set_num_threads(old)
    rates = fit(base, t, quant)
    return rates, {name: t[name] for name in extra}


def kernel_rates(threads: int = 1, seconds: float = 0.5) -> Rates:
    """The microbenchmark rates (before the in-engine fit) at ``threads`` threads."""
    import torch
    from freetoken_agent.runtime import hardware
    from freetoken_agent.runtime.execution import microbench

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        dense, gemm = dense_rates(seconds)
        with contextlib.suppress(Exception):  # C kernels not built: the microbenchmark times the torch fallback
            from freetoken_agent.runtime.kernels import ops

            ops.set_threads(threads)
        m1, m16, _kind = microbench.cpu_expert_gbps(hardware.EXPERT_SHAPE, seconds)
    finally:
        torch.set_num_threads(old)
    profile = hardware.cached_profile()
    disk = (profile.bench.get("disk_read_gbps") if profile else None) or microbench.disk_read_gbps(
        _cache_file().parent) or 1.0
    gpu = profile.bench.get("device_gbps") if profile else None
    return Rates(dense_gbps=dense, gemm_gflops=gemm, expert_gbps_m1=m1, expert_gbps_m16=m16, disk_gbps=disk,
                 device_gbps=gpu, kernel_dense_gbps=dense, kernel_expert_gbps_m1=m1,
                 source=f"calibrated, {threads} thread(s)")  # fmt: skip


def calibrate(threads: int = 1, quant: str = "q4") -> Rates:
    """Measure every rate the planner uses on this machine at ``threads`` threads."""
    return measure_with_calibration({}, threads, quant)[0]


VERSION = 2
"""Bumped when the calibration changes meaning (cached rates of older versions are measured again)."""


def cache_key(threads: int, quant: str) -> str:
    """This machine's key in the rates cache."""
    from freetoken_agent.runtime import hardware

    return f"{hardware.describe()[0]}|t{threads}|{quant}|v{VERSION}"


def load_or_calibrate(threads: int = 1, quant: str = "q4", refresh: bool = False) -> Rates:
    """The cached rates of this machine for ``threads``/``quant``, measuring them (about 20 s) when missing."""
    key = cache_key(threads, quant)
    path = _cache_file()
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    if not refresh and isinstance(cached.get(key), dict):
        with contextlib.suppress(TypeError):
            return Rates(**cached[key])
    rates = calibrate(threads, quant)
    cached[key] = asdict(rates)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".json")
    with os.fdopen(fd, "w") as fh:
        json.dump(cached, fh, indent=1)
    os.replace(tmp, path)
    return rates
