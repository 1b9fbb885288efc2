"""One C call per layer of a decode step or a speculative verify row (``ft_attn_step`` in ``kernels/csrc/ft_layer.h``).

A decode step of one sequence runs each layer — norm, q/k/v projections, q/k norms, RoPE, the cache write,
attention, output projection, residual, the FFN's input norm, router, routing, experts — as ~20-30 Python-level ops,
each a few µs of dispatch, checks and allocations, and many times that with the caches cold after a kernel streamed
the weights: on a 24-layer 7.5B model at Q4_0 that was 15-22% of a decode step. Where the op-by-op path
(``Decoder._mix`` → ``gqa_attention``, ``Decoder._moe``) would run every one of those steps on the C kernels, this
runs the same kernels in the same order in one call, so the hidden state is bitwise the one that path gives (tests
compare the two). The routing and experts join the call only where the layer's backend runs a one-token step as one
``ops.moe`` call over bytes that stay put; otherwise the FFN half (routing observers, the backend and its tiers)
runs op by op with the call's router logits. Routing observers are told the call's choices.

A layer is fused when its spec is a plain GQA layer (see ``plan_layer``) with fp32 weights the kernels take, or its
projections in the kernels' tiles (``dense_quant=``, a GGUF file's blocks: ``kernels/dense.py``'s ``QuantLinear``);
``FusedDecode.step`` applies per step: one sequence of at most ``MAX_ROW`` consecutive tokens (a decode token, or a
token and its draft tokens: every kernel of the call is batch invariant, so a verify row is bitwise the decode steps
of its tokens, which is what keeps greedy speculation token-identical), fp32 hidden, a paged cache whose pages are
one run. Anything else — and any layer whose plan does not apply — runs op by op.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Any

import torch

from freetoken_agent.runtime.kernels import ops as kops
from freetoken_agent.runtime.model.moe import kernel_route_mode
from freetoken_agent.runtime.model.rope import SMALL_ROPE, Rotary
from freetoken_agent.runtime.model.spec import LayerSpec, ModelSpec
from freetoken_agent.runtime.model.weights import LayerWeights

F32 = torch.float32
MAX_ROW = 8
"""Tokens a fused step carries at most (``FT_STEP_MAX_T``: the kernels' GEMV rows, ``GEMV_MAX_M``)."""
_p, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


class AttnLayer(ctypes.Structure):
    """``ft_attn_layer``: one layer's shapes, options and weight pointers."""

    _fields_ = [("d", _i64), ("h", _i64), ("hkv", _i64), ("dh", _i64), ("dv", _i64), ("rot", _i64),
                ("window", _i64), ("chunk", _i64), ("rope_half", _i32), ("qk_norm", _i32), ("eps", _f32),
                ("scale", _f32)] + [(name, _p) for name in (
                    "norm_in", "wq", "wk", "wv", "bq", "bk", "bv", "q_norm", "k_norm", "wo", "bo", "norm_out",
                    "sinks", "router", "router_bias")] + [("experts", _i64), ("w13", _p), ("w2", _p),
                    ("w13_stride", _i64), ("w2_stride", _i64), ("inter", _i64), ("top_k", _i64), ("fmt13", _i32),
                    ("fmt2", _i32), ("route_mode", _i32), ("route_norm", _i32), ("route_norm_eps", _f32),
                    ("route_scaling", _f32), ("fmt_q", _i32), ("fmt_k", _i32), ("fmt_v", _i32), ("fmt_o", _i32),
                    ("qkv_joined", _i32)]


@dataclass
class LayerPlan:
    """A fused layer: its C struct, the tensors it points at (kept alive, and checked to still be the layer's), the
    rotary table it turns by, and the scratch buffer."""

    struct: AttnLayer
    buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    """x [MAX_ROW, D], logits [MAX_ROW, E], ids [MAX_ROW, K], weights [MAX_ROW, K]: a step of T tokens uses their
    first T rows; reused by every step whose FFN runs in the call."""
    experts: int
    """Router rows (0: the C call leaves the router to the op-by-op path)."""
    backend: Any
    """The routed experts' backend the C call runs itself (its ``one_token_call``), or None: the FFN op by op."""
    held: list[tuple[dict, str, Any]]
    rotary: Rotary | None
    work: torch.Tensor
    tiled: list[Any]
    """The projections in the kernels' tiles (``QuantLinear``): the layer runs op by op while one is in exact mode."""

    def current(self, backend: Any) -> bool:
        return all(table.get(key) is obj for table, key, obj in self.held) and (
            self.backend is None or backend is self.backend)

    def exact_mode(self) -> bool:
        """Whether a projection in tiles multiplies dequantized in torch now (``set_dense_mode``): op by op while so."""
        return any(q.exact is not None for q in self.tiled)

    def experts_call(self) -> bool:
        """Whether this step's experts run in the C call: the backend still runs a one-token step as the one kernel
        call over the bytes the plan points at (its mode may have changed since)."""
        if self.backend is None:
            return False
        call = self.backend.one_token_call(int(self.struct.top_k))
        return call is not None and call[2].data_ptr() == self.struct.w13 and call[3].data_ptr() == self.struct.w2


def _vector(t: Any, n: int) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype is F32 and t.is_cpu and t.is_contiguous() and t.shape == (n,)


def _matrix(t: Any, rows: int, cols: int) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype is F32 and t.is_cpu and t.is_contiguous() and \
        t.shape == (rows, cols)


def _tiles(t: Any, rows: int, cols: int) -> int | None:
    """The format code of a dense weight held in the kernels' tiles (``kernels/dense.py``'s ``QuantLinear``) of shape
    [rows, cols], else None. (Its exact mode is checked per step: ``LayerPlan.exact_mode``.)"""
    packed = getattr(t, "packed", None)
    if isinstance(t, torch.Tensor) or not isinstance(packed, kops.PackedWeight) or not hasattr(t, "exact"):
        return None
    return int(packed.code) if (packed.n, packed.k) == (rows, cols) else None


def plan_layer(spec: ModelSpec, i: int, lw: LayerWeights, rotary: Rotary | None, backend: Any = None
               ) -> LayerPlan | None:
    """The fused plan of layer ``i``, or None where its attention half is anything but: RMSNorm in, GQA with
    optional per-head q/k RMSNorm before RoPE, biases, sinks, sliding window or chunked attention, output projection,
    plain residual, RMSNorm (or none) into an FFN whose output is added back unscaled. The router's product joins
    the call when ``moe.route`` runs it on the kernels; the routing and the experts when the router is one
    ``ft_route`` handles and ``backend`` (the layer's experts) runs a one-token step as one ``ops.moe`` call over
    resident bytes, with nothing else in the MoE block (shared experts, biases, latent projections, ...)."""
    layer: LayerSpec = spec.layers[i]
    att = layer.attention
    if (spec.norm_kind != "rms" or spec.residual_from_norm or spec.parallel_block or spec.hyper_streams
            or spec.attn_residual is not None or spec.gated_hyper is not None or spec.per_layer_input
            or spec.residual_multiplier != 1.0):
        return None
    if (layer.parts != "both" or layer.recurrent is not None or layer.post_conv or layer.moe_shortcut != "none"
            or layer.moe_beside_mlp or any(s != 1.0 for s in layer.residual_scales)):
        return None
    if (att.kind != "gqa" or att.kv_source is not None or att.k_eq_v or att.q_gate or att.clip_qkv is not None
            or att.v_norm or att.v_scale != 1.0 or att.qk_norm not in ("none", "head") or att.qk_norm_after_rope
            or att.q_scale_beta > 0 or att.q_scale_power > 0 or att.dynamic_mask or att.block_indexer is not None
            or att.indexer is not None or att.sparse_index is not None
            or att.output_gate != "none" or att.relpos is not None or att.qsa is not None
            or att.compressor is not None or att.o_groups):
        return None
    norms, w = lw.norms, lw.attn
    extra_norms = set(norms) - {"attn_in", "ffn_in"}
    if extra_norms or "attn_in" not in norms:  # attn_out / ffn_out norms, gated norms, affine residuals, scalars
        return None
    d, h, hkv, dh, dv = spec.hidden_size, att.num_heads, att.num_kv_heads, att.head_dim, att.v_head_dim
    if h % hkv or h * dh > SMALL_ROPE:  # a bigger q rotates in torch on the op-by-op path
        return None
    if not _vector(norms["attn_in"], d) or ("ffn_in" in norms and not _vector(norms["ffn_in"], d)):
        return None
    shapes = {"q_proj": (h * dh, d), "k_proj": (hkv * dh, d), "v_proj": (hkv * dv, d), "o_proj": (d, h * dv)}
    fmt: dict[str, int] = {}  # the projections in the kernels' tiles: their format codes (-1: fp32 rows)
    for name, (rows, cols) in shapes.items():
        weight, bias = w.get(f"{name}.weight"), w.get(f"{name}.bias")
        fmt[name] = -1 if _matrix(weight, rows, cols) else _tiles(weight, rows, cols)
        if fmt[name] is None or (bias is not None and not _vector(bias, rows)):
            return None
    if len({f < 0 for n, f in fmt.items() if n != "o_proj"}) != 1:  # q, k, v: all fp32 rows or all tiles
        return None
    tiled = [w[f"{n}.weight"] for n in shapes if fmt[n] >= 0]
    joined = None  # q|k|v back to back in one format: the op-by-op path makes one product (``projections``)
    if fmt["q_proj"] >= 0 and all(w.get(f"{n}.bias") is None for n in ("q_proj", "k_proj", "v_proj")):
        fused_rows, parts = getattr(w["q_proj.weight"], "fused", None), [w[f"{n}.weight"] for n in shapes][:3]
        if fused_rows is not None and len(fused_rows.parts) == 3 and all(a is b for a, b in zip(fused_rows.parts,
                                                                                                  parts)):
            joined = fused_rows.packed
    if att.qk_norm == "head" and not (_vector(w.get("q_norm.weight"), dh) and _vector(w.get("k_norm.weight"), dh)):
        return None
    sinks = w.get("sinks")
    sinks32 = None
    if sinks is not None:
        if not (isinstance(sinks, torch.Tensor) and sinks.is_cpu and sinks.numel() == h):
            return None
        sinks32 = sinks.to(F32).contiguous().view(h)
    rot, half = 0, 0
    if rotary is not None:
        rot, half = 2 * rotary.inv_freq.shape[0], int(rotary.spec.style == "half")
        if rot > dh or rot % 2:
            return None
    router = router_bias = None
    if lw.moe is not None and layer.moe is not None:  # the router's product, as ``moe.route`` would run it
        r, mw = layer.moe.router, lw.moe
        plain = layer.moe.kind != "product_key" and not (r.shared_sink or r.mlp_hidden or r.scoring == "sparsemixer")
        rw, rb = mw.router.get("weight"), mw.router.get("bias")
        if plain and isinstance(rw, torch.Tensor) and _matrix(rw, rw.shape[0], d) and (rb is None or _vector(
                rb, rw.shape[0])):
            router, router_bias = rw, rb
    held: list[tuple[dict, str, Any]] = [(norms, "attn_in", norms["attn_in"])]
    moe_call = mode = None
    if router is not None:
        held += [(lw.moe.router, key, t) for key, t in (("weight", router), ("bias", router_bias)) if t is not None]
        moe, mw = layer.moe, lw.moe
        assert moe is not None
        mode = kernel_route_mode(moe.router, mw.correction)
        alone = (mode is not None and not moe.router.hash_table and "expert_scale" not in mw.router
                 and not moe.zero_experts and not moe.latent and not moe.scale_input and moe.shared is None
                 and not moe.expert_out_norm
                 and mw.output_bias is None and mw.output_norm is None)
        call = getattr(backend, "one_token_call", None)
        if alone and call is not None and getattr(backend, "num_experts", -1) == router.shape[0]:
            moe_call = call(moe.top_k)
    if moe_call is None:
        backend = None
    if "ffn_in" in norms:
        held.append((norms, "ffn_in", norms["ffn_in"]))
    keys = [f"{n}.{part}" for n in shapes for part in ("weight", "bias")] + ["q_norm.weight", "k_norm.weight", "sinks"]
    held += [(w, key, w[key]) for key in keys if w.get(key) is not None]  # what a reload or swap replaces
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    get = lambda key: w.get(key) if att.qk_norm == "head" or "norm" not in key else None  # noqa: E731

    def wptr(name: str) -> int:
        weight = w[f"{name}.weight"]
        return weight.data_ptr() if fmt[name] < 0 else weight.packed.ptr

    s = AttnLayer(
        d=d, h=h, hkv=hkv, dh=dh, dv=dv, rot=rot, window=att.sliding_window or 0, chunk=att.chunk_size or 0,
        rope_half=half, qk_norm=int(att.qk_norm == "head"), eps=spec.norm_eps, scale=att.scale,
        norm_in=ptr(norms["attn_in"]), wq=wptr("q_proj"), wk=wptr("k_proj"), wv=wptr("v_proj"),
        bq=ptr(w.get("q_proj.bias")), bk=ptr(w.get("k_proj.bias")), bv=ptr(w.get("v_proj.bias")),
        q_norm=ptr(get("q_norm.weight")), k_norm=ptr(get("k_norm.weight")),
        wo=wptr("o_proj"), bo=ptr(w.get("o_proj.bias")), norm_out=ptr(norms.get("ffn_in")),
        sinks=ptr(sinks32), router=ptr(router), router_bias=ptr(router_bias),
        experts=0 if router is None else router.shape[0], fmt_q=fmt["q_proj"], fmt_k=fmt["k_proj"],
        fmt_v=fmt["v_proj"], fmt_o=fmt["o_proj"], qkv_joined=int(joined is not None),
    )
    if joined is not None:
        s.wq, s.fmt_q = joined.ptr, joined.code
        held.append(({"qkv": joined.data}, "qkv", joined.data))  # kept alive with the plan
    if moe_call is not None and layer.moe is not None:
        r = layer.moe.router
        code13, code2, w13, w2 = moe_call
        s.w13, s.w2, s.w13_stride, s.w2_stride = w13.data_ptr(), w2.data_ptr(), w13.stride(0), w2.stride(0)
        s.inter, s.top_k, s.fmt13, s.fmt2 = layer.moe.intermediate, layer.moe.top_k, code13, code2
        s.route_mode, s.route_norm = int(mode or 0), int(r.norm_topk and mode == 0)
        s.route_norm_eps, s.route_scaling = r.norm_eps, r.scaling
    lib = kops.fast()
    assert lib is not None
    work = torch.empty(MAX_ROW * int(lib.ft_attn_step_work(ctypes.byref(s))), dtype=F32)
    if sinks32 is not None:
        held.append(({"sinks32": sinks32}, "sinks32", sinks32))  # kept alive with the plan
    top_k = int(s.top_k)
    buffers = (torch.empty(MAX_ROW, d, dtype=F32), torch.empty(MAX_ROW, int(s.experts), dtype=F32),
               torch.empty(MAX_ROW, top_k, dtype=torch.int64), torch.empty(MAX_ROW, top_k, dtype=F32))
    return LayerPlan(s, buffers, int(s.experts), backend, held, rotary, work, tiled)


class LayerGroup:
    """Consecutive fused layers that run whole in the call (``FusedStep.layers``): their structs and buffers as the
    pointer arrays ``ft_attn_steps`` takes, built once."""

    def __init__(self, plans: list[LayerPlan]) -> None:
        self.plans = plans
        n = len(plans)
        arr = ctypes.c_void_p * n
        self.structs = arr(*(ctypes.addressof(p.struct) for p in plans))
        self.x, self.logits, self.ids, self.weights = (arr(*(p.buffers[k].data_ptr() for p in plans)) for k in range(4))
        self.work = arr(*(p.work.data_ptr() for p in plans))


class FusedDecode:
    """The fused plans of a decoder's layers, built on the first decode step that can use them and rebuilt for a
    layer whose weights were replaced since (dense quantization, reference swaps)."""

    def __init__(self, spec: ModelSpec, weights: Any, rotary: list[Rotary | None], experts: list[Any],
                 observers: list[Any]) -> None:
        """``experts`` and ``observers``: the decoder's lists of expert backends and routing observers (read at
        every step: replacing a backend replans its layer)."""
        self.spec, self.weights, self.rotary, self.experts, self.observers = spec, weights, rotary, experts, observers
        self._plans: list[LayerPlan | None | bool] = [False] * spec.num_layers  # False: not planned yet
        self.groups: dict[int, LayerGroup] = {}  # first layer -> the layers from it that run whole in one call
        self.enabled = os.environ.get("FREETOKEN_FUSED_DECODE", "1").lower() not in ("0", "off", "false")
        """Off: every layer op by op (``$FREETOKEN_FUSED_DECODE=0``; tests and benchmarks compare the two)."""
        self.layers_run = 0
        """Layer steps run fused so far."""
        self.ffn_run = 0
        """Of those, steps whose routing and experts ran in the call too."""
        self.rows_run = 0
        """Of those, steps of a row of several tokens (a speculative verify row, a short prompt chunk)."""
        self.grouped_run = 0
        """Of those, layer steps run by a call over several layers (``FusedStep.layers``)."""

    def plan(self, i: int) -> LayerPlan | None:
        p, backend = self._plans[i], self.experts[i]
        if p is False or (isinstance(p, LayerPlan) and not p.current(backend)):
            p = self._plans[i] = plan_layer(self.spec, i, self.weights.layers[i], self.rotary[i], backend)
        return p if isinstance(p, LayerPlan) and not p.exact_mode() else None

    def step(self, h: torch.Tensor, cache: Any, positions: torch.Tensor) -> FusedStep | None:
        """The per-step state of a step of one sequence (h [T, D] fp32 with 1 <= T <= ``MAX_ROW``, its cache and the
        T consecutive positions from the cache's length on), or None when this step cannot be fused at all."""
        lib = kops.fast()
        t = h.shape[0]
        if (not self.enabled or lib is None or not 1 <= t <= MAX_ROW or h.dtype is not F32 or not h.is_contiguous()
                or not h.is_cpu or not hasattr(cache, "direct_rows") or positions.shape != (t,)):
            return None
        pos = int(positions[0])
        if pos != getattr(cache, "length", -1) or (t > 1 and int(positions[-1]) != pos + t - 1):
            return None  # rows are written from the cache's length on: other positions run op by op
        rows = cache.direct_rows(t)
        if rows is None:
            return None
        return FusedStep(self, lib, h, cache, rows, positions, kops.deterministic())


class FusedStep:
    """One decode step's fused layers: ``attention(i, h)`` runs layer i's attention half (in place on h) and returns
    the FFN's input and the router's logits (None: no router in the call) — ``(None, None)`` when the call ran the
    FFN too — or None when layer i runs op by op."""

    def __init__(self, owner: FusedDecode, lib: ctypes.CDLL, h: torch.Tensor, cache: Any,
                 rows: list[list[torch.Tensor] | None], positions: torch.Tensor, deterministic: bool) -> None:
        self.owner, self.lib, self.cache, self.rows = owner, lib, cache, rows
        self.positions, self.deterministic = positions, deterministic
        self.pos, self.t = int(positions[0]), int(positions.shape[0])
        self._tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        first = next((p for p in rows if p), None)
        self._kv_dtype = first[0].dtype if first else None
        self._kv_type = kops.KV_TYPE_CODE.get(self._kv_dtype, -1) if first else -1

    def attention(self, i: int, h: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
        plan = self.owner.plan(i)
        parts = self.rows[i] if i < len(self.rows) else None
        if plan is None or parts is None or len(parts) != 2:
            return None
        k, v = parts
        kv_type = kops.KV_TYPE_CODE.get(k.dtype)
        if kv_type is None or v.dtype is not k.dtype or (self.deterministic and kv_type != 0):
            return None  # deterministic mode runs attention over a 16-bit cache in torch, one query at a time
        cos = sin = None
        if plan.rotary is not None:
            cos, sin = self._table(plan.rotary)
            if cos is None:
                return None
        observers = self.owner.observers
        t = self.t
        if plan.experts_call():  # everything stays in the call: the plan's buffers (ids fresh for observers)
            x, logits, ids, weights = (b[:t] for b in plan.buffers)
            if observers:
                ids = torch.empty_like(ids)
        else:  # the FFN's input and logits go to the op-by-op FFN, which may keep them: fresh ones
            x, ids, weights = torch.empty_like(h), None, None
            logits = torch.empty(t, plan.experts, dtype=F32) if plan.experts else None
        rc = self.lib.ft_attn_step(
            ctypes.byref(plan.struct), t, h.data_ptr(), x.data_ptr(), None if cos is None else cos.data_ptr(),
            None if sin is None else sin.data_ptr(), k.data_ptr(), v.data_ptr(), kv_type, k.stride(0), v.stride(0),
            self.pos, plan.work.data_ptr(), None if logits is None else logits.data_ptr(),
            None if ids is None else ids.data_ptr(), None if weights is None else weights.data_ptr(),
        )  # fmt: skip
        if rc:
            raise MemoryError("ft_attn_step: out of memory") if rc == -1 else ValueError("ft_attn_step: bad layer")
        self.cache.wrote_rows(i, t, [F32, F32])
        self.owner.layers_run += 1
        self.owner.rows_run += t > 1
        if ids is None:
            return x, logits
        for observe in observers:
            observe(i, ids)
        self.owner.ffn_run += 1
        return None, None

    def layers(self, i: int, h: torch.Tensor) -> int:
        """Layers i, i + 1, ... that run whole in the call (their FFN included), run in one ``ft_attn_steps`` call:
        the same ``ft_attn_step`` calls in the same order, without Python between the layers. Returns how many ran
        (0: fewer than two qualify from i; the caller goes on layer by layer)."""
        owner, t = self.owner, self.t
        if self._kv_type < 0 or (self.deterministic and self._kv_type != 0):
            return 0
        group = owner.groups.get(i)
        if group is None or not all(owner.plan(j) is plan and plan.experts_call()
                                    for j, plan in enumerate(group.plans, i)):
            plans = []
            for j in range(i, owner.spec.num_layers):
                plan = owner.plan(j)
                if plan is None or not plan.experts_call():
                    break
                plans.append(plan)
            if len(plans) < 2:
                owner.groups.pop(i, None)
                return 0
            group = owner.groups[i] = LayerGroup(plans)
        n = len(group.plans)
        if i + n > len(self.rows):
            return 0
        parts = self.rows[i : i + n]
        if any(p is None or len(p) != 2 or p[0].dtype is not self._kv_dtype or p[1].dtype is not self._kv_dtype
               for p in parts):
            return 0
        tables = [self._table(plan.rotary) if plan.rotary is not None else (None, None) for plan in group.plans]
        if any(plan.rotary is not None and cos is None for plan, (cos, _) in zip(group.plans, tables)):
            return 0
        observers = owner.observers
        ids = [torch.empty(t, int(plan.struct.top_k), dtype=torch.int64) for plan in group.plans] if observers \
            else None  # fmt: skip
        arr = ctypes.c_void_p * n
        done = ctypes.c_int64(0)
        strides = ctypes.c_int64 * n
        rc = self.lib.ft_attn_steps(
            n, group.structs, t, h.data_ptr(), group.x, arr(*(c if c is None else c.data_ptr() for c, _ in tables)),
            arr(*(s if s is None else s.data_ptr() for _, s in tables)), arr(*(p[0].data_ptr() for p in parts)),
            arr(*(p[1].data_ptr() for p in parts)), self._kv_type, strides(*(p[0].stride(0) for p in parts)),
            strides(*(p[1].stride(0) for p in parts)), self.pos, group.work, group.logits,
            group.ids if ids is None else arr(*(x.data_ptr() for x in ids)), group.weights, ctypes.byref(done),
        )  # fmt: skip
        for j in range(i, i + done.value):
            self.cache.wrote_rows(j, t, [F32, F32])
            for observe in observers:
                observe(j, ids[j - i])  # type: ignore[index]
        owner.layers_run += done.value
        owner.ffn_run += done.value
        owner.rows_run += done.value * (t > 1)
        owner.grouped_run += done.value
        if rc:
            raise MemoryError("ft_attn_step: out of memory") if rc == -1 else ValueError("ft_attn_step: bad layer")
        return n

    def _table(self, rotary: Rotary) -> tuple[Any, Any]:
        got = self._tables.get(id(rotary))
        if got is None:
            cos, sin = rotary.cos_sin(self.positions)
            ok = cos.dtype is F32 and sin.dtype is F32 and cos.is_contiguous() and sin.is_contiguous() and cos.is_cpu
            got = self._tables[id(rotary)] = (cos, sin) if ok else (None, None)
        return got
