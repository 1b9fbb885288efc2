"""GPU check: one command that exercises the GPU paths on a fresh CUDA machine and prints one JSON report.

    python -m freetoken_agent.evals.perf.gpu_check                 # one NVIDIA GPU: < 8 minutes on an H200
    python -m freetoken_agent.evals.perf.gpu_check --dry-run       # CPU, tiny shapes, < 1 minute (alias --cpu-dry-run)
    python -m freetoken_agent.evals.perf.gpu_check --residency     # + residency policies on a Qwen3-30B-A3B shape
    freetoken bench gpu-check [--dry-run]                          # the same, recorded in the bench history

Nothing is downloaded: every model is random weights built in place. Sections, in this order:

- ``triton``: each Triton kernel (``bench_triton.cases``: dequant GEMM q4/q8, grouped MoE, paged decode attention)
  against its plain-torch reference; on ``--dry-run`` under ``TRITON_INTERPRET=1`` at tiny shapes.
- ``engine``: a synthetic MoE (fp32 weights, fp32 expert blobs in an expert cache file) generated greedily twice from
  the same prompt: the reference is the plain CPU engine (every expert a ``TorchExperts`` matmul); the candidate is the
  engine on CUDA with the GPU expert cache (device slot pool, planner ``fetch``: every cold expert is copied to a
  device slot and computed there), TF32 off. On ``--dry-run`` the candidate is the CPU engine with the simulated device
  tier (``ResidencyConfig(simulate_device=True)``).
- ``plain`` (CUDA only): the ``engine`` section's model with every weight on the GPU (experts as ``TorchExperts``
  there, no expert cache), fp32 and bf16: greedy tokens against that section's CPU reference, decode tok/s, and the
  host syncs per decode token.
- ``bandwidth``: host → device copies (pinned and pageable), device memory (device-to-device copy) and host memory.
- ``planner``: the execution planner's makespan estimate against the measured time of the same MoE layer steps of
  the ``engine`` candidate's timed generation.
- ``memory``: GPU memory from NVML (``pynvml``), sampled every 10 ms for the whole run, and torch's allocator peaks.
- ``profile`` (only with ``--profile``): the engine thread's steps of the ``engine`` candidate's timed run and of the
  ``plain`` fp32 run under cProfile, the top functions by their own time.
- ``residency`` (only with ``--residency``, about 5 minutes on the GPU): a Qwen3-30B-A3B-shaped q4 MoE under an 8 GB
  device budget per residency policy (``lru``, ``heat``, ``lru-fetch``, ``lru-fetch-torch``: lru-fetch with device slots
  dequantized by torch ops instead of the Triton slot kernels, ``cpu-moe``) and the phase-aware agent run
  (``phase_gpu``).

Report (stdout; progress goes to stderr). Units: seconds (``_s``), bytes (``_bytes``), GB/s = 1e9 bytes/s
(``_gbps``), tokens/s (``_tok_s``). A field that needs CUDA is ``null`` on ``--dry-run`` and its section's
``skipped`` maps the field to the reason. A section is ``{"status": "skipped", "reason": ...}`` when it did not run
and ``{"status": "failed", "error": ..., "traceback": ...}`` when it raised (the other sections still run).

- ``mode``: ``"cuda"`` or ``"dry-run"``; ``passed``: every check that ran passed (kernels within tolerance, tokens
  identical, residency budgets respected; no section failed); ``wall_s``; ``budget_s`` (480); ``within_budget``.
- ``device``: ``name`` (the GPU's, or ``"cpu"``), ``torch``, ``cuda`` (torch's CUDA version or null), ``triton``
  (version or null).
- ``triton``: ``status`` (``"ran"``), ``interpret`` (bool), ``rel_tol``, ``passed``, ``kernels``: one row per case
  with ``kernel``, ``format``, ``shape``, ``M`` (rows / tokens), ``max_abs_err`` (max |kernel − reference|),
  ``max_rel_err`` (max_abs_err / max |reference|), ``rel_err`` (‖kernel − reference‖₂ / ‖reference‖₂), ``passed``
  (``rel_err <= rel_tol``).
- ``engine``: ``status``, ``model`` (``hidden``, ``layers``, ``experts``, ``top_k``, ``intermediate``, ``vocab``),
  ``expert_format`` (``"float32"``), ``reference`` and ``candidate`` (what each side runs, in words), ``tf32``
  (false), ``differences`` (what may differ numerically between the sides), ``prompt_tokens``, ``new_tokens``,
  ``tokens_match``, ``first_mismatch`` (index of the first differing generated token, or null), ``reference_tokens``,
  ``tokens``, ``decode_tok_s`` and ``prefill_s`` (each ``{"reference": ..., "candidate": ...}``), ``expert_bytes``
  (one expert blob), ``device_slots``, ``planner_paths`` (``resident``/``fetch``/``host`` decisions),
  ``device_hit_rate``, ``host_hit_rate``, ``stall_s``.
- ``plain``: ``status`` (``skipped`` on ``--dry-run``), ``reference``, ``float32`` and ``bfloat16`` (each
  ``decode_tok_s``, ``prefill_s``, ``agreement``: the fraction of generated tokens equal to the reference's,
  ``first_mismatch``), ``tokens_match`` (fp32 tokens identical; a mismatch fails the check), ``host_syncs_per_token``
  (ops that waited for the GPU in a 16-token prompt + 8 generated tokens, per generated token).
- ``bandwidth``: ``status``, ``h2d_pinned_gbps``, ``h2d_pageable_gbps`` (host → device, bytes copied / s),
  ``device_memory_gbps`` (device-to-device copy, read + write bytes / s), ``host_copy_gbps`` (CPU tensor copy, read +
  write bytes / s), ``h2d_bytes``, ``device_bytes``, ``host_bytes`` (size of one copy), ``skipped``.
- ``memory``: ``status``, ``nvml_total_bytes``, ``nvml_baseline_used_bytes`` (before the first section),
  ``nvml_peak_used_bytes`` (the largest sample), ``nvml_peak_by_section`` (section → bytes), ``nvml_samples``,
  ``torch_peak_allocated_bytes``, ``torch_peak_reserved_bytes``, ``host_peak_rss_bytes``, ``skipped``.
- ``planner``: ``status``, ``mode`` (``"fetch"``), ``rates_source`` (``"hardware profile"`` or ``"built-in"``),
  ``rates_before`` / ``rates_after`` (the cost model's rates before and after the timed run: ``copy_gbps``,
  ``host_gbps_m1``, ``host_gbps_m16``, ``disk_gbps``, ``device_s_fixed``, ``device_s_per_token``),
  ``copy_gbps_measured`` (``bandwidth.h2d_pinned_gbps``; on ``--dry-run`` ``host_copy_gbps`` / 2, the simulated tier's
  copies being host copies), ``decode`` and ``prefill``: ``layer_steps`` (MoE layer calls), ``predicted_s`` (sum of the
  planner's makespans, max(host, device) per call), ``measured_s`` (sum of the same calls' wall times, CUDA
  synchronized before and after), ``ratio`` (measured / predicted) and ``median_ratio`` (per call).
- ``profile``: ``status``; when run, ``engine`` and ``plain`` (where they ran): rows of ``function``
  (``file:line(name)``), ``calls``, ``tottime_s`` (own time), ``cumtime_s``, the 25 with the most own time.
- ``residency``: ``status``; when run, ``rows`` (per policy: ``run``, ``decode_tok_s``, ``prefill_s``, ``wall_s``,
  ``planner`` decisions, ``device_hit_rate``, ``host_hit_rate``, ``stall_s``, ``peak`` and ``limits`` bytes per tier,
  ``tokens``), ``phase`` (``phase_gpu.run``'s report, or null with ``--phase-turns 0``), ``phase_args``,
  ``over_budget`` (runs whose peak passed a limit), ``profile`` (the hardware profile).

Exit status 1 when ``passed`` is false.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from freetoken_agent.evals.perf.harness import BenchError, module_main, row
from freetoken_agent.evals.perf.timing import DecodeTiming, repeat

BUDGET_S = 480
SECTIONS = ("triton", "engine", "plain", "bandwidth")
"""Sections ``--skip`` can leave out (``planner`` reads ``engine``'s run; ``memory`` spans the whole run)."""

QWEN3_30B_A3B: dict[str, Any] = dict(
    model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048,
    intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
    num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
    decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=40960, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=False, hidden_act="silu",
)
TINY = dict(QWEN3_30B_A3B, vocab_size=1024, hidden_size=256, moe_intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=16, num_experts_per_tok=4)


ENGINE_MODEL = dict(QWEN3_30B_A3B, vocab_size=8192, hidden_size=1024, moe_intermediate_size=512, num_hidden_layers=8,
                    num_attention_heads=8, num_key_value_heads=2, head_dim=128, num_experts=32, num_experts_per_tok=4)
ENGINE_TINY = dict(QWEN3_30B_A3B, vocab_size=256, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=2,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=8, num_experts_per_tok=2)
"""The ``engine`` section's synthetic MoE (CUDA) and its ``--dry-run`` size."""


def random_weights(spec: Any, device: str, dtype: torch.dtype, experts: bool = False) -> Any:
    """Weights with the loader's exact names and shapes, random (norms at one). Routed experts are random too when
    ``experts`` (from a per-layer generator, so the dense values do not depend on it), else empty."""
    from freetoken_agent.runtime.model import weights as weights_mod
    from freetoken_agent.runtime.model.moe import TorchExperts

    gen = torch.Generator(device="cpu").manual_seed(0)

    class RandomLoader(weights_mod.ShapeRecorder):
        def take(self, name: str, shape: tuple[int, ...], dt: torch.dtype | None = None) -> torch.Tensor:
            if "norm" in name:
                return torch.ones(shape, device=device, dtype=dt or dtype)
            t = torch.randn(shape, generator=gen) * (1.0 / shape[-1]) ** 0.5
            return t.to(device=device, dtype=dt or dtype)

        def experts(self, prefix: str, m: Any, names: Any, d: int) -> TorchExperts:
            if not experts:
                empty = torch.empty(0, dtype=dtype)
                return TorchExperts(m, empty, empty)
            g = torch.Generator().manual_seed(1000 + self.layer)
            gate_up = torch.randn(m.num_experts, 2 * m.intermediate, d, generator=g) / d**0.5  # [E, 2I, D]
            down = torch.randn(m.num_experts, d, m.intermediate, generator=g) / m.intermediate**0.5  # [E, D, I]
            return TorchExperts(m, gate_up.to(device, dtype), down.to(device, dtype))

    return weights_mod.walk_weights(spec, RandomLoader(), None)


def write_experts(path: Path, spec: Any, layout: Any, moe_layers: list[int]) -> Any:
    """The expert cache file: 16 distinct random Q4_0 experts, repeated over every (layer, expert)."""
    from freetoken_agent.runtime.checkpoint.experts import ExpertTensors
    from freetoken_agent.runtime.experts.cache_file import (
        ExpertCacheFile,
        write_cache_file,
    )

    moe = spec.layers[moe_layers[0]].moe
    if not path.is_file():
        d, i = spec.hidden_size, moe.intermediate
        gen = torch.Generator().manual_seed(1)
        blobs = [layout.encode(ExpertTensors(torch.randn(2 * i, d, generator=gen) / d**0.5,
                                             torch.randn(d, i, generator=gen) / i**0.5)) for _ in range(16)]
        write_cache_file(path, _Encoded(layout, blobs), moe_layers, moe.num_experts,  # type: ignore[arg-type]
                         lambda layer, e: (layer * 7 + e) % 16)  # type: ignore[arg-type,return-value]
    return ExpertCacheFile(path)


class _Encoded:
    """A layout stand-in whose ``encode(k)`` returns pre-quantized blob ``k`` (6,144 experts written in seconds)."""

    def __init__(self, layout: Any, blobs: list[torch.Tensor]) -> None:
        self.layout, self.blobs = layout, blobs
        self.blob_bytes = layout.blob_bytes

    def encode(self, k: int) -> torch.Tensor:
        return self.blobs[k]

    def to_json(self) -> dict[str, object]:
        return self.layout.to_json()


RUNS = {"lru": ("lru", "adaptive"), "heat": ("heat", "adaptive"), "lru-fetch": ("lru", "fetch"),
        "lru-fetch-torch": ("lru", "fetch"), "cpu-moe": ("lru", "host")}
"""Residency run → (eviction policy, planner mode)."""


def run_config(name: str, spec: Any, weights: Any, disk_path: Path, args: argparse.Namespace, device: str,
               prompt: list[int]) -> dict[str, Any]:
    policy, planner = RUNS[name]
    # "-torch": device slots dequantized by torch ops, one expert at a time (the path before the Triton slot kernels)
    saved = os.environ.get("FREETOKEN_DEVICE_EXPERTS")
    os.environ["FREETOKEN_DEVICE_EXPERTS"] = "torch" if name.endswith("-torch") else (saved or "auto")
    try:
        return _run_config(name, policy, planner, spec, weights, disk_path, args, device, prompt)
    finally:
        if saved is None:
            os.environ.pop("FREETOKEN_DEVICE_EXPERTS", None)
        else:
            os.environ["FREETOKEN_DEVICE_EXPERTS"] = saved


def _run_config(name: str, policy: str, planner: str, spec: Any, weights: Any, disk_path: Path,
                args: argparse.Namespace, device: str, prompt: list[int]) -> dict[str, Any]:
    from freetoken_agent.runtime.engine import Engine
    from freetoken_agent.runtime.experts.cache_file import ExpertCacheFile
    from freetoken_agent.runtime.experts.core import install
    from freetoken_agent.runtime.experts.loader import tensor_bytes
    from freetoken_agent.runtime.experts.setup import Managed, ResidencyConfig, build_store
    from freetoken_agent.runtime.memory import Budget, parse_bytes
    from freetoken_agent.runtime.model.decoder import Decoder

    cfg = ResidencyConfig(policy=policy, planner=planner, device_tier=name != "cpu-moe", prefetch=True,
                          simulate_device=args.dry_run and name != "cpu-moe")
    budget = Budget(device=parse_bytes(args.device_memory), host=parse_bytes(args.host_memory))
    ledgers = budget.ledgers()
    ledgers["host" if device == "cpu" else "device"].reserve("dense", tensor_bytes(weights))
    ledgers["host"].reserve("kv", 0)
    top_k = spec.layers[-1].moe.top_k
    store, plan = build_store(ExpertCacheFile(disk_path), ledgers, top_k, device, cfg)
    engine = Engine(spec, Decoder(spec, weights, device), None, None)
    backends = Managed(weights, store, plan, ledgers, spec, 0, False).backends()
    install(engine.decoder, backends)
    engine.residency = store
    kernels = sorted({getattr(b, "device_kernel", "torch") for b in backends if b is not None})
    engine.generate(prompt[:8], max_new_tokens=4)  # warm-up: kernels, caches, slot pools
    t0 = time.perf_counter()
    out = engine.generate(prompt, max_new_tokens=args.tokens)
    wall = time.perf_counter() - t0
    stats = engine.stats()
    res = stats["residency"]
    store.close()
    rate = DecodeTiming.from_generation(out).tok_s
    return {"run": name, "device_kernel": ",".join(kernels), "decode_tok_s": round(rate, 2) if rate else None,
            "prefill_s": round(out.prefill_s, 2), "wall_s": round(wall, 1), "planner": res["planner"],
            "device_hit_rate": res["tiers"].get("device", {}).get("hit_rate"),
            "host_hit_rate": res["tiers"]["host"]["hit_rate"], "stall_s": res["stall_s"],
            "peak": {t: v["peak"] for t, v in res["budget"].items()}, "limits": {t: v["limit"] for t, v in res["budget"].items()},
            "tokens": out.token_ids}


# ---------------------------------------------------------------- sections: each returns its part of the report


def _sync(cuda: bool) -> Callable[[], None]:
    return torch.cuda.synchronize if cuda else (lambda: None)


def triton_section(cuda: bool) -> dict[str, Any]:
    """Every Triton kernel against its reference (``bench_triton.check``); on the CPU (not ``cuda``) only under
    ``TRITON_INTERPRET=1`` set before triton was first imported (``gpu_check_row`` does)."""
    if not _has_triton():
        return {"status": "skipped", "reason": "triton is not installed"}
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        return {"status": "skipped", "reason": "triton was imported in this process before TRITON_INTERPRET=1 "
                "could be set, so its kernels cannot run on the CPU here"}
    from freetoken_agent.evals.perf import bench_triton

    torch.manual_seed(0)
    rows = bench_triton.check(interpret=not cuda)
    return {"status": "ran", "interpret": not cuda, "rel_tol": bench_triton.REL_TOL,
            "passed": all(r["passed"] for r in rows), "kernels": rows}


def _has_triton() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def _triton_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("triton")
    except PackageNotFoundError:
        return None


class RecordingPlanner:
    """Wraps the store's ``ExecutionPlanner`` (same cost model, same decisions) and keeps the last plan it made,
    so each MoE layer call can be paired with the planner's estimate for it."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.cost, self.decisions = inner, inner.cost, inner.decisions
        self.last: Any = None

    def plan(self, needs: list[Any], device_room: int | None = None) -> Any:
        self.last = self.inner.plan(needs, device_room)
        return self.last


class TimedExperts:
    """An ``ExpertsBackend`` that times ``inner.forward`` (synchronized) and logs (tokens, predicted s, measured s)."""

    def __init__(self, inner: Any, planner: RecordingPlanner, log: list[tuple[int, float, float]],
                 sync: Callable[[], None]) -> None:
        self.inner, self.planner, self.log, self.sync = inner, planner, log, sync

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        self.planner.last = None
        self.sync()
        t0 = time.perf_counter()
        out = self.inner.forward(x, topk_ids, topk_weights)
        self.sync()
        seconds = time.perf_counter() - t0
        plan = self.planner.last
        if plan is not None:
            self.log.append((x.shape[0], max(plan.host_s, plan.device_s), seconds))
        return out


def _generate(engine: Any, prompt: list[int], tokens: int) -> tuple[Any, float | None]:
    engine.generate(prompt[:8], max_new_tokens=4)  # warm-up: kernels, caches, slot pools
    out = engine.generate(prompt, max_new_tokens=tokens)
    return out, DecodeTiming.from_generation(out).tok_s


def engine_section(cuda: bool, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """The CPU engine vs the engine with the GPU expert cache (the simulated device tier when not ``cuda``): same
    fp32 weights, greedy, same prompt. ``report["_log"]`` carries the candidate's timed layer calls for ``planner``."""
    from freetoken_agent.runtime.checkpoint.experts import ExpertTensors
    from freetoken_agent.runtime.engine import Engine
    from freetoken_agent.runtime.experts.cache_file import ExpertCacheFile, write_cache_file
    from freetoken_agent.runtime.experts.core import install
    from freetoken_agent.runtime.experts.layout import ExpertLayout
    from freetoken_agent.runtime.experts.loader import tensor_bytes
    from freetoken_agent.runtime.experts.setup import Managed, ResidencyConfig, build_store
    from freetoken_agent.runtime.memory import Budget
    from freetoken_agent.runtime.model.adapters import spec_from_config
    from freetoken_agent.runtime.model.decoder import Decoder

    if cuda:  # fp32 on both sides: no TF32 in cuBLAS or cuDNN
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    spec = spec_from_config(dict(ENGINE_MODEL if cuda else ENGINE_TINY))
    moe_layers = [i for i, layer in enumerate(spec.layers) if layer.moe is not None]
    moe = spec.layers[moe_layers[0]].moe
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, spec.vocab_size, (args.engine_prompt,), generator=gen).tolist()

    ref_weights = random_weights(spec, "cpu", torch.float32, experts=True)
    reference = Engine(spec, Decoder(spec, ref_weights, "cpu"), None, None)
    ref_out, ref_rate = _generate(reference, prompt, args.engine_tokens)
    reference.close()
    _say(f"engine: reference (CPU) {ref_rate} tok/s")

    layout = ExpertLayout("float32", spec.hidden_size, moe.intermediate)
    path = workdir / "engine-experts.ftx"

    def load(layer: int, e: int) -> ExpertTensors:
        ex = ref_weights.layers[layer].moe.experts
        return ExpertTensors(ex.gate_up[e], ex.down[e])

    write_cache_file(path, layout, moe_layers, moe.num_experts, load)
    device = "cuda" if cuda else "cpu"
    weights = random_weights(spec, device, torch.float32)
    dense = tensor_bytes(weights)
    disk = ExpertCacheFile(path)
    stride, total = disk.layout.stride, len(moe_layers) * moe.num_experts
    slots = max(2 * moe.top_k, total // 2)  # half the experts fit on the device: the cache evicts and refills
    budget = Budget(device=(dense if cuda else 0) + slots * stride, host=(0 if cuda else dense) + total * stride)
    ledgers = budget.ledgers()
    ledgers["device" if cuda else "host"].reserve("dense", dense)
    ledgers["host"].reserve("kv", 0)
    cfg = ResidencyConfig(policy="lru", planner="fetch", prefetch=True, simulate_device=not cuda)
    store, inner_planner = build_store(disk, ledgers, moe.top_k, device, cfg)
    planner = RecordingPlanner(inner_planner)
    rates_before = dict(vars(planner.cost.rates))
    engine = Engine(spec, Decoder(spec, weights, device), None, None)
    log: list[tuple[int, float, float]] = []
    backends = Managed(weights, store, planner, ledgers, spec, 0, False).backends()  # type: ignore[arg-type]
    install(engine.decoder, {i: TimedExperts(b, planner, log, _sync(cuda)) for i, b in backends.items()})
    engine.kv_manager()  # before the store is attached: the KV pool stays outside the expert budget
    engine.residency = store
    engine.generate(prompt[:8], max_new_tokens=4)
    log.clear()
    profile = _profiler(engine, args)
    out = engine.generate(prompt, max_new_tokens=args.engine_tokens)
    engine.scheduler.profile = None
    rate = DecodeTiming.from_generation(out).tok_s
    res = engine.stats()["residency"]
    engine.close()
    store.close()
    _say(f"engine: candidate ({device}, expert cache) {rate} tok/s")
    a, b = list(ref_out.token_ids), list(out.token_ids)
    shorter = None if len(a) == len(b) else min(len(a), len(b))
    mismatch = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), shorter)
    return {
        "status": "ran",
        "model": {"hidden": spec.hidden_size, "layers": spec.num_layers, "experts": moe.num_experts,
                  "top_k": moe.top_k, "intermediate": moe.intermediate, "vocab": spec.vocab_size},
        "expert_format": "float32",
        "reference": "CPU engine, fp32, every expert a TorchExperts matmul",
        "candidate": ("CUDA engine, fp32 dense weights on the GPU, experts from the expert cache file through host "
                      "slots into the GPU expert cache (device slots), planner 'fetch'") if cuda else
                     ("CPU engine, experts from the expert cache file through host slots into the simulated device "
                      "tier (CPU memory), planner 'fetch'"),
        "tf32": False,
        "differences": GPU_DIFFERENCES if cuda else "none: both sides run the same CPU ops on the same fp32 weights",
        "prompt_tokens": len(prompt), "new_tokens": args.engine_tokens,
        "tokens_match": mismatch is None, "first_mismatch": mismatch, "reference_tokens": a, "tokens": b,
        "decode_tok_s": {"reference": _round(ref_rate), "candidate": _round(rate)},
        "prefill_s": {"reference": round(ref_out.prefill_s, 4), "candidate": round(out.prefill_s, 4)},
        "expert_bytes": layout.blob_bytes, "device_slots": slots,
        "planner_paths": res["planner"], "device_hit_rate": res["tiers"].get("device", {}).get("hit_rate"),
        "host_hit_rate": res["tiers"]["host"]["hit_rate"], "stall_s": res["stall_s"],
        "_log": log, "_rates": (rates_before, dict(vars(planner.cost.rates))), "_profile": profile,
    }


