"""Typed wrappers over the C kernels: quantized linear, dequantize, fused MoE step, fp32 linear, norm, rope,
attention, read bandwidth; and the process-wide deterministic (batch-invariant) switch.

Every function takes repacked weights (``layout.pack_blocks``) and checks shapes before calling into C; callers
choose the torch fallback themselves when ``build.load()`` returns ``None``. What the switch changes, and what is
batch invariant without it, is listed in ``invariant.py``.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..errors import FreeTokenError
from ..quant.blocks import BLOCK, BLOCK_BYTES, BlockQuantized, canonical_format
from ..quant.formats import block_format
from . import build
from .layout import TILE_ROWS, pack_blocks

FMT_CODE = {"q8_0": 0, "q4_0": 1, "q4_k": 2, "q6_k": 3, "q5_k": 4, "mxfp4": 5}
"""The C side's code of each format it computes in (``csrc/ft_tiles.h``)."""
ISA_CODE = {"best": -1, "portable": 0, "avx2": 1, "avx512vnni": 2, "amx": 3}


_loaded: list[ctypes.CDLL] = []  # the library once loaded: saves the lock and lookups on every call


def _lib() -> ctypes.CDLL:
    if _loaded:
        return _loaded[0]
    lib = build.load()
    if lib is None:
        raise FreeTokenError(f"the CPU kernels are unavailable ({build.status().reason})")
    _loaded.append(lib)
    return lib


