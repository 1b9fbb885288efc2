"""Load a model under a memory budget: dense weights first, then the expert tiers in what is left.

``load_managed`` reads the dense weights (attention, embeddings, norms, routers, shared experts) and claims their
bytes from the budget, writes/opens the expert-major cache file (two experts in memory at a time), sizes the host
slot pool (and the device pool, real or simulated) from the remaining budget, and returns a ``Managed`` whose
``backends()`` are one ``ManagedExperts`` per MoE layer (the expert core, ``core.py``, installs them: its
``managed`` placement). The routed experts are never loaded as a whole.

A safetensors folder's experts are quantized into the cache file (``quant``) or stored in the compute dtype; a GGUF
file's experts that its unbudgeted load runs as blocks go in as those blocks (``gguf_blobs.py``: native block types
byte for byte, other types converted as that load converts them, each layer in its own formats), so a budgeted GGUF
load computes what the unbudgeted one does.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from freetoken_agent.runtime.checkpoint.reader import CheckpointReader
from freetoken_agent.runtime.errors import FreeTokenError
from freetoken_agent.runtime.execution.cost import CostModel, Rates
from freetoken_agent.runtime.execution.planner import ExecutionPlanner
from freetoken_agent.runtime.experts.backend import ManagedExperts
from freetoken_agent.runtime.experts.cache_file import (
    ExpertCacheFile,
    cache_key,
    cache_root,
    open_or_write,
)
from freetoken_agent.runtime.experts.gguf_blobs import GGUFExpertReader, gguf_layouts
from freetoken_agent.runtime.experts.layout import ExpertLayout
from freetoken_agent.runtime.experts.loader import DenseLoader, Packed, tensor_bytes
from freetoken_agent.runtime.model.weights import check_unused
from freetoken_agent.runtime.model.workspace import step_bytes
from freetoken_agent.runtime.experts.mapped import encoder
from freetoken_agent.runtime.experts.policies import Key, make_policy
from freetoken_agent.runtime.experts.pool import SlotPool
from freetoken_agent.runtime.experts.store import ExpertStore
from freetoken_agent.runtime.kernels import build, ops
from freetoken_agent.runtime.kernels.dense import DenseQuantReport, quantize_dense
from freetoken_agent.runtime.memory import (
    PROCESS_FLOOR_MB,
    Budget,
    BudgetTooSmallError,
    MemoryBudget,
    bound_heap,
    format_bytes,
)
from freetoken_agent.runtime.model import weights as weights_mod
from freetoken_agent.runtime.model.moe import route
from freetoken_agent.runtime.model.spec import ModelSpec
from freetoken_agent.runtime.quant.formats import KERNEL_FORMATS, check_quant


@dataclass
class ResidencyConfig:
    """How experts are kept: policy, prefetch, pins, tiers. Defaults suit a CPU-only machine."""

    policy: str = "lru"
    """``lru``, ``heat`` or ``phase`` (see ``runtime/experts/policies.py``)."""
    prefetch: bool = True
    """Gate look-ahead: read the next MoE layer's predicted experts while this one computes (decode)."""
    pin: tuple[Key, ...] = ()
    """(layer, expert) pairs kept in host slots for good."""
    kv_reserve: int = 0
    """Host bytes set aside for the KV pool before the expert pool is sized (movable later)."""
    simulate_device: bool = False
    """A device tier made of CPU memory under ``budget.device`` (tests and planner studies on CPU machines)."""
    drop_page_cache: bool = False
    """Drop the cache file's pages after each read, so disk reads are real and the page cache holds nothing."""
    cache_path: Path | None = None
    """Expert cache file (default: ``$FREETOKEN_CACHE/experts/<key>.ftx``)."""
    rates: Rates | None = None
    """Cost-model rates (default: the cached hardware profile, else built-in guesses)."""
    planner: str = "adaptive"
    """``adaptive`` (cost model), ``fetch`` (always copy cold experts to the device) or ``host`` (always CPU)."""
    pools: str = "global"
    """``global``: one slot pool shared by all layers; ``layer``: an equal share of slots per MoE layer."""
    exact: bool = True
    """Bitwise the unbudgeted engine's outputs. False lets quantized decode make one fused call over the slot pool
    even when slot order differs from expert order (faster; fp32 sums reordered, ~1e-7 relative)."""
    device_tier: bool = True
    """With a GPU engine: keep a device slot pool (False = every routed expert on the CPU, ``--n-cpu-moe`` style)."""