def plain_section(cuda: bool, args: argparse.Namespace, engine: dict[str, Any]) -> dict[str, Any]:
    """The engine with every weight on the GPU (experts as ``TorchExperts`` there, no expert cache) on the ``engine``
    section's model and prompt: fp32 greedy tokens against that section's CPU reference, decode tok/s in fp32 and
    bf16, and the host syncs a decode token costs (CUDA's sync debug mode counts every op that waits for the GPU)."""
    if not cuda:
        return {"status": "skipped", "reason": "no CUDA device: the plain engine on the CPU is the engine section's "
                "reference"}
    import warnings

    from freetoken_agent.runtime.engine import Engine
    from freetoken_agent.runtime.model.adapters import spec_from_config
    from freetoken_agent.runtime.model.decoder import Decoder

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 against the CPU's fp32 (also when --skip engine)
    spec = spec_from_config(dict(ENGINE_MODEL))
    prompt = torch.randint(0, spec.vocab_size, (args.engine_prompt,), generator=torch.Generator().manual_seed(2)).tolist()
    reference = engine.get("reference_tokens")
    out: dict[str, Any] = {"status": "ran", "reference": "the engine section's CPU engine (fp32, same weights)"}
    for dtype in (torch.float32, torch.bfloat16):
        eng = Engine(spec, Decoder(spec, random_weights(spec, "cuda", dtype, experts=True), "cuda"), None, None)
        if dtype == torch.float32:
            out["_profile"] = _profiler(eng, args)  # warm-up included
        got, rate = _generate(eng, prompt, args.engine_tokens)
        eng.scheduler.profile = None
        row: dict[str, Any] = {"decode_tok_s": _round(rate), "prefill_s": round(got.prefill_s, 4)}
        if reference is not None:
            same = [a == b for a, b in zip(reference, got.token_ids)]
            row["agreement"] = round(sum(same) / max(len(reference), 1), 3)
            row["first_mismatch"] = next((i for i, ok in enumerate(same) if not ok), None)
        if dtype == torch.float32:
            new = 8
            with warnings.catch_warnings(record=True) as caught:  # record=True: the engine thread's warnings too
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    eng.generate(prompt[:16], max_new_tokens=new)
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            syncs = sum("synchroniz" in str(w.message) for w in caught)
            out["host_syncs_per_token"] = round(syncs / new, 2)  # prefill's share included
        eng.close()
        out["float32" if dtype == torch.float32 else "bfloat16"] = row
        _say(f"plain: {dtype} {rate} tok/s")
    f32 = out["float32"]
    out["tokens_match"] = None if reference is None else f32["first_mismatch"] is None
    return out