class KernelClock:
    """Time spent inside the C kernels per entry point (``timed_kernels``): wall seconds, CPU seconds of the calling
    thread (the pool's workers not counted: the caller takes a share of every call and waits for the rest), calls."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.cpu_seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    @property
    def cpu_total(self) -> float:
        return sum(self.cpu_seconds.values())


class _TimedLibrary:
    """Stands in for the loaded library while ``timed_kernels`` runs: every ``ft_*`` call is timed."""

    def __init__(self, lib: ctypes.CDLL, clock: KernelClock) -> None:
        self._lib_, self._clock = lib, clock

    def __getattr__(self, name: str) -> object:
        fn = getattr(self._lib_, name)
        clock, now, cpu = self._clock, time.perf_counter, time.thread_time

        def timed(*args: object) -> object:
            t0, c0 = now(), cpu()
            try:
                return fn(*args)
            finally:
                clock.seconds[name] = clock.seconds.get(name, 0.0) + now() - t0
                clock.cpu_seconds[name] = clock.cpu_seconds.get(name, 0.0) + cpu() - c0
                clock.calls[name] = clock.calls.get(name, 0) + 1

        self.__dict__[name] = timed  # looked up once per entry point
        return timed


@contextmanager
def timed_kernels() -> Iterator[KernelClock]:
    """Time every C kernel call made through this module while the block runs (a profiling switch: outside it
    calls go straight to the library). Loads the kernels; raises ``FreeTokenError`` where they cannot load."""
    real = _lib()
    clock = KernelClock()
    _loaded[0] = _TimedLibrary(real, clock)  # type: ignore[call-overload]
    try:
        yield clock
    finally:
        _loaded[0] = real


F32, BF16 = torch.float32, torch.bfloat16  # dtypes are singletons: `is` is the cheapest check on a hot path


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype is F32 and t.is_contiguous() else t.to(F32).contiguous()


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def kernel_format(fmt: str, k: int | None = None) -> str:
    """The canonical name of a format the kernels compute in (``q4`` → ``q4_0``); a clear error for any other, and
    for a K-quant whose row length ``k`` is no whole number of its 256-value super-blocks."""
    f = block_format(fmt)
    if f.name not in FMT_CODE:
        raise FreeTokenError(f"the CPU kernels do not compute in {f.name}; it runs as {f.runs_as}")
    if k is not None and f.block_values != BLOCK and k % f.block_values:  # 32-value formats zero-pad a ragged row
        raise FreeTokenError(f"{f.name} weights need rows of a multiple of {f.block_values} values, got {k}")
    return f.name


@dataclass(frozen=True)
class PackedWeight:
    """A ``[N, K]`` weight in the kernels' tile layout: ``data`` uint8, ``packed_bytes(fmt, N, K)`` long."""

    fmt: str
    n: int
    k: int
    data: torch.Tensor

    def __post_init__(self) -> None:  # looked up once: a decode step makes dozens of calls of a few µs each
        object.__setattr__(self, "fmt", kernel_format(self.fmt, self.k))  # "q4" → "q4_0"; other formats raise
        object.__setattr__(self, "code", FMT_CODE[self.fmt])
        object.__setattr__(self, "ptr", self.data.data_ptr())

    @classmethod
    def from_blocks(cls, qw: BlockQuantized) -> PackedWeight:
        return cls(qw.fmt, qw.shape[0], qw.shape[1], pack_blocks(qw.blocks))

    @classmethod
    def from_rows(cls, fmt: str, blocks: torch.Tensor, k: int) -> PackedWeight:
        """From one matrix's GGUF blocks ``[N, nb, P]`` of any kernel format (e.g. ``quant.formats`` quantizers)."""
        return cls(fmt, blocks.shape[0], k, pack_blocks(blocks))

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def packed_bytes(fmt: str, n: int, k: int) -> int:
    """Bytes of a repacked ``[n, k]`` weight (same formula as the C side): 8 rows' blocks per tile."""
    f = block_format(kernel_format(fmt))
    return -(-n // TILE_ROWS) * f.nb(k) * TILE_ROWS * f.block_bytes


def set_threads(n: int) -> int:
    """Size the kernels' thread pool (caller included); returns the count now running."""
    return int(_lib().ft_set_threads(int(n)))


def get_threads() -> int:
    return int(_lib().ft_get_threads())


HANDOFF_SPIN_US = 100  # idle workers' poll while torch carries the work (prefill): back-to-back calls only


def set_spin_us(us: int) -> int:
    """How long idle pool workers poll for the next call before sleeping, in µs; returns the previous value.

    The default (5 ms, like ggml's pool and libgomp's) bridges the gaps between kernel calls of a decode step, so a
    call never waits for a sleeping worker's core to come back. ``$FREETOKEN_CPU_SPIN_US`` sets it at load.
    """
    return int(_lib().ft_set_spin_us(int(us)))


_handoff_lock = threading.Lock()
_handoff = {"depth": 0, "saved": 0}


@contextmanager
def torch_heavy() -> Iterator[None]:
    """While torch's own threads carry the work (a multi-token prefill: attention, big ``torch.mm``), idle pool
    workers poll only ``HANDOFF_SPIN_US`` and then sleep instead of taking turns with torch on the same cores.
    Nests and is safe across threads (the poll comes back when the last one leaves); a no-op while the kernels are
    not loaded (it never builds them)."""
    lib = fast()
    if lib is None:
        yield
        return
    with _handoff_lock:
        _handoff["depth"] += 1
        if _handoff["depth"] == 1:
            prev = int(lib.ft_set_spin_us(HANDOFF_SPIN_US))
            _handoff["saved"] = prev
            if prev < HANDOFF_SPIN_US:  # a user's shorter setting stays theirs
                lib.ft_set_spin_us(prev)
    try:
        yield
    finally:
        with _handoff_lock:
            _handoff["depth"] -= 1
            if _handoff["depth"] == 0:
                lib.ft_set_spin_us(_handoff["saved"])


@contextmanager
def pool_carries() -> Iterator[None]:
    """While the kernels' pool carries the heavy work and torch only reads and copies between its calls (the
    expert cache write: quantize on the pool, torch concatenates and copies): torch on one thread. Its OpenMP
    workers otherwise spin after every small op on the cores the pool is using (a 2-thread cache write took 1.9
    CPU-s where 1 thread took 1.33; torch on one thread: 1.36, and faster in wall time). Not for concurrent torch
    work in other Python threads (the setting is process-wide); restores the count (and the pool's polling, which it
    turns off meanwhile: 5% of a 7.5B cache write's CPU was idle workers polling) on exit."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    spin = set_spin_us(0)  # and the pool's workers sleep between its calls: the cores go to the reads meanwhile
    try:
        yield
    finally:
        set_spin_us(spin)
        torch.set_num_threads(before)


AMX_MODES = ("exact", "bf16", "prompts")
"""The ``amx`` path's numerics (``set_amx_mode``), in the C library's order."""

_deterministic = [False]
_amx_mode_before = [AMX_MODES.index("prompts")]  # the AMX mode set_deterministic(True) replaced


def set_deterministic(on: bool) -> None:
    """Turn batch-invariant numerics on or off for the whole process (default off).

    On, every op that mixes rows or keys reduces each row (each query) in one fixed order, so a row's bits do not
    depend on how many rows share the call, on its place among them, or on how a prompt was cut into chunks: a
    greedy request returns the same tokens whatever else is batched with it and whether its KV prefix was cached.
    It needs the C kernels (built here on first use; raises ``FreeTokenError`` where they cannot load) and holds
    for CPU tensors. See ``invariant.py`` for the ops it covers and what it costs.
    """
    if on:
        _lib()
    lib = _loaded[0] if _loaded else build.loaded()
    if lib is not None and bool(on) != _deterministic[0]:  # AMX's bf16 mode is not bit-identical: exact while on
        if on:
            _amx_mode_before[0] = int(lib.ft_amx_set_mode(AMX_MODES.index("exact")))
        else:
            lib.ft_amx_set_mode(_amx_mode_before[0])
    _deterministic[0] = bool(on)


def deterministic() -> bool:
    """Whether batch-invariant numerics are on (``set_deterministic``)."""
    return _deterministic[0]


def set_isa(name: str) -> str:
    """Force an ISA path (``best``, ``portable``, ``avx2``, ``avx512vnni``, ``amx``); raises if this CPU lacks it.

    ``amx`` is AVX-512 VNNI plus Intel AMX tiles for Q4_0, Q8_0, Q4_K and Q6_K weights against several tokens at
    once (a prefill step's experts, a quantized linear at M > 1): bit-identical to ``avx512vnni`` except in prompt
    steps, where the default mode runs bf16 tiles (``set_amx_mode``); Linux must grant the process the tile state
    (asked at detection)."""
    if name not in ISA_CODE:
        raise FreeTokenError(f"unknown ISA {name!r}; expected one of {', '.join(ISA_CODE)}")
    got = _lib().ft_set_isa(ISA_CODE[name])
    if got < 0:
        raise FreeTokenError(f"this CPU cannot run the {name} kernels")
    return build.ISA_NAMES[got]


def current_isa() -> str:
    """The ISA path the kernels run now (``set_isa``, ``$FREETOKEN_ISA`` at load, else the best available)."""
    return build.ISA_NAMES[_lib().ft_get_isa()]


def available_isas() -> list[str]:
    """ISA paths this CPU can run, portable first."""
    best = _lib().ft_best_isa()
    return [name for name, code in ISA_CODE.items() if 0 <= code <= best]


def linear(w: PackedWeight, x: torch.Tensor) -> torch.Tensor:
    """``x [M, K] fp32 → x @ W^T [M, N]`` with int8-quantized activations."""
    if x.dim() != 2 or x.shape[1] != w.k:
        raise FreeTokenError(f"linear: x must be [M, {w.k}], got {tuple(x.shape)}")
    if x.dtype is not F32 or not x.is_contiguous():
        x = x.to(F32).contiguous()
    y = torch.empty(x.shape[0], w.n, dtype=F32)
    if (_loaded[0] if _loaded else _lib()).ft_linear(w.code, w.ptr, w.n, w.k, x.data_ptr(), x.shape[0], y.data_ptr()):
        raise MemoryError("ft_linear: out of memory")
    return y


GEMV_MAX_M = 8  # decode-sized products: one weight row meets all of them at once (ft_dense.h)


def fast() -> ctypes.CDLL | None:
    """The kernels if something already loaded them (never builds): the switch for the small fp32 decode ops."""
    return _loaded[0] if _loaded else build.loaded()


def linear_f32(weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] fp32 @ weight [N, K]^T (+ bias [N])`` → fp32 ``[M, N]`` for any M, batch invariant.

    ``weight`` is fp32 or bf16 (widened exactly in the kernel), ``bias`` fp32. Row i of the result is bitwise the
    same whatever M is (one fixed reduction order per row: ``ft_dense.h``). Everything contiguous on the CPU.
    """
    n, k = weight.shape
    m, kx = x.shape if x.dim() == 2 else (0, -1)
    fp32 = weight.dtype is F32
    # one short-circuit chain: a decode step makes ~5 of these calls per layer, each check a few hundred ns
    if not (
        kx == k and (fp32 or weight.dtype is BF16) and x.dtype is F32 and weight.is_contiguous()
        and x.is_contiguous() and weight.is_cpu and x.is_cpu
        and (bias is None or (bias.dtype is F32 and bias.is_contiguous() and bias.is_cpu and bias.shape == (n,)))
    ):  # fmt: skip
        raise FreeTokenError("linear_f32: want contiguous fp32/bf16 weight [N, K], fp32 x [M, K] and bias [N]")
    y = torch.empty(m, n, dtype=F32)  # never the default dtype: the kernel writes fp32
    if m == 0:
        return y
    if (_loaded[0] if _loaded else _lib()).ft_gemm_f32(
        weight.data_ptr() if fp32 else None, None if fp32 else weight.data_ptr(), n, k, x.data_ptr(), m,
        None if bias is None else bias.data_ptr(), y.data_ptr(),
    ):  # fmt: skip
        raise MemoryError("ft_gemm_f32: out of memory")
    return y


def linear_f32_parts(
    weights: tuple[torch.Tensor, ...], x: torch.Tensor, biases: tuple[torch.Tensor | None, ...]
) -> list[torch.Tensor]:
    """``[linear_f32(w, x, b) for w, b in zip(weights, biases)]`` (bitwise) in one call, one hand-out to the pool:
    a decode step's q, k and v projections. Up to 4 fp32 weights ``[N_p, K]``, checked as ``linear_f32`` checks."""
    if not 1 <= len(weights) <= 4 or len(biases) != len(weights):
        raise FreeTokenError("linear_f32_parts: want 1 to 4 weights, one bias (or None) each")
    k = weights[0].shape[1]
    m, kx = x.shape if x.dim() == 2 else (0, -1)
    if not (kx == k and x.dtype is F32 and x.is_contiguous() and x.is_cpu):
        raise FreeTokenError("linear_f32_parts: want fp32 x [M, K] on the CPU")
    outs = []
    for w, b in zip(weights, biases):
        n = w.shape[0]
        if not (
            w.dim() == 2 and w.shape[1] == k and w.dtype is F32 and w.is_contiguous() and w.is_cpu and n > 0
            and (b is None or (b.dtype is F32 and b.is_contiguous() and b.is_cpu and b.shape == (n,)))
        ):  # fmt: skip
            raise FreeTokenError("linear_f32_parts: want contiguous fp32 weights [N, K] (N > 0) and biases [N]")
        outs.append(torch.empty(m, n, dtype=F32))
    if m == 0:
        return outs
    p = len(weights)
    vp, i64 = ctypes.c_void_p * p, ctypes.c_int64 * p
    rc = (_loaded[0] if _loaded else _lib()).ft_gemm_f32_parts(
        p, vp(*[w.data_ptr() for w in weights]), i64(*[w.shape[0] for w in weights]), k, x.data_ptr(), m,
        vp(*[None if b is None else b.data_ptr() for b in biases]), vp(*[y.data_ptr() for y in outs]),
    )  # fmt: skip
    if rc:
        raise FreeTokenError("ft_gemm_f32_parts: bad arguments")
    return outs


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2, -1) + eps) * weight`` over the last dim, fp32; each row reduced in one fixed order
    (batch invariant), on the calling thread for small inputs and on the pool for large ones."""
    dim = x.shape[-1]
    if not (
        x.dtype is F32 and x.is_contiguous() and x.is_cpu
        and (weight is None or (weight.dtype is F32 and weight.is_contiguous() and weight.is_cpu
                                and weight.shape == (dim,)))
    ):  # fmt: skip
        raise FreeTokenError("rms_norm: want contiguous fp32 x [..., D] and weight [D]")
    out = torch.empty_like(x)
    (_loaded[0] if _loaded else _lib()).ft_rms_norm(
        x.data_ptr(), None if weight is None else weight.data_ptr(), x.numel() // max(1, dim), dim, eps,
        out.data_ptr(),
    )  # fmt: skip
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, half: bool) -> torch.Tensor:
    """Rotary embedding of ``x [T, H, Dh]`` by ``cos``/``sin [T, R/2]`` (the first ``R = rotary_dim`` channels of
    each head rotate: pairs ``(i, i + R/2)`` when ``half``, else ``(2i, 2i + 1)``), fp32, on the calling thread."""
    t, h, dh = x.shape
    r2 = rotary_dim // 2
    if (
        rotary_dim % 2 or rotary_dim > dh or cos.shape != (t, r2) or sin.shape != (t, r2)
        or not (x.dtype is F32 and cos.dtype is F32 and sin.dtype is F32)
        or not (x.is_contiguous() and cos.is_contiguous() and sin.is_contiguous())
        or not (x.is_cpu and cos.is_cpu and sin.is_cpu)
    ):  # fmt: skip
        raise FreeTokenError(f"rope: want contiguous fp32 x [T, H, Dh], cos/sin [T, R/2], got {tuple(x.shape)}")
    out = torch.empty_like(x)
    (_loaded[0] if _loaded else _lib()).ft_rope(x.data_ptr(), t, h, dh, rotary_dim, cos.data_ptr(), sin.data_ptr(),
                                                int(half), out.data_ptr())
    return out


KV_TYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float8_e4m3fn: 3}
"""Cache element types the attention kernels read (``ft_attn.h``: FT_KV_F32 / F16 / BF16 / F8, the last float8
e4m3fn)."""


def kv_store(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (fp32, any shape) as the fused decode step writes it into a cache of ``dtype`` (one of
    ``KV_TYPE_CODE``'s): fp16 and fp8 saturate (at ±65504, ±448), every type rounds to nearest even. The pool's torch
    write (``PagePool.write``) gives the same bits; tests hold the two to that."""
    if dtype not in KV_TYPE_CODE:
        raise FreeTokenError(f"kv_store: the kernels store {', '.join(map(str, KV_TYPE_CODE))}, not {dtype}")
    src = x.to(F32).contiguous()
    out = torch.empty(src.shape, dtype=dtype)
    if (_loaded[0] if _loaded else _lib()).ft_kv_store(src.data_ptr(), src.numel(), out.data_ptr(), KV_TYPE_CODE[dtype]):
        raise FreeTokenError("ft_kv_store refused its arguments")
    return out


