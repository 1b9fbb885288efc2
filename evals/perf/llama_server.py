"""llama.cpp's ``llama-server`` as a benchmark peer: the build recipe and where the binary lives.

The sources come from PyPI only: the ``llama-cpp-python`` sdist vendors llama.cpp under ``vendor/llama.cpp``.
``build_peer`` downloads that sdist with pip (no other network), unpacks it and builds just the ``llama-server``
target with CMake (Release, ``GGML_NATIVE``, no curl, no OpenSSL, no web UI download) into a cache folder:

    python -m freetoken_agent.evals.perf.bench_concurrent build-peer [--cache DIR] [--version 0.3.36] [--jobs 2]

Takes 15-40 minutes on two cores; a finished build is reused. ``--python`` also builds ``llama-quantize`` and
``llama-bench`` and installs ``llama-cpp-python`` (the same sdist) bound to this build's shared libraries instead of
compiling llama.cpp a second time (``install_binding``: under a minute), which the GGUF comparisons and ``suite`` use. ``find_peer`` returns the binary or None with the
reason in ``why_missing`` (``$FREETOKEN_LLAMA_SERVER`` names a binary of your own).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from freetoken_agent.runtime import hardware

DEFAULT_CACHE = Path("/tmp/freetoken-llama-server")
DEFAULT_VERSION = "0.3.36"
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DGGML_NATIVE=ON",
    "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
)  # fmt: skip
"""``LLAMA_USE_PREBUILT_UI`` defaults to ON and would fetch the web UI from Hugging Face at configure time."""


def binary_path(cache: Path = DEFAULT_CACHE) -> Path:
    return cache / "build" / "bin" / "llama-server"


def why_missing(cache: Path = DEFAULT_CACHE) -> str:
    """One line: why ``find_peer`` found no binary."""
    override = os.environ.get("FREETOKEN_LLAMA_SERVER")
    if override:
        return f"$FREETOKEN_LLAMA_SERVER={override} is not an executable file"
    return (f"no llama-server at {binary_path(cache)} "
            "(build it: python -m freetoken_agent.evals.perf.bench_concurrent build-peer)")


def find_peer(cache: Path = DEFAULT_CACHE) -> Path | None:
    """The ``llama-server`` binary: ``$FREETOKEN_LLAMA_SERVER``, else the one ``build_peer`` made in ``cache``."""
    override = os.environ.get("FREETOKEN_LLAMA_SERVER")
    path = Path(override) if override else binary_path(cache)
    return path if path.is_file() and os.access(path, os.X_OK) else None


NO_AMX = ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")


def _run(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> None:
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    with log.open("a") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=False, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed (exit {done.returncode}); see {log}")


def source_dir(cache: Path, version: str) -> Path:
    """``vendor/llama.cpp`` of the unpacked ``llama-cpp-python`` sdist, downloaded with pip when absent."""
    src = cache / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if (src / "CMakeLists.txt").is_file():
        return src
    cache.mkdir(parents=True, exist_ok=True)
    sdist = cache / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.is_file():
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(cache),
              f"llama-cpp-python=={version}"], cache / "build-peer.log")
    with tarfile.open(sdist) as tar:
        tar.extractall(cache, filter="data")
    if not (src / "CMakeLists.txt").is_file():
        raise RuntimeError(f"{sdist} has no vendor/llama.cpp/CMakeLists.txt")
    return src


def build_peer(cache: Path = DEFAULT_CACHE, version: str = DEFAULT_VERSION, jobs: int = 2) -> Path:
    """Build ``llama-server`` from the ``llama-cpp-python`` sdist into ``cache/build``; returns the binary."""
    binary = binary_path(cache)
    if binary.is_file():
        return binary
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"{tool} not found (apt-get update && apt-get install -y cmake build-essential)")
    src = source_dir(cache, version)
    log = cache / "build-peer.log"
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    env, isa = None, []
    simd = hardware.describe()[1]["simd"]
    if "amx_tile" in simd:
        # ggml's AMX matmul crashed on these machines. -mno-amx-* in CFLAGS alone is not enough: GGML_NATIVE appends
        # -march=native after it (AMX back on), so name the ISA explicitly instead, AMX left out.
        isa = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
               "-DGGML_AVX512=ON", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
        isa += [f"-DGGML_{f.upper()}=ON" for f in ("avx512_vnni", "avx512_bf16") if f in simd]
        flags = " ".join(NO_AMX)
        env = {**os.environ, "CFLAGS": f"{os.environ.get('CFLAGS', '')} {flags}".strip(),
               "CXXFLAGS": f"{os.environ.get('CXXFLAGS', '')} {flags}".strip()}
    _run(["cmake", "-S", str(src), "-B", str(cache / "build"), *generator, *CMAKE_FLAGS, *isa], log, env)
    _run(["cmake", "--build", str(cache / "build"), "--target", "llama-server", f"-j{jobs}"], log)
    if not binary.is_file():
        raise RuntimeError(f"the build finished without {binary}; see {log}")
    return binary


TOOLS = ("llama-quantize", "llama-bench")


def install_binding(cache: Path = DEFAULT_CACHE, version: str = DEFAULT_VERSION, jobs: int = 2) -> Path:
    """Build ``TOOLS`` beside the server and install ``llama-cpp-python`` ``version`` without its own copy of
    llama.cpp (``-DLLAMA_BUILD=OFF``), its ``lib/`` filled with this build's shared libraries; returns that folder."""
    import importlib.util

    build_peer(cache, version, jobs)
    log = cache / "build-peer.log"
    _run(["cmake", "--build", str(cache / "build"), "--target", *TOOLS, f"-j{jobs}"], log)
    sdist = cache / f"llama_cpp_python-{version}.tar.gz"
    env = {**os.environ, "CMAKE_ARGS": "-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF -DMTMD_BUILD=OFF"}
    _run([sys.executable, "-m", "pip", "install", str(sdist)], log, env)
    spec = importlib.util.find_spec("llama_cpp")  # not imported: without its libraries the import raises
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"pip installed llama-cpp-python but it is not importable here; see {log}")
    lib = Path(list(spec.submodule_search_locations)[0]) / "lib"
    lib.mkdir(exist_ok=True)
    libs = sorted((cache / "build" / "bin").glob("lib*.so*"))
    if not any(p.name.startswith("libllama.so") for p in libs):
        raise RuntimeError(f"no libllama.so in {cache / 'build' / 'bin'} (a static build?); see {log}")
    for so in libs:
        target = lib / so.name
        target.unlink(missing_ok=True)
        shutil.copy2(so, target, follow_symlinks=False)
    return lib