@dataclass
class Managed:
    """What ``load_managed`` returns: dense weights, the store, and the planner its backends share."""

    weights: weights_mod.ModelWeights
    store: ExpertStore
    planner: ExecutionPlanner
    ledgers: dict[str, MemoryBudget]
    spec: ModelSpec
    dense_bytes: int
    written: bool
    exact: bool = True
    dense_quant: Any = None  # runtime.kernels.dense.DenseQuantReport when dense weights were quantized

    def backends(self) -> dict[int, ManagedExperts]:
        """A ``ManagedExperts`` over the store for every MoE layer (by layer), each predicting the next MoE layer's
        experts for the store's prefetch when it has one."""
        moe_layers = [i for i, layer in enumerate(self.spec.layers) if layer.moe is not None]
        out: dict[int, ManagedExperts] = {}
        for j, i in enumerate(moe_layers):
            nxt = moe_layers[j + 1] if j + 1 < len(moe_layers) else None
            look = self._lookahead(nxt) if nxt is not None and self.store.prefetching else None
            moe = self.spec.layers[i].moe
            assert moe is not None
            act = self.weights.layers[i].moe.experts.act  # type: ignore[union-attr]
            backend = ManagedExperts(i, moe, self.store, self.planner, nxt, look, act)
            backend.exact = self.exact
            out[i] = backend
        return out

    def _lookahead(self, layer: int) -> Any:
        moe = self.spec.layers[layer].moe
        mw = self.weights.layers[layer].moe
        assert moe is not None and mw is not None

        def predict(x: torch.Tensor) -> list[int]:
            x = x.to(mw.router["weight"].device)  # a GPU model's host experts are handed the activations on the CPU
            ids, _ = route(x, moe.router, moe.top_k, mw.router["weight"], mw.router.get("bias"), mw.correction)
            return ids.unique().tolist()

        return predict


def _kernels(kernels: bool | None) -> bool:
    """``kernels``, or whether the C kernels load here when it is ``None``."""
    return build.load() is not None if kernels is None else kernels


def _storage_format(quant: str, dtype: torch.dtype, kernels: bool) -> tuple[str, bool]:
    if quant in KERNEL_FORMATS:
        return quant, kernels
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype], False


def gguf_blocks(gguf: Any, quant: str, device: str, kernels: bool) -> dict[int, ExpertLayout]:
    """The MoE layers of a GGUF model (``runtime.gguf.GGUFModel``, or ``None``) whose experts go into the cache file
    as the file's blocks, with their layouts: where the unbudgeted load runs them as blocks (``quantized_experts``)."""
    if gguf is None or not gguf.quantized_experts(quant, device):
        return {}
    return gguf_layouts(gguf, quant, kernels)


def expert_layouts(spec: ModelSpec, moe_layers: list[int], quant: str, dtype: torch.dtype, kernels: bool,
                   blocks: dict[int, ExpertLayout]) -> dict[int, ExpertLayout]:  # fmt: skip
    """MoE layer → its experts' blob layout: ``blocks``' (a GGUF file's block experts, ``gguf_blocks``), else ``quant``
    (or the compute dtype's float format) for experts read as floats."""
    first = spec.layers[moe_layers[0]].moe
    assert first is not None
    moes = [spec.layers[i].moe for i in moe_layers]
    shapes = {(m.intermediate, m.num_experts, m.expert_bias, m.gated) for m in moes}  # type: ignore[union-attr]
    if len(shapes) != 1:
        raise FreeTokenError("expert residency needs every MoE layer to have the same expert shape and count")
    fmt, packed = _storage_format(quant, dtype, kernels)
    floats = ExpertLayout(fmt, spec.hidden_size, first.intermediate, first.expert_bias, packed, gated=first.gated)
    return {i: blocks.get(i, floats) for i in moe_layers}


def slot_layout(layouts: dict[int, ExpertLayout]) -> ExpertLayout:
    """The layout the slots are sized for: the widest of the layers' (they differ only in a GGUF file's formats)."""
    return max(layouts.values(), key=lambda lay: lay.blob_bytes)


