"""Capacity planner: from a model's ``config.json`` alone and the machine's rates, where everything goes and how fast.

``model_size(config, quant)`` counts bytes from the spec (no weights): dense weights, one routed expert at the
chosen quantization (Q4_0: 18 bytes per 32 weights, Q8_0: 34 per 32, none: the dense dtype), KV bytes per token
per layer (sliding-window layers stop growing at their window). ``plan(size, budgets, rates, context)`` places
dense weights and the KV of ``context`` tokens on the device when they fit (else host), fills the rest of each tier
with expert slots (device first), and streams the remaining experts from disk. The predicted decode time per token
is a sum of terms, each bytes moved ÷ a measured rate (or a measured fixed overhead):

- ``dense``: dense weights read once per token (embedding excluded: one row), at the dense GEMV rate of its tier;
- ``kv``: the cache of ``context`` positions read once, at the same rate;
- ``experts``: ``top_k`` experts per MoE layer; a fraction ``slots / experts`` of them hits each tier under the
  stated assumption of **uniform routing** (a lower bound: real routing is skewed and LRU/heat policies hit more);
  host-tier experts run at the CPU expert kernel's M=1 GB/s, disk ones also pay the disk read;
- ``overhead``: framework time per layer tensor, per step and per routed expert (fit by ``capacity_calibrate``).

Prefill per token: dense FLOPs (the output head once per chunk) ÷ measured GEMM GFLOP/s, expert bytes ÷ the M=16 kernel rate × 16, each cold expert
read from disk once per prompt, plus the per-tensor and per-touched-expert overheads of each forward chunk. The largest term is the bound.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from freetoken_agent.runtime.memory import format_bytes

QUANT_BYTES = {"q4": 18 / 32, "q8": 34 / 32}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class ModelSize:
    """Byte counts of a model at one quantization (from its config; no weights)."""

    params: int
    dense_bytes: int
    dense_read_bytes: int
    """Dense bytes a decode step reads (all dense weights but the embedding table, unless tied to the head)."""
    dense_params_read: int
    expert_bytes: int
    """One routed expert (gate, up, down) at the plan's quantization."""
    experts_total: int
    experts_per_layer: int
    moe_layers: int
    top_k: int
    layers: int
    kv_layers: list[tuple[int, int | None]]
    """Per attention layer: (KV bytes per position, sliding window or None)."""
    head_params: int = 0
    """The output head's weights (applied to the last prompt position only during prefill)."""
    layer_tensors: int = 0
    """Non-expert tensors inside the decoder layers (each is roughly one framework op per token step)."""

    def kv_bytes(self, context: int) -> int:
        return sum(b * min(context, w or context) for b, w in self.kv_layers)

    @property
    def active_expert_bytes(self) -> int:
        return self.top_k * self.moe_layers * self.expert_bytes


@dataclass
class Rates:
    """Measured throughputs (GB/s, GFLOP/s) and overheads (s) the prediction divides by."""

    dense_gbps: float
    gemm_gflops: float
    expert_gbps_m1: float
    expert_gbps_m16: float
    disk_gbps: float
    tensor_overhead_s: float = 0.0
    """Decode framework time per non-expert layer tensor (norms, projections: one op each per step)."""
    step_overhead_s: float = 0.0
    expert_call_s: float = 0.0
    """Fixed time per routed expert per decode token (kernel call, gather, scatter)."""
    prefill_tensor_overhead_s: float = 0.0
    prefill_expert_call_s: float = 0.0
    """Fixed time per distinct routed expert a prefill chunk touches (per MoE layer)."""
    device_gbps: float | None = None
    """Device memory bandwidth (assumed when no GPU was measured)."""
    decode_scale: float = 1.0
    """Measured ÷ predicted decode time of a mid-size calibration model: what the byte and overhead terms miss
    (small and medium matrices run slower per byte than the large ones the rates come from); multiplies every
    decode term."""
    prefill_scale: float = 1.0
    kernel_dense_gbps: float | None = None
    """The microbenchmark's rates, before the in-engine fit replaced ``dense_gbps`` / ``expert_gbps_m1``."""
    kernel_expert_gbps_m1: float | None = None
    source: str = "probe"


@dataclass
class TierPlan:
    """What one memory tier holds."""

    name: str
    limit: int | None
    dense: int = 0
    kv: int = 0
    expert_slots: int = 0
    expert_bytes: int = 0

    @property
    def used(self) -> int:
        return self.dense + self.kv + self.expert_bytes


