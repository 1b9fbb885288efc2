"""Build the C expert kernels at first use and load them with ctypes.

The library is compiled with the system C compiler into a per-user cache
(``$FREETOKEN_CACHE`` or ``$XDG_CACHE_HOME/freetoken`` or ``~/.cache/freetoken``, then ``kernels/<hash>.so``), keyed
by a hash of the sources, flags and compiler, so a source change rebuilds and concurrent builds never collide
(each writes a temp file, then renames). No Python C-API and no torch headers: it works with any Python/torch.
Set ``FREETOKEN_KERNELS=off`` to force the torch fallback.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"
CFLAGS = ("-O3", "-std=c11", "-shared", "-fPIC", "-pthread", "-fno-strict-aliasing")

_lock = threading.Lock()
_state: dict[str, object] = {}


@dataclass(frozen=True)
class KernelStatus:
    """Whether the C kernels are usable here, and why not when they are not."""

    available: bool
    path: str | None
    isa: str
    reason: str


def cache_dir() -> Path:
    """The per-user folder compiled kernels are cached in."""
    root = os.environ.get("FREETOKEN_CACHE")
    if root:
        return Path(root) / "kernels"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg or Path.home() / ".cache") / "freetoken" / "kernels"


def find_compiler() -> str | None:
    """The C compiler to use: ``$CC``, else ``cc``/``gcc``/``clang`` on PATH."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _compiler_id(cc: str) -> str:
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    return out.splitlines()[0] if out else cc