@dataclass(frozen=True)
class Minimum:
    """The least memory a budgeted load of one model can run in: its dense weights (in their tier), the KV
    reserve, and the expert slots of one MoE step (``top_k`` plus pins) in each slot tier."""

    dense_tier: str
    dense_bytes: int
    kv_reserve: int
    slots: int
    slot_bytes: int
    slot_tiers: tuple[str, ...]
    step_bytes: int = 0
    """A step's working memory (``workspace.step_bytes``), in the dense tier (where the step computes)."""

    def need(self, tier: str) -> int:
        """Bytes ``tier`` must hold at least."""
        return ((self.dense_bytes + self.step_bytes) * (tier == self.dense_tier) + self.kv_reserve * (tier == "host")
                + self.slots * self.slot_bytes * (tier in self.slot_tiers))

    def check(self, budget: Budget) -> None:
        """Raise ``BudgetTooSmallError`` (one line: what is needed, and why) when ``budget`` is below the need."""
        for tier, limit in (("host", budget.host), ("device", budget.device)):
            need = self.need(tier)
            if limit is None or limit >= need:
                continue
            parts = ([f"dense weights {format_bytes(self.dense_bytes)}", f"a step's working memory "
                      f"{format_bytes(self.step_bytes)}"] if tier == self.dense_tier else [])
            if tier in self.slot_tiers:
                parts.append(f"{self.slots} expert slots of {format_bytes(self.slot_bytes)} for one MoE step")
            if tier == "host" and self.kv_reserve:
                parts.append(f"KV reserve {format_bytes(self.kv_reserve)}")
            dense_only = tier == self.dense_tier and self.dense_bytes + self.step_bytes + \
                self.kv_reserve * (tier == "host") > limit
            why = (f": the dense weights alone (attention, embeddings, routers, shared experts) take "
                   f"{format_bytes(self.dense_bytes)}, and a step works in {format_bytes(self.step_bytes)}"
                   if dense_only else " for this model")
            raise BudgetTooSmallError(
                f"{tier} memory budget {format_bytes(limit)} is too small{why}; it needs at least {format_bytes(need)} "
                f"({', '.join(parts)}): raise --{tier}-memory to {-(-need // 10**6)}MB or more"
                + (f" (the process itself takes about {PROCESS_FLOOR_MB} MB beyond it)" if tier == "host" else ""))


def minimum_memory(
    spec: ModelSpec, reader: CheckpointReader, dtype: torch.dtype, device: str, quant: str,
    config: ResidencyConfig | None = None, dense_quant: str = "none", kernels: bool | None = None, gguf: Any = None,
) -> Minimum | None:  # fmt: skip
    """What a budgeted load of this checkpoint needs at least, found without reading its weights (a ``meta`` walk
    of the same loader; one expert is read to learn the experts' layout). ``None`` for an architecture whose
    loader computes with tensor values (it cannot run on ``meta`` tensors); the load then checks after the dense
    weights are read. ``gguf``: the opened ``runtime.gguf.GGUFModel`` when ``reader`` is its reader."""
    config = config or ResidencyConfig()
    used = set(reader.used)
    loader = DenseLoader(reader, dtype, device, check_quant(dense_quant), meta=True)
    try:
        weights = weights_mod.walk_weights(spec, loader, loader.on_layer)
    except (NotImplementedError, RuntimeError):  # torch refuses a data-dependent op on meta tensors
        return None
    finally:
        reader.used = used
    if not loader.sources:
        return None
    head = weights.lm_head
    if isinstance(head, torch.Tensor) and (packed := loader.packed(head)) is not None:  # quantize_dense converts it too
        weights.lm_head = packed
    moe_layers = sorted(loader.sources)
    kernels = _kernels(kernels)
    layout = slot_layout(expert_layouts(spec, moe_layers, quant, dtype, kernels,
                                        gguf_blocks(gguf, quant, device, kernels)))
    top_k = max(spec.layers[i].moe.top_k for i in moe_layers)  # type: ignore[union-attr]
    on_gpu = torch.device(device).type != "cpu"
    slot_tiers = ("host", "device") if config.simulate_device or (on_gpu and config.device_tier) else ("host",)
    return Minimum("device" if on_gpu else "host", tensor_bytes(weights), config.kv_reserve,
                   top_k + len(config.pin), layout.stride, slot_tiers, step_bytes(spec))


