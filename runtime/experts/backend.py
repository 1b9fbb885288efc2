"""``ManagedExperts``: the ``ExpertsBackend`` of one MoE layer whose experts live in the ``ExpertStore``'s tiers.

Legend: T tokens, K experts per token, E experts, D hidden, S slots.

A step: count tokens per expert → tell the policy (heat) → settle last step's prefetch guesses → start the
gate look-ahead prefetch for the next MoE layer → plan each expert's path → compute.

Exactness: outputs are bitwise those of the unbudgeted engine, whatever tier each expert came from and whatever
slot it landed in. Float experts are computed one by one in expert-id order with the same ops as ``TorchExperts``
and accumulated in the same order. Quantized experts on the host reproduce ``QuantizedExperts.forward``'s order:
the fused C call sums a token's experts in the order of the ids it gets, so it runs over the slot pool only when
the slots ascend with the expert ids, else as one call per expert accumulated in id order (same fp32 adds).
With a device tier, quantized experts run one per call (tokens identical in the tests; not bitwise guaranteed),
or, on a CUDA tier holding Q4_0 / Q8_0 slots (``device_kernel`` "triton"), all of a step's device experts in two
Triton launches that read the slots' own bytes (``kernels.triton.slots_matmul``; fp32 sums, another order).

Deterministic mode (``ops.set_deterministic``): float experts multiply through ``moe.expert_linear`` (as
``TorchExperts`` does) and quantized host experts always take the int8 kernels (``QuantizedExperts``'
``dequant_threshold`` is unbounded then), so a token's output does not depend on the others routed with it.
"""

from __future__ import annotations

import importlib.util
import os
import time
import warnings
from collections.abc import Callable
from itertools import pairwise
from typing import TYPE_CHECKING

import torch
from freetoken_agent.runtime.errors import FreeTokenError
from freetoken_agent.runtime.execution.planner import ExecutionPlanner, ExpertNeed
from freetoken_agent.runtime.experts.capabilities import Capabilities
from freetoken_agent.runtime.experts.layout import SlotViews
from freetoken_agent.runtime.experts.store import ExpertStore
from freetoken_agent.runtime.kernels import ops as kops
from freetoken_agent.runtime.kernels.triton import SLOT_FORMATS, SlotWeights, slots_matmul
from freetoken_agent.runtime.model.moe import activate, expert_linear, silu_kernel_ok
from freetoken_agent.runtime.model.spec import MoESpec

if TYPE_CHECKING:
    from freetoken_agent.runtime.kernels.experts import QuantizedExperts

Lookahead = Callable[[torch.Tensor], list[int]]
"""Predicts the next MoE layer's experts from this layer's input ``x [T, D]``."""


class DeviceTiming:
    """A step's device part timed without a sync: the host's wall time of issuing it, and on CUDA an event pair, read
    once the device has passed the second event (a later step); its seconds are the larger of the two."""

    def __init__(self, device: torch.device, experts: int, tokens: int) -> None:
        self.experts, self.tokens = experts, tokens
        self.events = None
        if device.type == "cuda":
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self.events[0].record()
        self.wall = 0.0
        self.t0 = time.perf_counter()

    def stop(self) -> None:
        self.wall = time.perf_counter() - self.t0
        if self.events is not None:
            self.events[1].record()

    def seconds(self) -> float | None:
        """None while the device has not reached the end of the timed part."""
        if self.events is None:
            return self.wall
        if not self.events[1].query():
            return None
        return max(self.wall, self.events[0].elapsed_time(self.events[1]) / 1e3)


