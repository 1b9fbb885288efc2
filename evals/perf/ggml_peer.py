"""ggml as the benchmark peer: its CPU mat-mul on Q4_0 / Q4_K / Q8_0 weights, driven through ctypes.

Uses the ggml shared libraries that ``llama-cpp-python`` ships (``llama_cpp/lib/libggml-base.so`` and
``libggml-cpu.so``): one ``mul_mat`` graph per weight copy, planned once with a persistent ggml threadpool, so a
timed call is exactly one ``ggml_graph_compute`` (the way llama.cpp runs a layer), with no per-call setup.
Optional: when the package is missing every function here reports that, and the benchmark omits the peer rows.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path as FsPath

import torch

GGML_TYPES = {"q4_0": 2, "q8_0": 8, "q4_k": 12}
GGML_F32 = 0

_reason: list[str] = []


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


class _CPlan(ctypes.Structure):
    _fields_ = [
        ("work_size", ctypes.c_size_t),
        ("work_data", ctypes.c_void_p),
        ("n_threads", ctypes.c_int),
        ("threadpool", ctypes.c_void_p),
        ("abort_callback", ctypes.c_void_p),
        ("abort_callback_data", ctypes.c_void_p),
        ("use_ref", ctypes.c_bool),
    ]


def _lib_dir() -> FsPath | None:
    override = os.environ.get("FREETOKEN_GGML_LIB_DIR")  # a ggml build of your own (libggml-base.so, libggml-cpu.so)
    if override:
        return FsPath(override)
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        _reason.append("llama-cpp-python is not installed")
        return None
    d = FsPath(list(spec.submodule_search_locations)[0]) / "lib"
    if not (d / "libggml-base.so").exists() or not (d / "libggml-cpu.so").exists():
        _reason.append(f"no libggml-base.so / libggml-cpu.so in {d}")
        return None
    return d


class GgmlPeer:
    """ggml's CPU mat-mul as a benchmark path; ``paths()`` builds timed calls, ``release()`` frees them."""

    def __init__(self, lib_dir: FsPath, version: str) -> None:
        self.version = version
        g = ctypes.CDLL(str(lib_dir / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
        cpu = ctypes.CDLL(str(lib_dir / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
        p, i64, sz = ctypes.c_void_p, ctypes.c_int64, ctypes.c_size_t
        for lib, name, res, args in [
            (g, "ggml_init", p, [_InitParams]),
            (g, "ggml_free", None, [p]),
            (g, "ggml_new_tensor_2d", p, [p, ctypes.c_int, i64, i64]),
            (g, "ggml_mul_mat", p, [p, p, p]),
            (g, "ggml_new_graph", p, [p]),
            (g, "ggml_build_forward_expand", None, [p, p]),
            (g, "ggml_get_data", p, [p]),
            (g, "ggml_nbytes", sz, [p]),
            (g, "ggml_row_size", sz, [ctypes.c_int, i64]),
            (g, "ggml_tensor_overhead", sz, []),
            (g, "ggml_graph_overhead", sz, []),
            (g, "ggml_quantize_chunk", sz, [ctypes.c_int, p, p, i64, i64, i64, p]),
            (g, "ggml_threadpool_params_init", None, [p, ctypes.c_int]),
            (cpu, "ggml_cpu_init", None, []),
            (cpu, "ggml_threadpool_new", p, [p]),
            (cpu, "ggml_threadpool_free", None, [p]),
            (cpu, "ggml_graph_plan", _CPlan, [p, ctypes.c_int, p]),
            (cpu, "ggml_graph_compute", ctypes.c_int, [p, ctypes.POINTER(_CPlan)]),
        ]:
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
            setattr(self, name, fn)
        self.ggml_cpu_init()
        self._ctxs: list[int] = []
        self._keep: list[object] = []
        self._pools: dict[int, int] = {}

    def _pool(self, threads: int) -> int:
        if threads not in self._pools:
            params = ctypes.create_string_buffer(4096)  # ggml_threadpool_params is ~530 bytes
            self.ggml_threadpool_params_init(params, threads)
            self._pools[threads] = self.ggml_threadpool_new(params)
        return self._pools[threads]

    def paths(
        self, n: int, k: int, m: int, x: torch.Tensor, threads: int, copies_for: Callable[[int], int],
        alloc: Callable[[int], torch.Tensor] | None = None,
    ) -> list:
        """One path per ggml format for ``y = x @ W^T`` with ``W [n, k]`` (ggml: weight ne = [k, n]). ``alloc``
        (bytes → uint8 tensor) provides each ggml context's memory (the benchmark's 2 MiB pages); default: ggml's."""
        from .bench_kernels import Path

        out = []
        w = torch.randn(n, k)
        x = x.contiguous()
        for fmt, gtype in GGML_TYPES.items():
            if fmt == "q4_k" and k % 256:
                continue
            nbytes = self.ggml_row_size(gtype, k) * n
            copies = copies_for(nbytes)
            overhead = self.ggml_tensor_overhead() * (3 * copies + 2) + self.ggml_graph_overhead() * copies
            mem = overhead + copies * (nbytes + n * m * 4 + 64) + k * m * 4 + (1 << 20)
            buf = alloc(mem) if alloc is not None else None
            if buf is not None:
                self._keep.append(buf)
            ctx = self.ggml_init(_InitParams(mem, None if buf is None else buf.data_ptr(), False))
            if not ctx:
                raise MemoryError(f"ggml_init could not allocate {mem} bytes")
            self._ctxs.append(ctx)
            xt = self.ggml_new_tensor_2d(ctx, GGML_F32, k, m)
            ctypes.memmove(self.ggml_get_data(xt), x.data_ptr(), k * m * 4)
            plans = []
            work_size = 0
            graphs = []
            for c in range(copies):
                wt = self.ggml_new_tensor_2d(ctx, gtype, k, n)
                if c == 0:
                    self.ggml_quantize_chunk(gtype, w.data_ptr(), self.ggml_get_data(wt), 0, n, k, None)
                    first = self.ggml_get_data(wt)
                else:
                    ctypes.memmove(self.ggml_get_data(wt), first, nbytes)
                y = self.ggml_mul_mat(ctx, wt, xt)
                gf = self.ggml_new_graph(ctx)
                self.ggml_build_forward_expand(gf, y)
                plan = self.ggml_graph_plan(gf, threads, self._pool(threads))
                work_size = max(work_size, plan.work_size)
                graphs.append(gf)
                plans.append(plan)
            work = ctypes.create_string_buffer(max(1, work_size))
            self._keep.append(work)
            for plan in plans:
                plan.work_data = ctypes.cast(work, ctypes.c_void_p)
                plan.work_size = work_size
            self._keep.append(plans)
            refs = [ctypes.byref(pl) for pl in plans]
            compute = self.ggml_graph_compute

            def run(i: int, graphs: list = graphs, refs: list = refs) -> int:
                return compute(graphs[i], refs[i])

            out.append(Path(f"ggml-{fmt}", fmt, nbytes, copies, run))
        return out

    def check(self, n: int = 64, k: int = 256) -> float:
        """Relative error of ggml's Q8_0 mat-mul against fp32 torch (sanity check that the binding is right)."""
        x, w = torch.randn(2, k), torch.randn(n, k)
        ctx = self.ggml_init(_InitParams(1 << 24, None, False))
        try:
            xt = self.ggml_new_tensor_2d(ctx, GGML_F32, k, 2)
            ctypes.memmove(self.ggml_get_data(xt), x.data_ptr(), k * 2 * 4)
            wt = self.ggml_new_tensor_2d(ctx, GGML_TYPES["q8_0"], k, n)
            self.ggml_quantize_chunk(GGML_TYPES["q8_0"], w.data_ptr(), self.ggml_get_data(wt), 0, n, k, None)
            y = self.ggml_mul_mat(ctx, wt, xt)
            gf = self.ggml_new_graph(ctx)
            self.ggml_build_forward_expand(gf, y)
            plan = self.ggml_graph_plan(gf, 1, self._pool(1))
            work = ctypes.create_string_buffer(max(1, plan.work_size))
            plan.work_data = ctypes.cast(work, ctypes.c_void_p)
            self.ggml_graph_compute(gf, ctypes.byref(plan))
            got = torch.empty(2, n)
            ctypes.memmove(got.data_ptr(), self.ggml_get_data(y), 2 * n * 4)
        finally:
            self.ggml_free(ctx)
        ref = x @ w.T
        return float((got - ref).norm() / ref.norm())

    def release(self) -> None:
        """Free every context the paths allocated (the threadpools are kept for the next rows)."""
        for ctx in self._ctxs:
            self.ggml_free(ctx)
        self._ctxs.clear()
        self._keep.clear()


_peer: list[GgmlPeer | None] = []


def load() -> GgmlPeer | None:
    """The ggml peer, or ``None`` (see ``unavailable_reason()``)."""
    if _peer:
        return _peer[0]
    peer = None
    d = _lib_dir()
    if d is not None:
        try:
            from importlib.metadata import version

            try:
                label = f"llama-cpp-python {version('llama-cpp-python')}"
            except ImportError:
                label = f"ggml from {d}"
            peer = GgmlPeer(d, label)
        except (OSError, AttributeError) as exc:
            _reason.append(f"cannot bind ggml: {exc}")
    _peer.append(peer)
    return peer


def unavailable_reason() -> str:
    return _reason[-1] if _reason else "available"