def _report(formats: set[str], layers: list[int], rest: DenseQuantReport | None) -> DenseQuantReport | None:
    """One report for the dense weights converted layer by layer (``formats``; ``layers``: count, bytes) and the
    rest (the lm_head)."""
    count, before, after = layers
    if rest is not None:
        count, before, after = count + rest.weights, before + rest.float_bytes, after + rest.quant_bytes
        formats = formats | set(rest.fmt.split("+"))
    return DenseQuantReport("+".join(sorted(formats)), count, before, after) if count else None


def load_managed(
    spec: ModelSpec, reader: CheckpointReader, path: Path, dtype: torch.dtype, device: str, quant: str,
    budget: Budget | None, config: ResidencyConfig | None = None, dense_quant: str = "none",
    kernels: bool | None = None, gguf: Any = None,
) -> Managed:  # fmt: skip
    """Dense weights + expert tiers sized from ``budget`` (see the module docstring); quantized experts in the C
    kernels' tile layout when ``kernels`` (default: whether they load here). ``gguf``: the opened
    ``runtime.gguf.GGUFModel`` when the checkpoint is a GGUF file (``reader`` is its reader).

    Under a limit the model's ``minimum_memory`` is checked first (``BudgetTooSmallError`` before anything is
    loaded); dense weights are quantized layer by layer as they are read; writing the expert cache file reads the
    checkpoint one expert at a time and drops the pages it read.
    """
    config = config or ResidencyConfig()
    budget = budget or Budget()
    ledgers = budget.ledgers()
    policy_name = config.policy
    make_policy(policy_name)  # validate the name before any work
    dense_quant = check_quant(dense_quant)
    if budget.host is not None:
        bound_heap()  # the float copies the load drops go back to the OS instead of staying in the heap
    if budget.limited:
        minimum = minimum_memory(spec, reader, dtype, device, quant, config, dense_quant, kernels, gguf)
        if minimum is not None:
            minimum.check(budget)
    loader = DenseLoader(reader, dtype, device, dense_quant)
    weights = weights_mod.walk_weights(spec, loader, loader.on_layer)
    # the lm_head (the layers are done): before the dense bytes are claimed
    dense_report = _report(loader.formats, loader.quantized,
                           quantize_dense(spec, weights, dense_quant, stored=loader.stored.packed))
    loader.stored.clear()
    check_unused(spec, reader)
    moe_layers = sorted(loader.sources)
    if not moe_layers:
        raise FreeTokenError(f"{path} has no MoE layers: there are no experts to manage")
    dense_tier = "host" if torch.device(device).type == "cpu" else "device"
    dense_bytes = tensor_bytes(weights)
    limit = ledgers[dense_tier].limit
    step = step_bytes(spec)
    if limit is not None and dense_bytes + step + config.kv_reserve * (dense_tier == "host") > limit:
        flag = "--host-memory" if dense_tier == "host" else "--device-memory"
        raise BudgetTooSmallError(
            f"{dense_tier} memory budget {format_bytes(limit)} is too small: the dense weights alone (attention, "
            f"embeddings, routers, shared experts) take {format_bytes(dense_bytes)}, and a step works in "
            f"{format_bytes(step)}; raise {flag}"
        )
    ledgers[dense_tier].reserve("dense", dense_bytes)
    ledgers[dense_tier].reserve("step", step)  # activations, score blocks, kernel scratch: not in the pools
    ledgers["host"].reserve("kv", config.kv_reserve)

    kernels = _kernels(kernels)
    blocks = gguf_blocks(gguf, quant, device, kernels)
    layouts = expert_layouts(spec, moe_layers, quant, dtype, kernels, blocks)
    layout = slot_layout(layouts)
    num_experts = spec.layers[moe_layers[0]].moe.num_experts  # type: ignore[union-attr]
    files = None if gguf is None else list(gguf.file.parts)
    file_path = config.cache_path or cache_root() / f"{cache_key(path, layout, files, layouts)}.ftx"
    # the C quantizer writes the file where the kernels run (~3x faster than the torch one; same rules)
    encoders = {lay: encoder(lay) if lay.packed else lay.encode for i, lay in layouts.items() if i not in blocks}
    quantizing = any(lay.packed for lay in encoders)
    # the C quantizer widens bf16/fp16 to fp32 itself, exactly as .to(float32) does: no fp32 copy of each expert
    as_read = (torch.float32, torch.bfloat16, torch.float16) if quantizing and dtype == torch.float32 else ()
    # each expert is read once: under a host limit its pages leave the page cache (a cgroup counts them)
    drop = budget.host is not None
    with GGUFExpertReader(gguf, blocks, drop) if blocks else contextlib.nullcontext() as from_gguf:

        def blob(layer: int, e: int) -> torch.Tensor:
            if from_gguf is not None and layer in blocks:
                return from_gguf.blob(layer, e)
            t = loader.sources[layer].load(e)
            cast = lambda v: None if v is None else v if v.dtype in as_read else v.to(dtype)
            return encoders[layouts[layer]](type(t)(cast(t.gate_up), cast(t.down), cast(t.gate_up_bias),
                                                    cast(t.down_bias)))

        reader.drop_cache = drop
        try:
            with ops.pool_carries() if quantizing else contextlib.nullcontext():
                disk, written = open_or_write(file_path, layout, moe_layers, num_experts, blob,
                                              config.drop_page_cache, encode=_as_blob, layouts=layouts)
        finally:
            reader.drop_cache = False
    top_k = max(spec.layers[i].moe.top_k for i in moe_layers)  # type: ignore[union-attr]
    store, planner = build_store(disk, ledgers, top_k, device, config)
    if budget.host is not None:
        bound_heap()  # what the heap holds free after the load goes back too
    return Managed(weights, store, planner, ledgers, spec, dense_bytes, written, exact=config.exact,
                   dense_quant=dense_report)


