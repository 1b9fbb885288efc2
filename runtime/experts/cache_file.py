"""The disk tier: an expert-major cache file, one contiguous aligned blob per (layer, expert).

File layout: ``FTEXPRT1`` magic, a little-endian u64 header length, a JSON header (layout, MoE layer indices,
experts per layer, blob stride, and one layout per MoE layer, ``layouts``, where the layers' layouts differ), zero
padding to ``PAGE``; then blob ``(j, e)`` of the j-th MoE layer at ``data_start + (j * E + e) * stride`` (``stride``
is a multiple of ``PAGE``, so every blob starts page-aligned); then a trailer: ``FTXCRC32``, u64 data bytes, u32 CRC-32 of the whole data region (``verify`` checks it; files
from before the trailer existed read fine and only fail ``verify``).

Layers may differ in their blob layout (a Q4_K_M GGUF file: Q6_K down in some layers, Q4_K in the others): the
header's ``layout`` is then the widest one, whose size every slot and every blob's ``stride`` has, and ``layout_of``
gives each layer's own.

It is written once per (checkpoint, format) from ``ExpertSource`` (or a GGUF file's expert blocks) one expert at a
time — the checkpoint is never materialized — into a temp file, flushed to disk (fsync) and renamed into place, so
a crash never leaves a half-written cache behind. Every ``WRITE_CHUNK`` bytes the written part goes to disk and leaves the page cache, so
writing a file of any size holds at most that much dirty cache (a cgroup counts it; a cgroup v1 limit can kill a
writer whose dirty pages outrun the disk). Reads are
plain ``pread`` into a slot row; ``drop_cache=True`` also tells the OS to drop the pages it just read, so the cache
file costs no page-cache memory beyond the budget (and "disk" reads really come from the disk).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
import sys
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from freetoken_agent.runtime.errors import CorruptCheckpointError, FreeTokenError
from freetoken_agent.runtime.experts.layout import ExpertLayout

MAGIC = b"FTEXPRT1"
PAGE = 4096
VERSION = 1
TRAILER_MAGIC = b"FTXCRC32"
TRAILER = struct.Struct("<8sQI")
"""magic, data bytes, CRC-32 of the data region (after the last blob)."""
WRITE_CHUNK = 32 * 2**20
"""Bytes written between two syncs that also drop the written pages from the page cache."""


def _round(n: int, to: int) -> int:
    return -(-n // to) * to


def cache_root() -> Path:
    """``$FREETOKEN_CACHE/experts`` (default ``~/.cache/freetoken/experts``)."""
    return Path(os.environ.get("FREETOKEN_CACHE", Path.home() / ".cache" / "freetoken")) / "experts"


def cache_key(model_path: Path, layout: ExpertLayout, files: list[Path] | None = None,
              layouts: dict[int, ExpertLayout] | None = None) -> str:
    """Identifies a cache file: the checkpoint's files (names, sizes, mtimes; default: a folder's safetensors and
    ``config.json``, a GGUF model passes its parts) and the blob layout (each MoE layer's, where ``layouts`` differ)."""
    h = hashlib.sha256(f"v{VERSION}".encode())
    for f in files if files is not None else sorted(model_path.glob("*.safetensors")) + [model_path / "config.json"]:
        if f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    h.update(json.dumps(layout.to_json(), sort_keys=True).encode())
    if _differing(layout, layouts):
        h.update(json.dumps({k: v.to_json() for k, v in sorted(layouts.items())}, sort_keys=True).encode())
    return h.hexdigest()[:20]


def _differing(layout: ExpertLayout, layouts: dict[int, ExpertLayout] | None) -> bool:
    """Whether some layer's layout in ``layouts`` is not ``layout`` (the file then records each layer's)."""
    return layouts is not None and any(v != layout for v in layouts.values())


class ExpertCacheFile:
    """An open expert cache file: ``read_into(j, e, row)`` fills one slot row with expert ``e`` of MoE layer ``j``."""

    def __init__(self, path: Path, drop_cache: bool = False) -> None:
        self.path = path
        self.drop_cache = drop_cache
        self._fd = -1
        try:
            with path.open("rb") as fh:
                head = fh.read(16)
                if len(head) < 16 or head[:8] != MAGIC:
                    raise CorruptCheckpointError(f"{path}: not an expert cache file")
                (n,) = struct.unpack("<Q", head[8:16])
                if n > path.stat().st_size - 16:
                    raise CorruptCheckpointError(f"{path}: header length {n} exceeds the file")
                meta = json.loads(fh.read(n).decode("utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CorruptCheckpointError(f"{path}: unreadable expert cache file ({exc})") from None
        self.layout = ExpertLayout(**meta["layout"])
        """The slots' layout: the widest of the layers' (every layer's when they share one)."""
        self.layers: list[int] = meta["layers"]
        self.num_experts: int = meta["num_experts"]
        self.stride: int = meta["stride"]
        self.data_start: int = meta["data_start"]
        per_layer = meta.get("layouts")
        self.layouts: dict[int, ExpertLayout] = (
            {layer: ExpertLayout(**j) for layer, j in zip(self.layers, per_layer, strict=True)} if per_layer
            else dict.fromkeys(self.layers, self.layout))
        """MoE layer → the layout of its blobs."""
        if any(lay.blob_bytes > self.stride for lay in self.layouts.values()):
            raise CorruptCheckpointError(f"{path}: a layer's expert blobs are larger than the file's stride")
        expected = self.data_start + len(self.layers) * self.num_experts * self.stride
        if path.stat().st_size < expected:
            raise CorruptCheckpointError(f"{path}: truncated expert cache file")
        self._index = {layer: j for j, layer in enumerate(self.layers)}
        self._fd = os.open(path, os.O_RDONLY)

    def offset(self, layer: int, expert: int) -> int:
        return self.data_start + (self._index[layer] * self.num_experts + expert) * self.stride

    def layout_of(self, layer: int) -> ExpertLayout:
        """The layout of MoE layer ``layer``'s blobs."""
        return self.layouts[layer]

    def read_into(self, layer: int, expert: int, row: torch.Tensor) -> int:
        """Read one blob into ``row`` (contiguous uint8 of at least ``layout_of(layer).blob_bytes``); returns bytes
        read."""
        n = self.layouts[layer].blob_bytes
        view = memoryview(row.numpy()).cast("B")[:n]
        off = self.offset(layer, expert)
        got = os.preadv(self._fd, [view], off)
        if got != n:
            raise CorruptCheckpointError(f"{self.path}: short read of expert {expert} of layer {layer}")
        if self.drop_cache:
            os.posix_fadvise(self._fd, off, n, os.POSIX_FADV_DONTNEED)
        return n

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        self.close()

    @property
    def nbytes(self) -> int:
        """Bytes of expert data (all layers, all experts)."""
        return self.num_experts * sum(lay.blob_bytes for lay in self.layouts.values())

    @property
    def data_bytes(self) -> int:
        """Bytes of the data region (every blob with its padding to ``stride``)."""
        return len(self.layers) * self.num_experts * self.stride

    def verify(self) -> str | None:
        """Check the data region against the writer's checksum; returns what is wrong, or ``None`` when intact.

        Reads the whole data region through a read-only mapping (no copy; CRC-32 runs at several GB/s, and the
        pages read stay in the page cache for whoever maps the file next).
        """
        end = self.data_start + self.data_bytes
        raw = os.pread(self._fd, TRAILER.size, end)
        if len(raw) < TRAILER.size:
            return "no checksum: written by an older version"
        magic, n, want = TRAILER.unpack(raw)
        if magic != TRAILER_MAGIC or n != self.data_bytes:
            return "checksum trailer damaged"
        with mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ) as mm, memoryview(mm) as view:
            crc = zlib.crc32(view[self.data_start : end])
        return None if crc == want else "expert data does not match its checksum"


READ_AHEAD = int(os.environ.get("FREETOKEN_CACHE_READ_AHEAD", "2"))
"""Experts read ahead on their own threads while one is encoded: reads in flight keep the disk's queue busy."""


def write_cache_file(
    path: Path,
    layout: ExpertLayout,
    layers: list[int],
    num_experts: int,
    load: Callable[[int, int], Any],
    on_expert: Callable[[], None] | None = None,
    encode: Callable[[Any], torch.Tensor] | None = None,
    layouts: dict[int, ExpertLayout] | None = None,
) -> Path:
    """Write the cache file: ``load(layer, e)`` gives each expert, normalized; two experts in memory at a time (the
    next one is read on a second thread while this one is encoded, so ``load`` must be safe to call from it).

    ``encode`` turns what ``load`` gives into its blob (default ``layout.encode``; the quantized full-RAM path passes
    the C quantizer's twin, same format; a source that makes its blobs itself passes them through). ``layouts``:
    each MoE layer's blob layout where they differ (``layout`` is then the widest, the slots' size).
    """
    encode = encode or layout.encode
    stride = _round(layout.blob_bytes, PAGE)
    meta: dict[str, Any] = {"layout": layout.to_json(), "layers": layers, "num_experts": num_experts,
                            "stride": stride}
    sizes = dict.fromkeys(layers, layout.blob_bytes)
    if _differing(layout, layouts):
        assert layouts is not None
        meta["layouts"] = [layouts[layer].to_json() for layer in layers]
        sizes = {layer: layouts[layer].blob_bytes for layer in layers}
        if max(sizes.values()) > layout.blob_bytes:
            raise FreeTokenError("the expert cache file's layout must be the widest of its layers' layouts")
    # data_start depends on the header length, which contains data_start: fix it at one page past the header
    probe = json.dumps({**meta, "data_start": 0}).encode()
    data_start = _round(16 + len(probe) + 32, PAGE)
    header = json.dumps({**meta, "data_start": data_start}).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        with tmp.open("wb") as fh:
            fh.write(MAGIC + struct.pack("<Q", len(header)) + header)
            fh.write(b"\0" * (data_start - fh.tell()))
            crc = 0
            synced = 0
            order = [(layer, e) for layer in layers for e in range(num_experts)]
            # the next expert is read (pread, torch: no GIL) while this one is encoded on the kernels' pool
            with ThreadPoolExecutor(READ_AHEAD, thread_name_prefix="freetoken-cache-read") as reader:
                ahead = [reader.submit(load, *key) for key in order[:READ_AHEAD]]
                for i, (layer, e) in enumerate(order):
                    expert = ahead.pop(0).result()
                    if i + READ_AHEAD < len(order):
                        ahead.append(reader.submit(load, *order[i + READ_AHEAD]))
                    blob = memoryview(encode(expert).contiguous().numpy()).cast("B")
                    del expert
                    if len(blob) != sizes[layer]:
                        raise FreeTokenError(f"expert {e} of layer {layer} encoded to {len(blob)} bytes, its layout "
                                             f"holds {sizes[layer]}")
                    pad = b"\0" * (stride - sizes[layer])
                    fh.write(blob)
                    fh.write(pad)
                    crc = zlib.crc32(pad, zlib.crc32(blob, crc))
                    if fh.tell() - synced >= WRITE_CHUNK:
                        synced = _sync_and_drop(fh, synced)
                    if on_expert is not None:
                        on_expert()
            fh.write(TRAILER.pack(TRAILER_MAGIC, len(layers) * num_experts * stride, crc))
            fh.flush()
            os.fsync(fh.fileno())  # the data is on disk before the rename makes it visible
        tmp.replace(path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def _sync_and_drop(fh: Any, start: int) -> int:
    """Write out what ``fh`` holds past ``start`` and drop those pages from the page cache; returns the new start."""
    fh.flush()
    end = fh.tell()
    os.fdatasync(fh.fileno())
    os.posix_fadvise(fh.fileno(), start, end - start, os.POSIX_FADV_DONTNEED)
    return end


def open_or_write(
    path: Path, layout: ExpertLayout, layers: list[int], num_experts: int,
    load: Callable[[int, int], Any], drop_cache: bool = False, progress: bool | None = None,
    encode: Callable[[Any], torch.Tensor] | None = None, verify: bool = False,
    layouts: dict[int, ExpertLayout] | None = None,
) -> tuple[ExpertCacheFile, bool]:  # fmt: skip
    """Open the cache file at ``path``, writing it first when missing or unreadable; returns (file, written).

    ``load``, ``encode``, ``layouts``: as ``write_cache_file`` takes them (a file is reused only when every layer's
    layout matches).

    ``progress`` shows a bar while writing (default: when the file will exceed 256 MiB). ``verify`` also checks
    the data against its checksum. A damaged file (bad header, truncated, checksum mismatch) or, with ``verify``,
    one without a checksum (older versions) is rewritten with a one-line note on stderr; a file for another layout
    is rewritten silently.
    """
    if path.is_file():
        problem = None
        try:
            f = ExpertCacheFile(path, drop_cache)
            want = layouts if _differing(layout, layouts) else dict.fromkeys(layers, layout)
            if f.layout == layout and f.layers == layers and f.num_experts == num_experts and f.layouts == want:
                problem = f.verify() if verify else None
                if problem is None:
                    return f, False
            f.close()
        except (FreeTokenError, KeyError, TypeError, ValueError) as exc:
            problem = str(exc).removeprefix(f"{path}: ")
        if problem is not None:
            print(f"freetoken: rewriting the expert cache {path} ({problem})", file=sys.stderr)
    total = len(layers) * num_experts
    if progress if progress is not None else total * layout.blob_bytes > 256 * 2**20:
        from rich.progress import Progress

        with Progress(transient=True) as bar:
            what = f"quantizing experts to {layout.fmt}" if layout.fmt.startswith("q") else "writing experts"
            task = bar.add_task(f"{what} into {path.name}", total=total)
            write_cache_file(path, layout, layers, num_experts, load, lambda: bar.advance(task), encode, layouts)
    else:
        write_cache_file(path, layout, layers, num_experts, load, encode=encode, layouts=layouts)
    return ExpertCacheFile(path, drop_cache), True