GPU_DIFFERENCES = (
    "same fp32 weights and the same ops; the GPU runs cuBLAS GEMMs (TF32 off) and CUDA attention and elementwise "
    "kernels, whose sums are reduced in another order than the CPU's, so activations differ by rounding (~1e-6 "
    "relative); greedy tokens must still match")


def _profiler(engine: Any, args: argparse.Namespace) -> Any:
    """With ``--profile``: a ``cProfile.Profile`` switched on around each of ``engine``'s steps (on its thread)."""
    if not args.profile:
        return None
    import cProfile

    engine.scheduler.profile = cProfile.Profile()
    return engine.scheduler.profile


def profile_rows(profile: Any, n: int = 25) -> list[dict[str, Any]]:
    """The ``n`` functions with the most time of their own in ``profile``: where a decode step's time goes."""
    import pstats

    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]  # {(file, line, name): (cc, calls, tt, ct, _)}
    top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:n]
    return [{"function": name if file == "~" else f"{Path(file).name}:{line}({name})", "calls": calls,
             "tottime_s": round(tt, 4),
             "cumtime_s": round(ct, 4)} for (file, line, name), (_, calls, tt, ct, _) in top]


def _round(x: float | None, n: int = 2) -> float | None:
    return None if x is None else round(x, n)