def _as_blob(blob: torch.Tensor) -> torch.Tensor:
    """``open_or_write``'s ``encode`` for a ``load`` that makes each expert's blob itself."""
    return blob


def build_store(
    disk: ExpertCacheFile, ledgers: dict[str, MemoryBudget], top_k: int, device: str, config: ResidencyConfig
) -> tuple[ExpertStore, ExecutionPlanner]:
    """Size the slot pools from what the ledgers have left (dense weights/KV already claimed); store + planner."""
    layout = disk.layout
    total = len(disk.layers) * disk.num_experts

    def slots_in(ledger: MemoryBudget, label: str) -> int:
        if ledger.limit is None:
            return total
        n = min(total, ledger.free // layout.stride)  # type: ignore[operator]
        need = top_k + len(config.pin)
        if n < need:
            raise BudgetTooSmallError(
                f"{label} budget {format_bytes(ledger.limit)} is too small: after {format_bytes(ledger.used)} of "
                f"dense weights/KV, {n} expert slots of {format_bytes(layout.stride)} fit; one MoE step needs {need}"
            )
        return n

    on_gpu = torch.device(device).type != "cpu"
    host_pool = SlotPool("host", layout, slots_in(ledgers["host"], "host memory"), "cpu",
                         ledgers["host"].reserve("experts"), make_policy(config.policy),
                         pin_memory=on_gpu and torch.cuda.is_available())
    dev_pool = None
    if config.simulate_device or (on_gpu and config.device_tier):
        if config.simulate_device and ledgers["device"].limit is None:
            raise FreeTokenError("a simulated device tier needs a device budget (--device-memory)")
        dev_pool = SlotPool("device", layout, slots_in(ledgers["device"], "device memory"),
                            "cpu" if config.simulate_device else device, ledgers["device"].reserve("experts"),
                            make_policy(config.policy))
    if config.pools not in ("global", "layer"):
        raise FreeTokenError(f"unknown pools {config.pools!r}; expected global or layer")
    if config.pools == "layer":
        for pool in (host_pool, dev_pool):
            if pool is not None:
                pool.split_per_layer(len(disk.layers), top_k)
    store = ExpertStore(disk, host_pool, dev_pool, ledgers, prefetch=config.prefetch)
    host_pool.reservation.on_shrink = store.shrink_host
    store.min_slots = top_k
    if config.pin:
        store.pin(list(config.pin))
    rates = config.rates or _profile_rates()
    planner = ExecutionPlanner(CostModel(rates), layout.blob_bytes, dev_pool is not None, config.planner)
    store.observe_copy, store.observe_disk = planner.cost.observe_copy, planner.cost.observe_disk
    return store, planner


def _profile_rates() -> Rates:
    """Rates from the cached hardware profile when there is one (never runs the probe here)."""
    from freetoken_agent.runtime.hardware import cached_profile

    profile = cached_profile()
    return profile.rates() if profile is not None else Rates()