class ManagedExperts:
    """Routed experts of MoE layer ``layer``, served from the store's tiers under the planner's choices."""

    def __init__(
        self, layer: int, spec: MoESpec, store: ExpertStore, planner: ExecutionPlanner,
        next_layer: int | None = None, lookahead: Lookahead | None = None,
        act: dict[str, torch.Tensor] | None = None,
    ) -> None:  # fmt: skip
        """``act``: the experts' learned activation parameters (``TorchExperts.act``), if any."""
        self.layer, self.spec, self.store, self.planner = layer, spec, store, planner
        self.act = act or {}
        self.next_layer, self.lookahead = next_layer, lookahead
        self.layout = store.layout_of(layer)
        """This layer's blob layout (a GGUF file's layers may differ: slots are the size of the widest)."""
        self.exact = True
        """False: quantized decode always runs as one fused call over the pool (fp32 sums may reorder: ~1e-7)."""
        self._views: dict[str, tuple[int, SlotViews, QuantizedExperts | None]] = {}
        self._device_timings: list[DeviceTiming] = []
        """Timed device parts of earlier steps, read into the cost model once the device has passed them."""
        self._slots_proven = False
        """Whether the Triton slot kernels have run a step here (after that their errors are not caught)."""
        self.device_kernel = self._pick_device_kernel()
        """How device slots compute: "triton" (a step's device experts at once, from the slots' bytes) or "torch"
        (one expert at a time; a quantized slot dequantized by torch ops first)."""
        for pool in (store.host, store.device):
            if pool is not None:  # a reallocated pool: drop the views, or they keep the old tensor alive
                pool.on_reallocate.append(self._views.clear)

    def _pick_device_kernel(self) -> str:
        """"triton" for Q4_0 / Q8_0 slots on a CUDA tier with triton installed, else "torch".

        ``FREETOKEN_DEVICE_EXPERTS`` = ``torch`` / ``triton`` forces it (``triton`` applies to any device tier whose
        formats the slot kernels read, a simulated one included: the tests run it under ``TRITON_INTERPRET=1``).
        """
        choice = os.environ.get("FREETOKEN_DEVICE_EXPERTS", "auto").lower()
        if choice not in ("auto", "torch", "triton"):
            raise FreeTokenError(f"FREETOKEN_DEVICE_EXPERTS must be auto, torch or triton, got {choice!r}")
        lay, dev = self.layout, self.store.device
        readable = lay.quantized and all(f in SLOT_FORMATS for f in lay.formats)
        if dev is None or not readable or choice == "torch":
            return "torch"
        has_triton = importlib.util.find_spec("triton") is not None
        if choice == "triton":
            if not has_triton:
                raise FreeTokenError("FREETOKEN_DEVICE_EXPERTS=triton needs triton (pip install triton)")
            return "triton"
        return "triton" if dev.device.type == "cuda" and has_triton else "torch"

    @property
    def capabilities(self) -> Capabilities:
        """Managed placement in the layout's format; C kernels for quantized host slots where they load; one fused
        call per decode step only when it may reorder fp32 sums (``exact`` off) and every slot is on the host."""
        lay = self.layout
        plain = self.spec.activation == "silu" and not self.spec.glu_clamp and not lay.bias
        fused = lay.quantized and lay.packed and plain and not self.exact and self.store.device is None
        return Capabilities("managed", tuple(dict.fromkeys(lay.formats)), kernels=lay.quantized and lay.packed,
                            modes=False, dequantize=False, fused=fused, can_prefetch=self.lookahead is not None)

    # ---------------------------------------------------------------- views over the pools

    def _pool_views(self, tier: str) -> tuple[SlotViews, QuantizedExperts | None]:
        """Typed views of a tier's pool (and a ``QuantizedExperts`` over it for quantized layouts), cached."""
        pool = self.store.host if tier == "host" else self.store.device
        assert pool is not None
        cached = self._views.get(tier)
        if cached is not None and cached[0] == pool.generation:
            return cached[1], cached[2]
        views = self.layout.views(pool.data)
        qe = None
        if self.layout.quantized and pool.device.type == "cpu":
            from freetoken_agent.runtime.experts.quantized import quantized_experts

            assert views.w13 is not None and views.w2 is not None
            lay = self.layout
            qe = quantized_experts(lay.fmt, views.w13, views.w2, lay.hidden, self.spec, self.act, lay.packed,
                                   (views.gate_up_bias, views.down_bias), "managed", lay.down_fmt)
        self._views[tier] = (pool.generation, views, qe)
        return views, qe

    def _float_expert(self, views: SlotViews, slot: int, x: torch.Tensor) -> torch.Tensor:
        """One float expert on its tokens, exactly as ``TorchExperts`` computes it: ``x [n, D] → [n, D]``."""
        assert views.gate_up is not None and views.down is not None
        gate_up, down = views.gate_up[slot], views.down[slot]
        biased = views.gate_up_bias is not None or views.down_bias is not None
        if silu_kernel_ok(self.spec, x, gate_up, down, biased, self.act):  # TorchExperts' kernel path
            return kops.expert_f32(gate_up, down, x)
        h = expert_linear(x, views.gate_up[slot])  # [n, 2I]
        if views.gate_up_bias is not None:
            h = h + views.gate_up_bias[slot]
        h = expert_linear(activate(h, self.spec, self.act), views.down[slot])  # [n, D]
        if views.down_bias is not None:
            h = h + views.down_bias[slot]
        return h

    def _quant_expert(self, tier: str, slot: int, x: torch.Tensor) -> torch.Tensor:
        """One quantized expert on its tokens (fp32 in/out) from slot ``slot`` of ``tier``."""
        views, qe = self._pool_views(tier)
        if qe is not None:
            big = x.shape[0] >= qe.dequant_threshold or not qe.packed
            return qe.expert_dense(slot, x) if big else qe.expert_kernel(slot, x)
        # a GPU slot: dequantize with torch ops where the bytes are, then a plain matmul (no C kernels there)
        gate_up, down = self._dequantize(views, slot)
        return self._float_expert(SlotViews(gate_up=gate_up[None], down=down[None],
                                            gate_up_bias=None if views.gate_up_bias is None else views.gate_up_bias[slot][None],
                                            down_bias=None if views.down_bias is None else views.down_bias[slot][None]),
                                  0, x.to(gate_up.dtype))

    def _dequantize(self, views: SlotViews, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``(gate_up [2I, D], down [D, I])`` of a quantized slot, with torch ops on the slot's device."""
        from freetoken_agent.runtime.quant.formats import block_format

        lay = self.layout
        f13, f2 = (block_format(f) for f in lay.formats)
        assert views.w13 is not None and views.w2 is not None
        gate_up = f13.dequantize(views.w13[slot], lay.rows13, lay.hidden, lay.packed)
        return gate_up, f2.dequantize(views.w2[slot], lay.hidden, lay.intermediate, lay.packed)

    # ---------------------------------------------------------------- the step

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, D], topk_ids [T, K], topk_weights [T, K] → Σ_k w_k · expert_k(x) as [T, D]."""
        store, layer = self.store, self.layer
        counts_t = torch.bincount(topk_ids.reshape(-1), minlength=self.spec.num_experts)  # [E]
        hit = counts_t.nonzero().flatten().tolist()
        per_expert = counts_t.tolist()  # one device sync, not one per expert
        counts = {e: per_expert[e] for e in hit}
        store.host.policy.observe(layer, counts)
        if store.device is not None:
            store.device.policy.observe(layer, counts)
        store.prefetch.settle(layer, set(hit))
        if store.device is None:  # one tier of compute: every expert runs on the host, nothing to plan
            store.planner_counts["host"] += len(hit)
            self.planner.decisions["host"] += len(hit)
            if self.layout.quantized:
                return self._quant_host_step(x, topk_ids, topk_weights, hit)
            paths = dict.fromkeys(hit, "host")
        else:
            needs = [ExpertNeed(e, counts[e], store.device.is_ready((layer, e)), store.host.is_ready((layer, e)))
                     for e in hit]
            paths = self.planner.plan(needs, store.device.capacity_for_step()).paths
            for path in paths.values():
                store.planner_counts[path] += 1
        out = self._per_expert_step(x, topk_ids, topk_weights, counts_t, paths)
        self._prefetch_next(x)
        return out

    def _prefetch_next(self, x: torch.Tensor) -> None:
        """Gate look-ahead: guess the next MoE layer's experts from this layer's input and start reading them.

        Called once this step's experts are held (quantized host path: the reads overlap this step's kernels) or
        computed (per-expert path: they overlap the next layer's attention), so the reads cannot evict them.
        Decode only (T ≤ 4): in prefill nearly every expert is routed anyway.
        """
        if self.lookahead is not None and self.next_layer is not None and x.shape[0] <= 4:
            self.store.prefetch_host(self.next_layer, self.lookahead(x))

    def _per_expert_step(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, counts_t: torch.Tensor,
        paths: dict[int, str],
    ) -> torch.Tensor:  # fmt: skip
        """Experts one at a time, each from the tier its path names; accumulated in id order (``TorchExperts``'s).

        Host experts run on a worker thread while the device experts run here (the two overlap); host misses are
        read one expert ahead (double buffering), never evicting an expert this step still needs.
        """
        xin = x.float() if self.layout.quantized else x
        flat_ids = topk_ids.reshape(-1)  # [T*K]
        order = torch.argsort(flat_ids, stable=True)
        token_of = order // topk_ids.shape[1]
        weight_of = topk_weights.reshape(-1)[order]
        spans: dict[int, tuple[int, int]] = {}
        start = 0
        for e, n in enumerate(counts_t.tolist()):
            if n:
                spans[e] = (start, n)
                start += n
        host = [e for e in spans if paths[e] == "host"]
        device = [e for e in spans if paths[e] != "host"]
        parts: dict[int, torch.Tensor] = {}

        # host experts read x from host memory: move it (and the token index) once per step, not once per expert
        on_host = xin.device.type == "cpu"
        x_host = xin if on_host or not host else xin.cpu()
        tok_host = token_of if on_host or not host else token_of.cpu()

        def run(experts: list[int], tier: str) -> None:
            keys = [(self.layer, e) for e in experts]
            src, tok = (x_host, tok_host) if tier == "host" else (xin, token_of)
            for j, e in enumerate(experts):
                a, n = spans[e]
                if tier == "host" and j + 1 < len(experts) and not self.store.host.is_ready(keys[j + 1]):
                    self.store.read_ahead(keys[j + 1], keys[j:])
                if tier == "device" and j + 1 < len(experts) and paths[experts[j + 1]] == "fetch":
                    self.store.fetch_async(keys[j + 1], keys[j:])  # copy the next one while this computes (CUDA)
                h = self._one(tier, keys[j], src[tok[a : a + n]], keys[j:])
                parts[e] = h.to(xin.device) * weight_of[a : a + n, None]

        worker = None
        if host and device:
            worker = self.store.compute_pool.submit(run, host, "host")
        elif host:
            run(host, "host")
        self._observe_device()
        timing = None
        dev = self.store.device
        # a real accelerator's all-resident steps (no copy in the time: compute alone); the simulated tier computes on
        # the CPU and keeps its scripted rates, so its decisions do not depend on the machine's timing
        if device and dev is not None and dev.device.type != "cpu" and all(paths[e] == "resident" for e in device):
            timing = DeviceTiming(dev.device, len(device), sum(spans[e][1] for e in device))
        if self.device_kernel == "triton":
            try:
                self._slots_step(device, spans, paths, xin, token_of, weight_of, parts)
                self._slots_proven = True
            except Exception as exc:  # the first launch compiles: a GPU / triton pairing never tried falls back
                if self._slots_proven or isinstance(exc, FreeTokenError):
                    raise
                warnings.warn(f"the Triton slot kernels failed on {xin.device} ({type(exc).__name__}: {exc}); "
                              "device experts run one by one through torch ops instead", stacklevel=2)
                self.device_kernel = "torch"
                run(device, "device")
        else:
            run(device, "device")
        if timing is not None:
            timing.stop()
            self._device_timings.append(timing)
        if worker is not None:
            worker.result()
        out = torch.zeros_like(xin)
        for e, (a, n) in spans.items():
            out.index_add_(0, token_of[a : a + n], parts[e].to(out.dtype))
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def _slots_step(
        self, experts: list[int], spans: dict[int, tuple[int, int]], paths: dict[int, str], x: torch.Tensor,
        token_of: torch.Tensor, weight_of: torch.Tensor, parts: dict[int, torch.Tensor],
    ) -> None:  # fmt: skip
        """The step's device experts together: acquire their slots (the next miss copied while this one settles),
        then one ``_slots_compute``; where the pool cannot hold them all at once, in runs of what it holds."""
        store = self.store
        keys = [(self.layer, e) for e in experts]
        j = 0
        while j < len(experts):
            held: list[tuple[int, int]] = []  # (expert, slot)
            try:
                while j < len(experts):
                    if j + 1 < len(experts) and paths[experts[j + 1]] == "fetch":
                        store.fetch_async(keys[j + 1], keys[j:])
                    try:
                        slot = store.acquire_device(keys[j])
                    except FreeTokenError:
                        if not held:  # not even one fits: the pool's own error
                            raise
                        break  # compute what is held, release it, go on
                    held.append((experts[j], slot))
                    j += 1
                self._slots_compute(held, spans, x, token_of, weight_of, parts)
            finally:
                for _, slot in held:
                    store.release_device(slot)

    def _slots_compute(
        self, held: list[tuple[int, int]], spans: dict[int, tuple[int, int]], x: torch.Tensor,
        token_of: torch.Tensor, weight_of: torch.Tensor, parts: dict[int, torch.Tensor],
    ) -> None:  # fmt: skip
        """``parts[e]`` for held device experts: gate/up for all their (token, expert) pairs in one Triton launch,
        the activation, then down in another, read from the slots as the pool stores them."""
        views, _ = self._pool_views("device")
        lay = self.layout
        assert views.w13 is not None and views.w2 is not None
        f13, f2 = lay.formats
        dev = x.device
        idx = torch.cat([torch.arange(spans[e][0], spans[e][0] + spans[e][1]) for e, _ in held])  # [P] sorted pairs
        pair_slot = torch.cat([torch.full((spans[e][1],), s, dtype=torch.int64) for e, s in held])
        if dev.type == "cuda":
            idx = idx.pin_memory().to(dev, non_blocking=True)
            pair_slot = pair_slot.pin_memory().to(dev, non_blocking=True)
        else:
            idx, pair_slot = idx.to(dev), pair_slot.to(dev)
        h = slots_matmul(x, SlotWeights(views.w13, lay.rows13, lay.hidden, f13, lay.packed),
                         token_of[idx], pair_slot)  # [P, 2I]
        if views.gate_up_bias is not None:
            h = h + views.gate_up_bias[pair_slot]
        a = activate(h, self.spec, self.act).contiguous()  # [P, I]
        y = slots_matmul(a, SlotWeights(views.w2, lay.hidden, lay.intermediate, f2, lay.packed),
                         torch.arange(a.shape[0], device=dev), pair_slot)  # [P, D]
        if views.down_bias is not None:
            y = y + views.down_bias[pair_slot]
        y = y * weight_of[idx, None]
        start = 0
        for e, _ in held:
            n = spans[e][1]
            parts[e] = y[start : start + n]
            start += n

    def _observe_device(self) -> None:
        """Hand the cost model every timed device part the device has finished (never waits for it)."""
        while self._device_timings:
            t = self._device_timings[0]
            seconds = t.seconds()
            if seconds is None:
                if len(self._device_timings) > 8:  # a device that never reports: stop keeping them
                    self._device_timings.pop(0)
                return
            self._device_timings.pop(0)
            self.planner.cost.observe_device(t.experts, t.tokens, seconds)

    def _one(self, tier: str, key: tuple[int, int], x: torch.Tensor, protect: list[tuple[int, int]]) -> torch.Tensor:
        """One expert on its tokens ``x [n, D]`` from ``tier`` (acquired for the call) → ``[n, D]`` on the tier's device."""
        store = self.store
        slot = store.acquire_host(key, protect) if tier == "host" else store.acquire_device(key)
        pool = store.host if tier == "host" else store.device
        assert pool is not None
        t0 = time.perf_counter()  # compute only: the read that may precede it is the disk's, timed by the store
        try:
            xe = x if x.device == pool.device else x.to(pool.device)
            if self.layout.quantized:
                h = self._quant_expert(tier, slot, xe)
            else:
                h = self._float_expert(self._pool_views(tier)[0], slot, xe)
        finally:
            store.release_host(slot) if tier == "host" else store.release_device(slot)
        if tier == "host":
            self.planner.cost.observe_host(self.layout.blob_bytes, x.shape[0], time.perf_counter() - t0)
        return h

    def _quant_host_step(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, hit: list[int]
    ) -> torch.Tensor:
        """All experts in host slots at once, then one ``QuantizedExperts`` call over the pool with slot ids."""
        if x.device.type != "cpu":  # dense layers on a GPU, experts all on the CPU: move activations, not weights
            out = self._quant_host_step(x.cpu(), topk_ids.cpu(), topk_weights.cpu(), hit)
            return out.to(x.device)
        store, layer = self.store, self.layer
        room = store.host.capacity_for_step()
        if len(hit) > room:  # the pool cannot hold the whole step: experts one by one, acquired as they run
            out = self._quant_pool_forward(x.float(), topk_ids, topk_weights.float(), None)
            return out if out.dtype == x.dtype else out.to(x.dtype)
        slot_of = torch.zeros(self.spec.num_experts, dtype=torch.long)
        slots = []
        keys = [(layer, e) for e in hit]
        missing = [k for k in keys if store.host.slot_of(k) is None]
        for k in missing[1:]:  # read the other misses in the background while this thread reads the first
            store.read_ahead(k, keys)
        try:
            for e in hit:
                s = store.acquire_host((layer, e), keys)
                slots.append(s)
                slot_of[e] = s
            self._prefetch_next(x)  # overlaps the reads with this step's compute
            out = self._quant_pool_forward(x.float(), topk_ids, topk_weights.float(), slot_of)
        finally:
            for s in slots:
                store.release_host(s)
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def _quant_pool_forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, slot_of: torch.Tensor | None
    ) -> torch.Tensor:
        """``QuantizedExperts.forward`` over the host pool, with its exact fp32 accumulation order.

        The fused C call sums a token's experts in the order of the ids it is given; slots are not in expert
        order, so the light experts run as one fused call only when their slots happen to ascend with their ids,
        else one call per expert (in id order) accumulated here — bitwise what the unbudgeted engine computes.
        ``slot_of`` (expert → host slot, all acquired) is None when the step does not fit the pool: then each
        expert is acquired just for its own call (the next one read ahead meanwhile).
        """
        _, qe = self._pool_views("host")
        assert qe is not None
        fmt, down_fmt, w13, w2, dims = qe.fmt, qe.down_fmt, qe.w13, qe.w2, (qe.hidden, qe.intermediate)
        counts = torch.bincount(topk_ids.reshape(-1), minlength=self.spec.num_experts)  # [E]
        threshold = qe.dequant_threshold if qe.packed else 1
        hit = counts.nonzero().flatten().tolist()
        decode = qe.fused and topk_ids.numel() < threshold
        dense = [] if decode else [e for e in hit if counts[e] >= threshold]
        dense_set = set(dense)
        light = [e for e in hit if e not in dense_set]
        out = torch.zeros_like(x)
        order = [*light, *dense] if qe.fused else [*dense, *light]
        keys = [(self.layer, e) for e in order]
        position = {e: j for j, e in enumerate(order)}
        held: dict[int, int] = {}

        def slot(e: int) -> int:
            if slot_of is not None:
                return int(slot_of[e])
            j = position[e]
            if j + 1 < len(order) and not self.store.host.is_ready(keys[j + 1]):
                self.store.read_ahead(keys[j + 1], keys[j:])
            held[e] = self.store.acquire_host(keys[j], keys[j:])
            return held[e]

        def done(e: int) -> None:
            if e in held:
                self.store.release_host(held.pop(e))

        if qe.fused:
            from freetoken_agent.runtime.kernels import ops

            light_slots = slot_of[light].tolist() if slot_of is not None else []
            ascending = all(a < b for a, b in pairwise(light_slots))
            if light_slots and (ascending or not self.exact):
                ids = slot_of[topk_ids]
                if dense:
                    is_dense = torch.zeros(self.spec.num_experts, dtype=torch.bool)
                    is_dense[dense] = True
                    ids = torch.where(is_dense[topk_ids], torch.full_like(ids, -1), ids)
                out = ops.moe(fmt, w13, w2, dims, x, ids, topk_weights, down_fmt)
            else:
                for e in light:
                    ids = torch.where(topk_ids == e, torch.full_like(topk_ids, slot(e)), torch.full_like(topk_ids, -1))
                    try:
                        out += ops.moe(fmt, w13, w2, dims, x, ids, topk_weights, down_fmt)
                    finally:
                        done(e)
            light = []
        for e in dense + light:
            tok, k = (topk_ids == e).nonzero(as_tuple=True)
            s = slot(e)
            try:
                y = qe.expert_dense(s, x[tok]) if e in dense_set else qe.expert_kernel(s, x[tok])
            finally:
                done(e)
            out.index_add_(0, tok, y * topk_weights[tok, k, None].to(torch.float32))
        return out