def _kv_type(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int | None:
    """The kernels' code for k and v's element type (both the same one of ``KV_TYPE_CODE``, q fp32), else None."""
    if q.dtype is not F32 or k.dtype is not v.dtype:
        return None
    return KV_TYPE_CODE.get(k.dtype)


def attn_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    """One query's attention over every cached key: ``q [H, Dh]``, ``k [S, Hkv, Dh]``, ``v [S, Hkv, Dv]`` → ``[H, Dv]``;
    ``sinks [H]`` (GPT-OSS) add one logit per head to the softmax that carries no value.

    q fp32 on the CPU; k and v fp32, or both fp16 or both bf16 (a 16-bit KV cache, read as is: each block is widened
    to fp32 in cache, and everything after is fp32); they may be views with any stride between positions (a paged
    cache's run of pages) but contiguous heads. Split over key blocks on the kernels' pool and merged in fp32
    (``ft_attn.h``). A 16-bit cache gives bitwise what the fp32 one gives on its widened values, except where
    ``attn_uses_amx`` says a bf16 cache runs on AMX tiles: there the result is within fp32 rounding of it (the same
    exact products, summed in another order), and still the same bits alone or in a chunk.
    """
    h, dh = q.shape
    s, hkv, dk = k.shape
    _, hv, dv = v.shape
    kv_type = _kv_type(q, k, v)
    ks, vs = k.stride(), v.stride()
    ok = (
        kv_type is not None and dk == dh and v.shape[0] == s and hv == hkv and s >= 1 and h % hkv == 0
        and q.is_contiguous() and ks[1] == dh and ks[2] == 1 and vs[1] == dv and vs[2] == 1
        and q.is_cpu and k.is_cpu and v.is_cpu
    )  # fmt: skip
    if sinks is not None:
        sinks = sinks.to(torch.float32).contiguous()
        ok = ok and sinks.shape == (h,) and sinks.device.type == "cpu"
    if not ok:
        raise FreeTokenError(
            f"attn_decode: want fp32 q [H, Dh], k [S, Hkv, Dh], v [S, Hkv, Dv] (fp32, or both fp16 or both bf16) with "
            f"contiguous heads, got {tuple(q.shape)}, {tuple(k.shape)} {k.dtype}, {tuple(v.shape)} {v.dtype}"
        )
    out = torch.empty(h, dv, dtype=F32)
    if (_loaded[0] if _loaded else _lib()).ft_attn_decode_kv(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), kv_type, s, h, hkv, dh, dv, ks[0], vs[0], scale,
        None if sinks is None else sinks.data_ptr(), out.data_ptr(),
    ):  # fmt: skip
        raise MemoryError("ft_attn_decode: out of memory")
    return out