def bandwidth_section(cuda: bool) -> dict[str, Any]:
    """Copy rates, median of 5 timed copies after one warm-up (each synchronized on CUDA)."""
    host_bytes = (256 if cuda else 32) << 20
    src = torch.ones(host_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    host_s = repeat(lambda: dst.copy_(src), 5).median
    out: dict[str, Any] = {"status": "ran", "host_copy_gbps": round(2 * host_bytes / host_s / 1e9, 2),
                           "host_bytes": host_bytes}
    if not cuda:
        reason = "no CUDA device (--dry-run)"
        out.update(h2d_pinned_gbps=None, h2d_pageable_gbps=None, device_memory_gbps=None, h2d_bytes=None,
                   device_bytes=None, skipped={k: reason for k in ("h2d_pinned_gbps", "h2d_pageable_gbps",
                                                                   "device_memory_gbps")})
        return out
    sync = torch.cuda.synchronize
    h2d_bytes, dev_bytes = 256 << 20, 1 << 30
    pinned = torch.ones(h2d_bytes, dtype=torch.uint8).pin_memory()
    on_dev = torch.empty(h2d_bytes, dtype=torch.uint8, device="cuda")
    pinned_s = repeat(lambda: on_dev.copy_(pinned, non_blocking=True), 5, sync=sync).median
    pageable_s = repeat(lambda: on_dev.copy_(src[:h2d_bytes]), 5, sync=sync).median
    a = torch.ones(dev_bytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    dev_s = repeat(lambda: b.copy_(a), 5, sync=sync).median
    del pinned, on_dev, a, b
    out.update(h2d_pinned_gbps=round(h2d_bytes / pinned_s / 1e9, 2),
               h2d_pageable_gbps=round(h2d_bytes / pageable_s / 1e9, 2),
               device_memory_gbps=round(2 * dev_bytes / dev_s / 1e9, 2), h2d_bytes=h2d_bytes, device_bytes=dev_bytes,
               skipped={})
    return out


def planner_section(engine: dict[str, Any], bandwidth: dict[str, Any], cuda: bool, rates_source: str) -> dict[str, Any]:
    """The planner's makespan per MoE layer call against the call's measured time, decode and prefill apart."""
    if engine.get("status") != "ran":
        return {"status": "skipped", "reason": "the engine section did not run"}
    log: list[tuple[int, float, float]] = engine["_log"]
    before, after = engine["_rates"]

    def part(calls: list[tuple[int, float, float]]) -> dict[str, Any]:
        pred, meas = sum(c[1] for c in calls), sum(c[2] for c in calls)
        ratios = [c[2] / c[1] for c in calls if c[1] > 0]
        return {"layer_steps": len(calls), "predicted_s": round(pred, 6), "measured_s": round(meas, 6),
                "ratio": round(meas / pred, 3) if pred else None,
                "median_ratio": round(statistics.median(ratios), 3) if ratios else None}

    if cuda:
        measured = bandwidth.get("h2d_pinned_gbps")
    else:
        host = bandwidth.get("host_copy_gbps")
        measured = round(host / 2, 2) if host else None  # one direction's bytes: the simulated tier's copies
    return {"status": "ran", "mode": "fetch", "rates_source": rates_source, "rates_before": before,
            "rates_after": after, "copy_gbps_measured": measured,
            "decode": part([c for c in log if c[0] == 1]), "prefill": part([c for c in log if c[0] > 1])}


class NvmlPeak:
    """GPU memory in use (NVML, device-wide), sampled on a thread; the peak overall and per named section."""

    def __init__(self, interval: float = 0.01) -> None:
        import pynvml

        self.nvml = pynvml
        pynvml.nvmlInit()
        self.handle = self._handle()
        info = pynvml.nvmlDeviceGetMemoryInfo(self.handle)
        self.total, self.baseline = int(info.total), int(info.used)
        self.peak, self.samples, self.section = self.baseline, 0, "start"
        self.by_section: dict[str, int] = {}
        self.interval = interval
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="nvml-peak", daemon=True)
        self.thread.start()

    def _handle(self) -> Any:
        """The NVML handle of torch's current device: by UUID (right under CUDA_VISIBLE_DEVICES), else by index."""
        nv = self.nvml
        uuid = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "uuid", None)
        if uuid is not None:
            try:
                return nv.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
            except nv.NVMLError:
                pass  # an older driver's UUID spelling: the index below names the same device without a mask
        return nv.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())

    def _run(self) -> None:
        while not self._stop.is_set():
            used = int(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used)
            self.samples += 1
            self.peak = max(self.peak, used)
            self.by_section[self.section] = max(self.by_section.get(self.section, 0), used)
            self._stop.wait(self.interval)

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self.thread.join()
        self.nvml.nvmlShutdown()
        return {"nvml_total_bytes": self.total, "nvml_baseline_used_bytes": self.baseline,
                "nvml_peak_used_bytes": self.peak, "nvml_peak_by_section": self.by_section,
                "nvml_samples": self.samples}