@dataclass
class CapacityPlan:
    """The placement and the predicted speeds of one model on one machine."""

    model: str
    quant: str
    context: int
    fits: bool
    size: ModelSize
    tiers: list[TierPlan]
    disk_experts: int
    hit_rates: dict[str, float]
    decode_terms: dict[str, float]
    prefill_terms: dict[str, float]
    rates: Rates
    notes: list[str] = field(default_factory=list)

    @property
    def decode_tok_s(self) -> float:
        return 1.0 / max(sum(self.decode_terms.values()), 1e-12)

    @property
    def prefill_tok_s(self) -> float:
        return 1.0 / max(sum(self.prefill_terms.values()), 1e-12)

    @property
    def decode_bound(self) -> str:
        return max(self.decode_terms, key=self.decode_terms.__getitem__)

    @property
    def prefill_bound(self) -> str:
        return max(self.prefill_terms, key=self.prefill_terms.__getitem__)

    def to_json(self) -> dict[str, Any]:
        size = asdict(self.size)
        size["kv_bytes_context"] = self.size.kv_bytes(self.context)
        return {
            "model": self.model, "quant": self.quant, "context": self.context, "fits": self.fits, "size": size,
            "tiers": [{**asdict(t), "used": t.used} for t in self.tiers], "disk_experts": self.disk_experts,
            "hit_rates": self.hit_rates, "assumption": "uniform routing (lower bound on hit rates)",
            "decode": {"tok_s": round(self.decode_tok_s, 3), "bound": self.decode_bound,
                       "terms_s": {k: v for k, v in self.decode_terms.items()}},
            "prefill": {"tok_s": round(self.prefill_tok_s, 3), "bound": self.prefill_bound,
                        "terms_s": {k: v for k, v in self.prefill_terms.items()}},
            "rates": asdict(self.rates), "notes": self.notes,
        }  # fmt: skip


def model_size(config: dict[str, Any], quant: str = "q4", dtype: str = "float32") -> ModelSize:
    """Byte counts of the model ``config`` describes (routed experts at ``quant``, the rest in ``dtype``)."""
    from freetoken_agent.runtime.model.adapters import spec_from_config
    from freetoken_agent.runtime.model.weights import expected_tensors

    spec = spec_from_config(config)
    elsize = DTYPE_BYTES[dtype]
    shapes = expected_tensors(spec)
    total = expert_params = layer_tensors = 0
    for name, shape in shapes.items():
        n = math.prod(shape)
        total += n
        if ".experts." in name:
            expert_params += n
        elif ".layers." in name:
            layer_tensors += 1
    moe = [layer.moe for layer in spec.layers if layer.moe is not None]
    experts_total = sum(m.num_experts for m in moe)
    per_expert = expert_params // max(experts_total, 1)
    expert_bytes = int(per_expert * QUANT_BYTES.get(quant, elsize))
    embed = spec.vocab_size * spec.hidden_size
    dense_params = total - expert_params
    read_params = dense_params - (0 if spec.tie_embeddings else embed)
    kv_layers = []
    for layer in spec.layers:
        if layer.recurrent is not None:
            continue
        a = layer.attention
        per = (a.kv_lora_rank + a.qk_rope_dim) if a.kind == "mla" else a.num_kv_heads * (a.head_dim + a.v_head_dim)
        kv_layers.append((per * elsize, a.sliding_window))
    return ModelSize(
        params=total, dense_bytes=dense_params * elsize, dense_read_bytes=read_params * elsize,
        dense_params_read=read_params, head_params=embed, expert_bytes=expert_bytes, experts_total=experts_total,
        experts_per_layer=moe[0].num_experts if moe else 0, moe_layers=len(moe), top_k=moe[0].top_k if moe else 0,
        layers=len(spec.layers), kv_layers=kv_layers, layer_tensors=layer_tensors,
    )  # fmt: skip