def build(force: bool = False) -> Path:
    """Compile the library (if not cached) and return its path; raises ``RuntimeError`` with the compiler's words."""
    cc = find_compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc or clang)")
    digest = hashlib.sha256()
    for src in sorted(CSRC.glob("*.[ch]")):  # every source and header: any edit rebuilds
        digest.update(src.name.encode() + src.read_bytes())
    digest.update(" ".join(CFLAGS).encode())
    digest.update(_compiler_id(cc).encode())
    out = cache_dir() / f"ft_kernels-{digest.hexdigest()[:16]}.so"
    if out.exists() and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cc, *CFLAGS, str(CSRC / "ft_kernels.c"), "-o", tmp, "-lm"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        os.unlink(tmp)
        first = (proc.stderr.strip().splitlines() or ["(no output)"])[0]
        raise RuntimeError(f"compiling the CPU kernels failed: {first}")
    os.replace(tmp, out)
    return out


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32, f64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_double
    sigs: dict[str, tuple[object, list[object]]] = {
        "ft_packed_bytes": (i64, [i32, i64, i64]),
        "ft_best_isa": (i32, []),
        "ft_get_isa": (i32, []),
        "ft_set_isa": (i32, [i32]),
        "ft_set_threads": (i32, [i32]),
        "ft_get_threads": (i32, []),
        "ft_set_spin_us": (i32, [i32]),
        "ft_linear": (i32, [i32, p, i64, i64, p, i64, p]),
        "ft_dequant": (None, [i32, p, i64, i64, p]),
        "ft_quantize": (i32, [i32, i32, p, i64, i64, p, i32, i32]),
        "ft_read_bandwidth": (f64, [p, i64, i32]),
        "ft_moe": (i32, [i32, i32, p, i64, p, i64, i64, i64, i64, p, i64, p, p, i64, p]),
        "ft_moe_set_pass_bytes": (ctypes.c_size_t, [ctypes.c_size_t]),
        "ft_amx_set_min_tokens": (i64, [i64]),
        "ft_amx_set_bf16_min_tokens": (i64, [i64]),
        "ft_amx_calls": (i64, []),
        "ft_amx_set_mode": (i32, [i32]),
        "ft_amx_prompt_step": (i32, [i32]),
        "ft_amx_bf16_supported": (i32, []),
        "ft_gemm_f32": (i32, [p, p, i64, i64, p, i64, p, p]),
        "ft_gemm_f32_parts": (i32, [i32, p, p, i64, p, i64, p, p]),
        "ft_moe_f32": (i32, [p, p, i32, i64, i64, i64, p, i64, p, p, i64, p]),
        "ft_rms_norm": (None, [p, p, i64, i64, ctypes.c_float, p]),
        "ft_rope": (None, [p, i64, i64, i64, i64, p, p, i32, p]),
        "ft_attn_decode": (i32, [p, p, p, i64, i64, i64, i64, i64, i64, i64, ctypes.c_float, p, p]),
        "ft_attn_queries": (i32, [p, i64, p, p, p, p, i64, i64, i64, i64, i64, i64, ctypes.c_float, p, p]),
        "ft_attn_decode_kv": (i32, [p, p, p, i32, i64, i64, i64, i64, i64, i64, i64, ctypes.c_float, p, p]),
        "ft_attn_queries_kv": (i32, [p, i64, p, p, i32, p, p, i64, i64, i64, i64, i64, i64, ctypes.c_float, p, p]),
        "ft_attn_amx_applies": (i32, [i32, i64, i64]),
        "ft_attn_amx_calls": (i64, []),
        "ft_attn_set_amx": (i32, [i32]),
        "ft_attn_bf16_dot_applies": (i32, []),
        "ft_attn_set_bf16_dot": (i32, [i32]),
        "ft_attn_step_work": (i64, [p]),
        "ft_kv_store": (i32, [p, i64, p, i32]),
        "ft_attn_step": (i32, [p, i64, p, p, p, p, p, p, i32, i64, i64, i64, p, p, p, p]),
        "ft_attn_steps": (i32, [i64, p, i64, p, p, p, p, p, p, i32, p, p, i64, p, p, p, p, p]),
        "ft_route": (i32, [p, i64, i64, i64, i32, i32, ctypes.c_float, ctypes.c_float, p, p]),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args


def loaded() -> ctypes.CDLL | None:
    """The library if an earlier ``load()`` got it; never builds or loads."""
    lib = _state.get("lib")
    return lib if isinstance(lib, ctypes.CDLL) else None


def load() -> ctypes.CDLL | None:
    """The loaded library, building it on first use; ``None`` when unavailable (see ``status()`` for why)."""
    with _lock:
        if "lib" in _state:
            return _state["lib"]  # type: ignore[return-value]
        lib: ctypes.CDLL | None = None
        if os.environ.get("FREETOKEN_KERNELS", "").lower() in ("off", "0", "torch"):
            _state["reason"] = "disabled by FREETOKEN_KERNELS"
        else:
            try:
                path = build()
                lib = ctypes.CDLL(str(path))
                _declare(lib)
                _state["path"] = str(path)
                _state["reason"] = "ok"
                from .threads import default_threads

                lib.ft_set_threads(default_threads())
                spin = os.environ.get("FREETOKEN_CPU_SPIN_US", "")
                if spin.isdigit():  # how long idle workers poll before sleeping (default 5 ms)
                    lib.ft_set_spin_us(int(spin))
                _pin_isa(lib, os.environ.get("FREETOKEN_ISA", ""))
            except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
                lib = None
                _state["reason"] = str(exc)
        _state["lib"] = lib
        return lib


ISA_NAMES = {0: "portable", 1: "avx2", 2: "avx512vnni", 3: "amx"}


def _pin_isa(lib: ctypes.CDLL, name: str) -> None:
    """``$FREETOKEN_ISA`` (``portable``, ``avx2``, ``avx512vnni``, ``amx``): run that path instead of the best one,
    e.g. to compare paths in whole-model benchmarks. One this CPU lacks, or a misspelt one, warns and keeps the best."""
    name = name.strip().lower()
    if not name or name == "best":
        return
    code = {v: k for k, v in ISA_NAMES.items()}.get(name)
    if code is None or lib.ft_set_isa(code) < 0:
        import warnings

        why = "unknown" if code is None else "not supported by this CPU"
        warnings.warn(f"FREETOKEN_ISA={name!r} is {why}; running {ISA_NAMES.get(lib.ft_best_isa(), '?')} "
                      f"(choices: {', '.join(ISA_NAMES.values())})", stacklevel=2)


def status() -> KernelStatus:
    """Build/load the kernels if needed and report whether they are in use (for ``freetoken doctor``)."""
    lib = load()
    if lib is None:
        return KernelStatus(False, None, "torch", f"torch fallback: {_state.get('reason')}")
    return KernelStatus(True, str(_state.get("path")), ISA_NAMES.get(lib.ft_best_isa(), "?"), "ok")