def attn_queries(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``q [T, H, Dh]`` over ``k [S, Hkv, Dh]``, ``v [S, Hkv, Dv]`` → ``[T, H, Dv]``: query t sees
    keys ``lo[t] <= s < hi[t]`` (int64 ``[T]``, non-empty ranges); ``sinks [H]`` as in ``attn_decode``.

    Each query is computed exactly as ``attn_decode`` computes it over its keys alone: bitwise the same whether it
    is decoded by itself or inside a prefill chunk. Layout and dtype rules as in ``attn_decode`` (16-bit caches
    too); q contiguous.
    """
    t, h, dh = q.shape
    s, hkv, dk = k.shape
    dv = v.shape[2]
    lo, hi = lo.to(torch.int64).contiguous(), hi.to(torch.int64).contiguous()
    kv_type = _kv_type(q, k, v)
    ok = (
        kv_type is not None and dk == dh and v.shape[:2] == (s, hkv) and s >= 1 and t >= 1 and h % hkv == 0
        and q.is_contiguous() and k.stride()[1:] == (dh, 1) and v.stride()[1:] == (dv, 1)
        and lo.shape == hi.shape == (t,) and all(z.device.type == "cpu" for z in (q, k, v))
        and bool(((lo >= 0) & (hi > lo) & (hi <= s)).all())
    )  # fmt: skip
    if sinks is not None:
        sinks = sinks.to(torch.float32).contiguous()
        ok = ok and sinks.shape == (h,) and sinks.device.type == "cpu"
    if not ok:
        raise FreeTokenError(
            f"attention: want fp32 q [T, H, Dh], k [S, Hkv, Dh], v [S, Hkv, Dv] (fp32, or both fp16 or both bf16) with "
            f"contiguous heads and key ranges 0 <= lo < hi <= S, got {tuple(q.shape)}, {tuple(k.shape)} {k.dtype}, "
            f"{tuple(v.shape)} {v.dtype}"
        )
    out = torch.empty(t, h, dv, dtype=torch.float32)
    if _lib().ft_attn_queries_kv(q.data_ptr(), t, k.data_ptr(), v.data_ptr(), kv_type, lo.data_ptr(), hi.data_ptr(),
                                 h, hkv, dh, dv, k.stride(0), v.stride(0), scale,
                                 None if sinks is None else sinks.data_ptr(), out.data_ptr()):
        raise MemoryError("ft_attn_queries: out of memory")
    return out


def dequantize(w: PackedWeight, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 ``[N, K]`` values of a packed weight (C, multi-threaded); ``out`` may be a reused buffer."""
    if out is None:
        out = torch.empty(w.n, w.k, dtype=torch.float32)
    if tuple(out.shape) != (w.n, w.k) or out.dtype != torch.float32 or not out.is_contiguous():
        raise FreeTokenError(f"dequantize: out must be contiguous fp32 [{w.n}, {w.k}]")
    _lib().ft_dequant(w.code, w.ptr, w.n, w.k, _ptr(out))
    return out


def moe(
    fmt: str,
    w13: torch.Tensor,
    w2: torch.Tensor,
    dims: tuple[int, int],
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    down_fmt: str | None = None,
) -> torch.Tensor:
    """One fused MoE step: ``w13 [E, bytes]`` packed gate|up ``[2I, D]`` in ``fmt``, ``w2 [E, bytes]`` packed down
    ``[D, I]`` in ``down_fmt`` (default ``fmt``; a Q4_K_M file's layers hold Q4_K gate/up and Q6_K down).

    ``dims = (D, I)``; ``x [T, D]``, ``topk_ids [T, K]`` (negative ids are skipped), ``topk_weights [T, K]``.
    """
    d, i = dims
    code13 = FMT_CODE.get(fmt)
    code2 = code13 if down_fmt is None else FMT_CODE.get(down_fmt)
    if code13 is None or code2 is None or (code13 | code2) >= 2:  # names as a backend holds them pass at once;
        fmt = kernel_format(fmt, d)  # aliases, and K-quants (whose rows must be whole super-blocks), are checked
        down_fmt = kernel_format(down_fmt or fmt, i)
        code13, code2 = FMT_CODE[fmt], FMT_CODE[down_fmt]
    e = w13.shape[0]
    if x.dim() != 2 or x.shape[1] != d or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise FreeTokenError(
            f"moe: want x [T, {d}], ids/weights [T, K]; got {tuple(x.shape)}, {tuple(topk_ids.shape)}, "
            f"{tuple(topk_weights.shape)}"
        )
    lib = _loaded[0] if _loaded else _lib()
    return _routed("moe", e, d, x, topk_ids, topk_weights, lambda xp, t, ids, wts, k, out: lib.ft_moe(
        code13, code2, w13.data_ptr(), w13.stride(0), w2.data_ptr(), w2.stride(0), e, d, i, xp, t, ids, wts, k, out))


def _routed(name: str, e: int, d: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
            call: Callable[[int, int, int, int, int, int], int]) -> torch.Tensor:
    """What ``moe`` and ``moe_f32`` share: fp32 x, int64 ids and fp32 weights to ``call(x, T, ids, weights, K, out)``
    (the C function's pointers and return code) → ``out [T, d]``; its failures as errors."""
    x = _f32(x)
    ids = topk_ids if topk_ids.dtype is torch.int64 and topk_ids.is_contiguous() else topk_ids.long().contiguous()
    wts = _f32(topk_weights)
    out = torch.empty(x.shape[0], d, dtype=F32)
    rc = call(x.data_ptr(), x.shape[0], ids.data_ptr(), wts.data_ptr(), ids.shape[1], out.data_ptr())
    if rc == -2:
        raise FreeTokenError(f"{name}: an expert id is >= the number of experts ({e})")
    if rc != 0:
        raise MemoryError(f"ft_{name}: out of memory")
    return out


def moe_f32(gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor, topk_ids: torch.Tensor,
            topk_weights: torch.Tensor) -> torch.Tensor:
    """Routed fp32 experts with SiLU-gated activations, as stored: ``gate_up [E, 2I, D]`` (gate rows, then up rows),
    ``down [E, D, I]``, ``x [T, D]``, ``topk_ids [T, K]`` (negative: skipped), ``topk_weights [T, K]`` →
    ``Σ_k w_k · down_k(silu(gate_k x) · up_k x)`` as fp32 ``[T, D]``, experts added in ascending id order; batch
    invariant (``ft_moe_f32``: every product is ``linear_f32``'s row). bf16 weights (both) are widened in registers:
    the bits of their fp32 copies, half the bytes read."""
    e, i2, d = gate_up.shape
    if (gate_up.dtype not in (F32, BF16) or down.dtype is not gate_up.dtype or down.shape != (e, d, i2 // 2)
            or i2 % 2 or x.dim() != 2 or x.shape[1] != d or topk_ids.shape != topk_weights.shape
            or topk_ids.shape[0] != x.shape[0] or not gate_up.is_contiguous() or not down.is_contiguous()):
        raise FreeTokenError(
            f"moe_f32: want fp32 gate_up [E, 2I, D], down [E, D, I], x [T, D], ids/weights [T, K]; got "
            f"{tuple(gate_up.shape)}, {tuple(down.shape)}, {tuple(x.shape)}, {tuple(topk_ids.shape)}"
        )
    lib = _loaded[0] if _loaded else _lib()
    return _routed("moe_f32", e, d, x, topk_ids, topk_weights, lambda xp, t, ids, wts, k, out: lib.ft_moe_f32(
        gate_up.data_ptr(), down.data_ptr(), int(gate_up.dtype is BF16), e, d, i2 // 2, xp, t, ids, wts, k, out))


def moe_f32_takes(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether ``moe_f32`` / ``expert_f32`` take these tensors as they are: fp32 x on the CPU, contiguous fp32 weights
    (or bf16 ones, widened exactly in registers), the kernels loaded (the activation and biases are the caller's to
    check: SiLU-gated, none)."""
    return (x.dtype is F32 and x.is_cpu and gate_up.dtype in (F32, BF16) and down.dtype is gate_up.dtype
            and gate_up.is_cpu and gate_up.is_contiguous() and down.is_contiguous() and fast() is not None)


def expert_f32(gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """One fp32 SiLU expert on its tokens through ``moe_f32``: ``gate_up [2I, D]``, ``down [D, I]``, ``x [n, D]`` →
    ``[n, D]``, bitwise what a ``moe_f32`` call over all experts computes for these tokens before their weights (so
    a backend that runs its experts one at a time and adds ``y * w`` in id order gets ``moe_f32``'s bits)."""
    n = x.shape[0]
    return moe_f32(gate_up[None], down[None], x, torch.zeros(n, 1, dtype=torch.int64), torch.ones(n, 1, dtype=F32))


def route(logits: torch.Tensor, top_k: int, mode: int, norm: bool, norm_eps: float, scaling: float
          ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Top-k routing of router logits ``[T, E]`` fp32 → ``(ids [T, K] int64, weights [T, K] fp32)`` (``ft_route``:
    mode 0 softmax then top-k, normalized by the chosen sum with ``norm``; mode 1 top-k then softmax over it; times
    ``scaling``; ties go to the lower id). None where the kernels are not loaded (never builds them)."""
    lib = fast()
    if lib is None:
        return None
    logits = logits if logits.is_contiguous() else logits.contiguous()
    t, e = logits.shape
    ids = torch.empty(t, top_k, dtype=torch.int64)
    weights = torch.empty(t, top_k, dtype=F32)
    if lib.ft_route(logits.data_ptr(), t, e, top_k, mode, int(norm), norm_eps, scaling, ids.data_ptr(),
                    weights.data_ptr()):
        raise FreeTokenError(f"route: want 1 <= top_k <= {e} and mode 0 or 1, got {top_k}, {mode}")
    return ids, weights


def set_moe_pass_bytes(nbytes: int) -> int:
    """Work-buffer bytes one pass of ``moe`` may hold (0: the default, 12 MiB); returns the previous value. A long
    prefill step's (token, expert) slots run in passes of whole experts so its working memory stays bounded; the
    result is the same bit for bit for any value (tests use a small one to force many passes)."""
    return int(_lib().ft_moe_set_pass_bytes(max(0, int(nbytes))))


def set_amx_min_tokens(n: int) -> int:
    """Tokens on one weight from which the ``amx`` ISA path runs its tiles (0: the default, 10); fewer run the
    AVX-512 VNNI tile kernels. Returns the previous value. In exact mode the results are the same bit for bit
    either way."""
    return int(_lib().ft_amx_set_min_tokens(max(0, int(n))))


def set_amx_bf16_min_tokens(n: int) -> int:
    """Tokens on one weight from which a call in bf16 mode (``set_amx_mode``) runs the bf16 tiles (0: the default,
    20); between ``set_amx_min_tokens``'s count and this, the exact int8 tiles, which are faster there. Returns the
    previous value."""
    return int(_lib().ft_amx_set_bf16_min_tokens(max(0, int(n))))


def set_amx_mode(mode: str) -> str:
    """The ``amx`` path's numerics for quantized weights (Q4_0, Q8_0, Q4_K, Q6_K) against many tokens; returns the
    previous mode.

    - ``exact``: int8 tiles, every output bit-identical to the AVX-512 VNNI kernels (a token's bits never depend on
      how many tokens share its expert). ``set_deterministic(True)`` holds this mode while it is on.
    - ``bf16``: weights dequantized to bf16 once per 32-row work item, activations rounded to bf16 instead of int8,
      fp32 sums over all of K in the tiles, no per-block scaling: closer to the fp32 product, faster where a weight
      has ``set_amx_bf16_min_tokens`` (20) or more of the call's tokens — the others run exact — (a 512-token MoE
      layer of the 7.5B benchmark model: 44 vs 67 ms), not bit-identical.
    - ``prompts`` (the default): ``bf16`` inside a prompt step (``prompt_step``: the runner's steps that hold only
      prompt chunks), ``exact`` everywhere else, so a decode token and a speculative verify row keep the VNNI
      kernels' bits while a prompt gets the faster product.

    ``$FREETOKEN_AMX_BF16`` picks it at load (``1``: bf16, ``0``: exact, unset: prompts). bf16 needs AMX-BF16 and
    AVX512-BF16 (``amx_bf16_supported``): without them every mode runs exact.
    """
    if mode not in AMX_MODES:
        raise FreeTokenError(f"unknown AMX mode {mode!r}; expected one of {', '.join(AMX_MODES)}")
    return AMX_MODES[int(_lib().ft_amx_set_mode(AMX_MODES.index(mode)))]


def amx_bf16_supported() -> bool:
    """Whether this CPU runs the ``amx`` path's bf16 mode (AMX-BF16 and AVX512-BF16, and the library built for AMX)."""
    return bool(_lib().ft_amx_bf16_supported())


@contextmanager
def prompt_step() -> Iterator[None]:
    """Mark the calling thread's work as a prompt-only step (no decode token, no verify row) while inside: the
    ``prompts`` AMX mode then runs its bf16 tiles (``set_amx_mode``). A no-op where the C library is not loaded."""
    lib = _loaded[0] if _loaded else build.loaded()
    if lib is None:
        yield
        return
    before = lib.ft_amx_prompt_step(1)
    try:
        yield
    finally:
        lib.ft_amx_prompt_step(before)


def set_attn_amx(on: bool) -> bool:
    """Attention over a bf16 cache on AMX-BF16 tiles (opt-in; also ``$FREETOKEN_ATTN_AMX=1`` at load); returns the
    previous setting. Measured on an AMX Xeon, 2 threads, 16/4 heads of 128 over 4,096 keys: 2.0-2.15x the vector loops
    for prefill chunks and verify rows (8 to 512 queries), 0.7x for one decode query (that is bound by reading the
    cache, where the vector loops overlap their loads better). See ``attn_uses_amx``."""
    return bool(_lib().ft_attn_set_amx(int(bool(on))))


def attn_uses_amx(dtype: torch.dtype, head_dim: int, v_head_dim: int | None = None) -> bool:
    """Whether attention over a ``dtype`` cache with these head sizes runs on AMX-BF16 tiles here: turned on
    (``set_attn_amx``), the ``amx`` path is in use, the CPU has AMX-BF16 and AVX512-BF16, the cache is bf16 (read
    into tiles as stored), and both head sizes are multiples of 32. Queries and probabilities go in as three bf16
    parts each (x = hi + mid + lo), so the tile sums hold the exact products of the fp32 operands with the cached
    values: fp32 accuracy, not the vector loops' bits; a query's bits do not depend on the other queries of its call
    (batch invariance holds on this path as on the others)."""
    code = KV_TYPE_CODE.get(dtype)
    dv = head_dim if v_head_dim is None else v_head_dim
    if code is None or (not _loaded and build.load() is None):
        return False
    return bool(_lib().ft_attn_amx_applies(code, head_dim, dv))


def set_attn_bf16_dot(on: bool) -> bool:
    """The score pass over a bf16 cache on AVX512-BF16 dot products (on by default where the CPU has them and an
    AVX-512 path is in use; off with ``$FREETOKEN_ATTN_BF16_DOT=0`` at load); returns the previous setting. On, the
    query rows are rounded to bf16 (as llama.cpp's CPU attention rounds Q to a bf16 cache's type) and each
    VDPBF16PS does two exact products a lane: the pass's arithmetic halves, 1.15x / 1.3x a decode step over 8,192
    keys from memory / cache (16/4 heads of 128, 2 threads, Zen 4). Off, the scores are bitwise the fp32 kernel's
    over the widened cache. Either way a query's bits do not depend on the other queries of its call (a decode
    step, a verify row and a prefill chunk take the same path). See ``attn_uses_bf16_dot``."""
    return bool(_lib().ft_attn_set_bf16_dot(int(bool(on))))


def attn_uses_bf16_dot(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether attention over a ``dtype`` cache rounds its queries to bf16 for AVX512-BF16 dot products here: a bf16
    cache, the mode on (``set_attn_bf16_dot``), an AVX-512 ISA path in use, the CPU has AVX512-BF16. The AMX path,
    where it is turned on, takes precedence (``attn_uses_amx``)."""
    if dtype != torch.bfloat16 or (not _loaded and build.load() is None):
        return False
    return bool(_lib().ft_attn_bf16_dot_applies())


def attn_amx_calls() -> int:
    """Key blocks (up to 128 keys of one kv head for some queries) attention has run on AMX tiles since the library
    loaded: proof in tests and benchmarks that the tile path did the work."""
    return int(_lib().ft_attn_amx_calls())


def amx_calls() -> int:
    """How many pieces of work (16 weight rows in exact mode, a 32-row item in bf16 mode) the ``amx`` path has
    computed since the library loaded (0 where it never ran): proof in tests and benchmarks that the tiles, not the
    fallback, did the work."""
    return int(_lib().ft_amx_calls())


QUANT_INPUT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # read as is (widened per block in C)


def _quant_shape(w: torch.Tensor) -> tuple[int, int]:
    if w.dim() != 2:
        raise FreeTokenError(f"quantize expects a 2-D weight, got shape {tuple(w.shape)}")
    return w.shape[0], w.shape[1]


def _quantize_into(w: torch.Tensor, fmt: str, refine: bool, out: torch.Tensor, packed: bool) -> None:
    if w.device.type != "cpu":
        w = w.cpu()
    if w.dtype not in QUANT_INPUT:
        w = w.float()
    w = w.contiguous()
    n, k = w.shape
    rc = _lib().ft_quantize(FMT_CODE[fmt], QUANT_INPUT[w.dtype], w.data_ptr(), n, k, out.data_ptr(), int(refine),
                            int(packed))
    if rc & 2:
        raise MemoryError("ft_quantize: out of memory")
    if rc & 1:
        raise FreeTokenError("cannot quantize a weight that holds inf or nan")


def quantize(w: torch.Tensor, fmt: str, refine: bool = True) -> BlockQuantized:
    """C twin of ``runtime.quant.quantize`` (same rules, multi-threaded): ``w [N, K]`` → GGUF blocks.

    fp32, bf16 and fp16 weights are read in place (no fp32 copy); other dtypes are converted first. Raises
    ``FreeTokenError`` when ``w`` holds inf or nan (the C quantizer checks every value it reads)."""
    fmt = canonical_format(fmt)
    n, k = _quant_shape(w)
    out = torch.empty(n, -(-k // BLOCK), BLOCK_BYTES[fmt], dtype=torch.uint8)
    _quantize_into(w, fmt, refine, out, packed=False)
    return BlockQuantized(fmt, (n, k), out)


def quantize_packed(w: torch.Tensor, fmt: str, refine: bool = True) -> torch.Tensor:
    """``w [N, K]`` → the kernels' tile layout, flat uint8 (``packed_bytes(fmt, N, K)``): the bytes of
    ``layout.pack_blocks(quantize(w, fmt, refine).blocks)``, written by the quantizer directly (no torch repack)."""
    fmt = canonical_format(fmt)
    n, k = _quant_shape(w)
    out = torch.empty(packed_bytes(fmt, n, k), dtype=torch.uint8)
    _quantize_into(w, fmt, refine, out, packed=True)
    return out


def quantize_blocks(w: torch.Tensor, fmt: str) -> BlockQuantized:
    """GGUF blocks of ``w [N, K]`` by the C quantizer when the kernels load (~10x faster), else by the plain-torch
    one (``runtime.quant.quantize``: the same rules, the same bytes)."""
    if build.load() is not None:
        return quantize(w, fmt)
    from ..quant.blocks import quantize as torch_quantize

    return torch_quantize(w, fmt)


def read_bandwidth_gbps(nbytes: int = 256 << 20, reps: int = 5) -> float:
    """Streaming read bandwidth with the kernels' current thread count (GB/s, best of ``reps``)."""
    buf = torch.ones(nbytes, dtype=torch.uint8)
    seconds = _lib().ft_read_bandwidth(_ptr(buf), nbytes, reps)
    return nbytes / seconds / 1e9