def plan(size: ModelSize, rates: Rates, device: int | None, host: int | None, context: int,
         model: str = "model", quant: str = "q4", prefill_chunk: int = 512) -> CapacityPlan:
    """Place ``size`` on the tiers (``device``/``host`` byte limits; None = no such tier / unlimited host)."""
    notes: list[str] = []
    kv = size.kv_bytes(context)
    dev = TierPlan("device", device) if device else None
    hst = TierPlan("host", host)
    fits = True
    home = dev if dev is not None and size.dense_bytes + kv <= dev.limit else hst  # type: ignore[operator]
    home.dense, home.kv = size.dense_bytes, kv
    if hst.limit is not None and hst.used > hst.limit:
        fits = False
        notes.append(f"does not fit: dense weights + KV ({format_bytes(hst.used)}) exceed the host budget "
                     f"({format_bytes(hst.limit)}); lower --context or add memory")
    left = size.experts_total
    for tier in ([dev] if dev else []) + [hst]:
        free = None if tier.limit is None else max(tier.limit - tier.used, 0)
        slots = left if free is None else min(left, free // max(size.expert_bytes, 1))
        tier.expert_slots, tier.expert_bytes = slots, slots * size.expert_bytes
        left -= slots
    disk = left
    n = max(size.experts_total, 1)
    hits = {"device": (dev.expert_slots / n) if dev else 0.0, "host": hst.expert_slots / n, "disk": disk / n}
    dense_rate = (rates.device_gbps or 500.0) if home is dev else rates.dense_gbps
    if dev is not None and rates.device_gbps is None:
        notes.append("device bandwidth not measured: assumed 500 GB/s")
    active = size.active_expert_bytes
    decode = {
        "dense": size.dense_read_bytes / (dense_rate * 1e9),
        "kv": kv / (dense_rate * 1e9),
        "experts_device": active * hits["device"] / ((rates.device_gbps or 500.0) * 1e9),
        "experts_host": active * hits["host"] / (rates.expert_gbps_m1 * 1e9),
        "experts_disk": active * hits["disk"] * (1 / (rates.disk_gbps * 1e9) + 1 / (rates.expert_gbps_m1 * 1e9)),
        "overhead": size.layer_tensors * rates.tensor_overhead_s + rates.step_overhead_s
        + size.top_k * size.moe_layers * rates.expert_call_s,
    }
    chunk = max(1, min(context, prefill_chunk))
    cold_bytes = size.experts_total * hits["disk"] * size.expert_bytes
    prefill = {
        "dense": 2 * (size.dense_params_read - size.head_params + size.head_params / chunk) / (rates.gemm_gflops * 1e9),
        "experts_host": active * (1 - hits["device"]) / (rates.expert_gbps_m16 * 16 * 1e9),
        "experts_device": active * hits["device"] / ((rates.device_gbps or 500.0) * 1e9) / 16,
        "experts_disk": cold_bytes / (rates.disk_gbps * 1e9) / chunk,
        "overhead": (size.layer_tensors * rates.prefill_tensor_overhead_s + size.moe_layers * rates.prefill_expert_call_s
                     * min(size.experts_per_layer, chunk * size.top_k)) / chunk,
    }
    if disk:
        notes.append(f"{disk} of {size.experts_total} experts stream from disk ({format_bytes(disk * size.expert_bytes)})")
    decode = {k: v * rates.decode_scale for k, v in decode.items() if v > 0}
    prefill = {k: v * rates.prefill_scale for k, v in prefill.items() if v > 0}
    tiers = ([dev] if dev else []) + [hst]
    return CapacityPlan(model, quant, context, fits, size, tiers, disk, hits, decode, prefill, rates, notes)


def format_plan(p: CapacityPlan) -> str:
    """The human-readable plan."""
    s = p.size
    lines = [
        (f"model {p.model}: {s.params / 1e9:.2f}B params, {s.moe_layers} MoE layers x {s.experts_per_layer} experts "
         f"(top-{s.top_k}), experts at {p.quant}"),
        (f"  dense weights {format_bytes(s.dense_bytes)}; one expert {format_bytes(s.expert_bytes)}, all experts "
         f"{format_bytes(s.expert_bytes * s.experts_total)}; KV {format_bytes(s.kv_bytes(p.context))} "
         f"for {p.context} tokens"),
        "placement:" if p.fits else "placement (DOES NOT FIT):",
    ]
    for t in p.tiers:
        lines.append(f"  {t.name:<6} limit {format_bytes(t.limit)}: dense {format_bytes(t.dense)}, KV "
                     f"{format_bytes(t.kv)}, {t.expert_slots} expert slots ({format_bytes(t.expert_bytes)})")
    lines.append(f"  disk   {p.disk_experts} experts streamed")
    h = p.hit_rates
    lines.append(f"expert hits (uniform routing, lower bound): device {h['device']:.0%}, host {h['host']:.0%}, "
                 f"disk {h['disk']:.0%}")
    lines.append(f"predicted decode  {p.decode_tok_s:8.2f} tok/s  (bound: {p.decode_bound})")
    lines.append(f"predicted prefill {p.prefill_tok_s:8.2f} tok/s  (bound: {p.prefill_bound})")
    lines.append(f"rates ({p.rates.source}): dense {p.rates.dense_gbps:.1f} GB/s, GEMM {p.rates.gemm_gflops:.0f} "
                 f"GFLOP/s, expert kernel {p.rates.expert_gbps_m1:.1f} GB/s (M=1), disk {p.rates.disk_gbps:.2f} GB/s")
    lines.extend(f"note: {n}" for n in p.notes)
    return "\n".join(lines)