def _host_peak_rss() -> int:
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib if sys.platform == "darwin" else kib * 1024  # macOS reports bytes, Linux KiB


def _guarded(name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run one section; an exception becomes that section's ``failed`` entry and the others still run."""
    t0 = time.perf_counter()
    try:
        out = fn()
    except Exception as exc:  # noqa: BLE001 - reported in the JSON (and on stderr), and the check fails
        tb = traceback.format_exc()
        _say(f"{name}: failed\n{tb}")
        return {"status": "failed", "error": f"{type(exc).__name__}: {exc}", "traceback": tb.splitlines()[-8:]}
    _say(f"{name}: {out.get('status')} in {time.perf_counter() - t0:.1f} s")
    return out


def residency_section(args: argparse.Namespace) -> dict[str, Any]:
    """The residency-policy runs and the phase-aware run on a Qwen3-30B-A3B-shaped q4 MoE (tiny on ``--dry-run``)."""
    from freetoken_agent.evals.perf import phase_gpu
    from freetoken_agent.runtime.experts.cache_file import cache_root
    from freetoken_agent.runtime.experts.layout import ExpertLayout
    from freetoken_agent.runtime.hardware import load_or_probe
    from freetoken_agent.runtime.kernels import build
    from freetoken_agent.runtime.model.adapters import spec_from_config

    device = "cpu" if args.dry_run else "cuda"
    if args.dry_run:
        args.device_memory, args.host_memory = "2MB", "64MB"
    profile = load_or_probe(seconds=0.3)
    config = dict(TINY if args.dry_run else QWEN3_30B_A3B)
    if args.layers:
        config["num_hidden_layers"] = args.layers
    spec = spec_from_config(config)
    weights = random_weights(spec, device, torch.float32 if args.dry_run else torch.bfloat16)
    moe_layers = [i for i, layer in enumerate(spec.layers) if layer.moe is not None]
    moe = spec.layers[moe_layers[0]].moe
    layout = ExpertLayout("q4_0", spec.hidden_size, moe.intermediate, False, build.load() is not None)
    root = Path(args.cache) if args.cache else cache_root()
    name = f"{'tiny' if args.dry_run else 'qwen3-30b-a3b'}-l{spec.num_layers}-{'packed' if layout.packed else 'gguf'}"
    disk_path = root / f"gpu-check-{name}.ftx"
    write_experts(disk_path, spec, layout, moe_layers).close()
    _say(f"residency: experts {len(moe_layers) * moe.num_experts} x {layout.blob_bytes / 1e6:.2f} MB in {disk_path}")
    prompt = torch.randint(0, spec.vocab_size, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    rows = []
    for run in args.runs.split(","):
        rows.append(run_config(run, spec, weights, disk_path, args, device, prompt))
        r = rows[-1]
        _say(f"residency {run}: {r['decode_tok_s']} tok/s decode, planner {r['planner']}, device hit "
             f"{r['device_hit_rate']}, host hit {r['host_hit_rate']}, peak {r['peak']} (limits {r['limits']})")
    phase = None
    if args.phase_turns:
        from freetoken_agent.runtime.experts.setup import build_store

        phase = phase_gpu.run(spec, weights, disk_path, args, device, build_store)
    over = [r["run"] for r in rows + (phase["rows"] if phase else []) for t in ("device", "host")
            if r["limits"][t] is not None and r["peak"][t] > r["limits"][t]]
    return {"status": "ran", "rows": rows, "phase": phase, "over_budget": over, "profile": profile.to_json(),
            "phase_args": {"turns": args.phase_turns, "warm": args.phase_warm, "host": args.phase_host,
                           "pause": args.phase_pause} if phase else None}


# ---------------------------------------------------------------- the command


def options(p: argparse.ArgumentParser) -> None:
    from freetoken_agent.evals.perf import phase_gpu

    p.add_argument("--dry-run", "--cpu-dry-run", dest="dry_run", action="store_true",
                   help="no CUDA: every section that can run on the CPU, at tiny shapes (under a minute)")
    p.add_argument("--skip", default="", help=f"comma-separated sections to leave out: {', '.join(SECTIONS)}")
    p.add_argument("--engine-tokens", type=int, default=None, help="tokens generated per engine side (64; 12 dry)")
    p.add_argument("--engine-prompt", type=int, default=None, help="engine prompt tokens (128; 16 dry)")
    p.add_argument("--out", default=None, help="also write the report as JSON here")
    p.add_argument("--profile", action="store_true",
                   help="cProfile the engine thread's steps of the engine and plain runs: top functions in the report")
    g = p.add_argument_group("residency section (--residency)")
    g.add_argument("--residency", action="store_true",
                   help="also run the residency policies on a Qwen3-30B-A3B shape (~5 min on the GPU)")
    g.add_argument("--device-memory", default="8GB")
    g.add_argument("--host-memory", default="24GB")
    g.add_argument("--tokens", type=int, default=32)
    g.add_argument("--prompt", type=int, default=64)
    g.add_argument("--runs", default="lru,heat,lru-fetch,lru-fetch-torch,cpu-moe",
                   help="comma-separated residency runs: lru, heat, lru-fetch, lru-fetch-torch (device slots by torch "
                   "ops), cpu-moe")
    g.add_argument("--layers", type=int, default=None, help="fewer layers than 48 (a quicker, smaller check)")
    g.add_argument("--cache", default=None, help="folder for the expert cache file (default $FREETOKEN_CACHE)")
    phase_gpu.add_flags(p)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _check_args(args: argparse.Namespace) -> None:
    from freetoken_agent.evals.perf import phase_gpu

    unknown = [s for s in filter(None, args.skip.split(",")) if s not in SECTIONS]
    if unknown:
        raise BenchError(f"--skip: unknown section {unknown[0]!r}; sections: {', '.join(SECTIONS)}")
    if args.engine_tokens is None:
        args.engine_tokens = 12 if args.dry_run else 64
    if args.engine_prompt is None:
        args.engine_prompt = 16 if args.dry_run else 128
    if args.engine_tokens < 1 or args.engine_prompt < 8:
        raise BenchError("--engine-tokens must be at least 1 and --engine-prompt at least 8")
    unknown = [r for r in args.runs.split(",") if r not in RUNS]
    if unknown:
        raise BenchError(f"unknown residency run {unknown[0]!r}; expected some of {', '.join(RUNS)}")
    phase_gpu.check_flags(args)


def _passed(report: dict[str, Any]) -> bool:
    sections = [v for v in report.values() if isinstance(v, dict) and "status" in v]
    if any(s["status"] == "failed" for s in sections):
        return False
    tri, eng, res, plain = report["triton"], report["engine"], report["residency"], report["plain"]
    return ((tri["status"] != "ran" or tri["passed"]) and (eng["status"] != "ran" or eng["tokens_match"])
            and (plain["status"] != "ran" or plain["tokens_match"] is not False)
            and (res["status"] != "ran" or not res["over_budget"]))


def _headline(r: dict[str, Any]) -> dict[str, Any]:
    eng, bw, mem, pl = r["engine"], r["bandwidth"], r["memory"], r["planner"]
    out: dict[str, Any] = {"passed": r["passed"], "triton_passed": r["triton"].get("passed"),
                           "tokens_match": eng.get("tokens_match"),
                           "decode_tok_s": (eng.get("decode_tok_s") or {}).get("candidate"),
                           "plain_fp32_tok_s": (r["plain"].get("float32") or {}).get("decode_tok_s"),
                           "h2d_pinned_gbps": bw.get("h2d_pinned_gbps"),
                           "device_memory_gbps": bw.get("device_memory_gbps"),
                           "nvml_peak_used_bytes": mem.get("nvml_peak_used_bytes"),
                           "planner_decode_ratio": (pl.get("decode") or {}).get("ratio")}  # fmt: skip
    for x in r["residency"].get("rows", []):
        out[x["run"]] = x["decode_tok_s"]
    return out


@row("gpu-check", "GPU check: Triton kernels vs references, engine with the GPU expert cache vs the CPU engine "
     "(tokens, tok/s), PCIe and GPU memory bandwidth, NVML memory peak, planner prediction vs measured; one JSON "
     "report (--dry-run: CPU, tiny; --residency: residency policies on a Qwen3-30B-A3B shape)", options,
     headline=_headline, check=lambda r: r["passed"])
def gpu_check_row(args: argparse.Namespace) -> dict[str, Any]:
    from freetoken_agent.runtime.hardware import cached_profile
    from freetoken_agent.runtime.threads import configure_threads

    _check_args(args)
    t_start = time.perf_counter()
    cuda = not args.dry_run
    if cuda and not torch.cuda.is_available():
        raise BenchError("no CUDA device: run with --dry-run for the CPU check")
    configure_threads(None)  # torch threads = free cores (oversubscribed OpenMP stalls for a scheduler slice)
    skip = set(filter(None, args.skip.split(",")))
    memory = NvmlPeak() if cuda else None
    rates_source = "hardware profile" if cached_profile() is not None else "built-in"
    interpret_was = os.environ.get("TRITON_INTERPRET")
    if not cuda and "triton" not in sys.modules:  # triton reads it on import: the kernels run interpreted
        os.environ["TRITON_INTERPRET"] = "1"
    report: dict[str, Any] = {
        "mode": "cuda" if cuda else "dry-run", "passed": False, "wall_s": None, "budget_s": BUDGET_S,
        "within_budget": None,
        "device": {"name": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                   "cuda": torch.version.cuda, "triton": _triton_version()},
    }

    def section(name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        if name in skip:
            return {"status": "skipped", "reason": "--skip"}
        if memory is not None:
            memory.section = name
        return _guarded(name, fn)

    try:
        with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
            report["triton"] = section("triton", lambda: triton_section(cuda))
            engine = section("engine", lambda: engine_section(cuda, args, Path(tmp)))
            plain = section("plain", lambda: plain_section(cuda, args, engine))
            report["plain"] = {k: v for k, v in plain.items() if not k.startswith("_")}
            report["bandwidth"] = section("bandwidth", lambda: bandwidth_section(cuda))
            report["planner"] = planner_section(engine, report["bandwidth"], cuda, rates_source)
            report["engine"] = {k: v for k, v in engine.items() if not k.startswith("_")}
            profiles = {name: profile_rows(p) for name, p in (("engine", engine.get("_profile")),
                                                              ("plain", plain.get("_profile"))) if p is not None}
            report["profile"] = ({"status": "ran", **profiles} if args.profile else
                                 {"status": "skipped", "reason": "pass --profile to run it"})
            report["residency"] = (section("residency", lambda: residency_section(args)) if args.residency
                                   else {"status": "skipped", "reason": "pass --residency to run it"})
    finally:
        nvml = memory.stop() if memory is not None else None
        if interpret_was is None and not cuda:
            os.environ.pop("TRITON_INTERPRET", None)
    mem: dict[str, Any] = {"status": "ran", "host_peak_rss_bytes": _host_peak_rss()}
    if nvml is not None:
        mem.update(nvml, torch_peak_allocated_bytes=torch.cuda.max_memory_allocated(),
                   torch_peak_reserved_bytes=torch.cuda.max_memory_reserved(), skipped={})
    else:
        reason = "no CUDA device (--dry-run)"
        fields = ("nvml_total_bytes", "nvml_baseline_used_bytes", "nvml_peak_used_bytes", "nvml_peak_by_section",
                  "nvml_samples", "torch_peak_allocated_bytes", "torch_peak_reserved_bytes")
        mem.update({k: None for k in fields}, skipped={k: reason for k in fields})
    report["memory"] = mem
    report["passed"] = _passed(report)
    report["wall_s"] = round(time.perf_counter() - t_start, 1)
    report["within_budget"] = report["wall_s"] <= BUDGET_S
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return report


def main(argv: list[str] | None = None) -> int:
    """``python -m freetoken_agent.evals.perf.gpu_check``: the JSON report on stdout; status 1 when a check failed."""
    return module_main("gpu-check", argv)


if __name__ == "__main__":
    raise SystemExit(main())
