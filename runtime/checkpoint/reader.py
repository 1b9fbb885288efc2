"""Lazy reader over a model folder's checkpoint files.

The files are the ones transformers loads (``checkpoint_files``): ``model.safetensors``, else
``model.safetensors.index.json`` and the shards it names; other ``*.safetensors`` in the folder (a consolidated copy,
an adapter) are ignored. Headers are parsed up front (cheap, and it lets us name the bad file and tensor in errors);
tensor data is read only when asked, with ``pread`` straight into the tensor handed out (``TensorFile``): never
through a memory map, so a load holds no mapped file pages (resident memory and address space stay what the tensors
themselves take — a ``--host-memory`` budget, a cgroup or an ``RLIMIT_AS`` sees only them), and with
``drop_cache`` the pages read are dropped from the page cache too. Every tensor handed out is
checked: floating point (the model computes with nothing else) and, unless ``FREETOKEN_CHECK_WEIGHTS=0``, free of
NaN and infinity: one ``aminmax`` pass (a 224 MiB fp32 tensor: 65-200 ms on one core of a busy 2-core machine,
about a third of the fp32 copy the load makes anyway and 14x cheaper than ``isfinite().all()``). The reader
records which tensors were taken so strict loading can report anything left unused.

Checkpoints saved in a model's original layout (transformers converts them on load: ``conversion_mapping.py``) are
read under transformers' names: ``renames`` (``ModelSpec.checkpoint_renames``) rewrite every stored name by regex, in
order, and a rule may mark its tensors as stored transposed (2-D: handed out transposed). Errors name the stored
tensor.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from freetoken_agent.runtime.errors import (
    CheckpointError,
    ConfigError,
    CorruptCheckpointError,
    NonFiniteWeightError,
    WeightDtypeError,
)

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER = 100 * 1024 * 1024
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CHECK_WEIGHTS_ENV = "FREETOKEN_CHECK_WEIGHTS"
"""``0`` skips the NaN/infinity check of every tensor read (for trusted checkpoints; the dtype check stays)."""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives and what it is, from the safetensors header."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return self.offsets[1] - self.offsets[0]


def load_config(path: Path) -> dict[str, Any]:
    """Read ``config.json`` of a model folder, with one clear error when it is missing or invalid."""
    cfg = path / "config.json"
    if path.is_file():
        raise ConfigError(f"{path} is a file; give the model folder that holds config.json and the weights, "
                          "or a .gguf file")
    if not path.is_dir():
        raise ConfigError(f"model folder not found: {path}")
    if not cfg.is_file():
        raise ConfigError(f"no config.json in {path} (is this a Hugging Face model folder?)")
    try:
        data = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot parse {cfg}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{cfg} must hold a JSON object, got a JSON {type(data).__name__}")
    return data


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a model folder, chosen as transformers chooses them for a local folder.

    ``config.json``'s ``transformers_weights`` (a ``.safetensors`` or ``.safetensors.index.json`` inside the folder)
    wins; else ``model.safetensors``; else ``model.safetensors.index.json`` and the shards its ``weight_map`` names.
    Anything else is refused with what was expected: shards without their index, and ``pytorch_model.bin``, which
    transformers would read but this engine does not.
    """
    explicit = _explicit_weights(path)
    if explicit is not None:
        name = explicit.name
        if not explicit.is_file():
            raise CheckpointError(f"config.json names transformers_weights {name!r} but {explicit} does not exist")
        return _shards_from_index(explicit) if name.endswith(".safetensors.index.json") else [explicit]
    if (path / WEIGHTS_NAME).is_file():
        return [path / WEIGHTS_NAME]
    if (path / INDEX_NAME).is_file():
        return _shards_from_index(path / INDEX_NAME)
    others = sorted(f.name for f in path.glob("*.safetensors"))
    hint = ""
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        hint = (f"; found {shown}, which transformers would not load either (a sharded checkpoint needs its "
                f"{INDEX_NAME})")
    elif (path / "pytorch_model.bin").is_file() or (path / "pytorch_model.bin.index.json").is_file():
        hint = "; found pytorch_model.bin: convert it to safetensors (transformers' save_pretrained does)"
    raise CheckpointError(f"no {WEIGHTS_NAME} or {INDEX_NAME} in {path}{hint}")


def _explicit_weights(path: Path) -> Path | None:
    """``transformers_weights`` of ``config.json``, checked as transformers checks it (None when absent)."""
    try:
        cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None  # load_config reports a bad config.json; here it only may name the weights
    name = cfg.get("transformers_weights") if isinstance(cfg, dict) else None
    if name is None:
        return None
    if not isinstance(name, str) or not name.endswith((".safetensors", ".safetensors.index.json")):
        raise ConfigError(f"config.json: transformers_weights must name a .safetensors or .safetensors.index.json "
                          f"file, got {name!r}")
    return _inside(path, name, "config.json's transformers_weights")


def _inside(folder: Path, name: str, what: str) -> Path:
    """``folder / name``, refusing names that leave the folder (``..``, absolute paths)."""
    target = (folder / name).resolve()
    if os.path.commonpath([folder.resolve(), target]) != str(folder.resolve()):
        raise CheckpointError(f"{what} names {name!r}, which is outside the model folder {folder}")
    return folder / name


def _shards_from_index(index: Path) -> list[Path]:
    """The shard files a ``*.safetensors.index.json`` names (each once, sorted), all present and inside the folder."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, UnicodeDecodeError, KeyError, TypeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpointError(f"{index}: cannot read the shard index ({exc!r})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise CorruptCheckpointError(f"{index}: weight_map must map tensor names to shard file names")
    if not weight_map:
        raise CorruptCheckpointError(f"{index}: weight_map is empty (no shards named)")
    files = sorted({_inside(index.parent, f, index.name) for f in weight_map.values()})
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{index.name} lists shard(s) that are missing: {', '.join(missing)}")
    return files


def check_weights_enabled() -> bool:
    """Whether tensors are checked for NaN/infinity on read (``FREETOKEN_CHECK_WEIGHTS``, default on)."""
    return os.environ.get(CHECK_WEIGHTS_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def read_header(file: Path) -> dict[str, TensorInfo]:
    """Parse one safetensors header; raises ``CorruptCheckpointError`` naming the file on any inconsistency."""
    try:
        size = file.stat().st_size
        with file.open("rb") as fh:
            prefix = fh.read(8)
            if len(prefix) < 8:
                raise CorruptCheckpointError(f"{file}: truncated safetensors file ({size} bytes)")
            (length,) = struct.unpack("<Q", prefix)
            if length > _MAX_HEADER or 8 + length > size:
                raise CorruptCheckpointError(f"{file}: corrupt safetensors header (declared length {length})")
            raw = fh.read(length)
        header = json.loads(raw.decode("utf-8"))
    except OSError as exc:
        raise CheckpointError(f"cannot read {file}: {exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpointError(f"{file}: corrupt safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{file}: corrupt safetensors header (not a JSON object)")
    data_size = size - 8 - length
    infos: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = entry["dtype"], tuple(int(s) for s in entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CorruptCheckpointError(f"{file}: corrupt header entry for tensor {name!r}") from None
        if dtype not in _DTYPES:
            raise CorruptCheckpointError(f"{file}: tensor {name!r} has unsupported dtype {dtype}")
        if not 0 <= start <= end <= data_size:
            raise CorruptCheckpointError(f"{file}: tensor {name!r} points outside the file (offsets {start}..{end})")
        infos[name] = TensorInfo(name, file, dtype, shape, (int(start), int(end)))
    return infos


class TensorFile:
    """One open safetensors file read with ``pread``: ``get_tensor(name)`` and ``get_slice(name)[i or a:b]`` (the
    first dimension), the calls of ``safetensors.safe_open`` that the reader makes, each into a fresh tensor."""

    def __init__(self, file: Path, infos: dict[str, TensorInfo], drop_cache: bool = False) -> None:
        self.file, self.infos, self.drop_cache = file, infos, drop_cache
        try:
            self._fd = os.open(file, os.O_RDONLY)
            (length,) = struct.unpack("<Q", os.pread(self._fd, 8, 0))
        except (OSError, struct.error) as exc:
            raise CheckpointError(f"cannot read {file}: {exc}") from None
        self.data_start = 8 + length

    def get_tensor(self, name: str) -> torch.Tensor:
        info = self.infos[name]
        return self._read(info, 0, info.shape)

    def get_slice(self, name: str) -> _Rows:
        return _Rows(self, self.infos[name])

    def _read(self, info: TensorInfo, start: int, shape: tuple[int, ...]) -> torch.Tensor:
        """``shape`` elements of ``info``'s tensor from element ``start`` on (a contiguous run), read from disk."""
        out = torch.empty(shape, dtype=_DTYPES[info.dtype])
        n = out.numel() * out.element_size()
        if n == 0:
            return out
        off = self.data_start + info.offsets[0] + start * out.element_size()
        if off + n > self.data_start + info.offsets[1]:
            raise CorruptCheckpointError(f"{self.file}: tensor {info.name!r} read past its end")
        view = memoryview(out.view(-1).view(torch.uint8).numpy())
        got = 0
        while got < n:  # pread may return less than asked (large reads, signals)
            step = os.preadv(self._fd, [view[got:]], off + got)
            if step <= 0:
                raise CorruptCheckpointError(f"{self.file}: tensor {info.name!r} is truncated")
            got += step
        if self.drop_cache:
            os.posix_fadvise(self._fd, off, n, os.POSIX_FADV_DONTNEED)
        return out

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        self.close()


class _Rows:
    """``tensor[i]`` / ``tensor[a:b]`` of one stored tensor, reading only those rows."""

    def __init__(self, file: TensorFile, info: TensorInfo) -> None:
        self.file, self.info = file, info

    def __getitem__(self, index: int | slice) -> torch.Tensor:
        shape = self.info.shape
        if not shape:
            raise IndexError(f"tensor {self.info.name!r} is a scalar: it has no rows")
        row = math.prod(shape[1:])
        if isinstance(index, slice):
            start, stop, step = index.indices(shape[0])
            if step != 1:
                raise IndexError("only contiguous row slices are read")
            stop = max(start, stop)
            return self.file._read(self.info, start * row, (stop - start, *shape[1:]))
        if not -shape[0] <= index < shape[0]:
            raise IndexError(f"row {index} of tensor {self.info.name!r} with {shape[0]} rows")
        index %= shape[0]
        return self.file._read(self.info, index * row, shape[1:])


class CheckpointReader:
    """All tensors of a model folder, addressed by name, read lazily."""

    transposed: set[str] | frozenset[str] = frozenset()
    """Names (as asked for) whose tensors are stored transposed (set per instance when renames mark some)."""

    def __init__(self, path: str | Path, check_finite: bool | None = None,
                 renames: Sequence[tuple[str, str, bool]] = ()) -> None:
        """``check_finite``: refuse NaN/infinity in tensors as they are read (default: ``FREETOKEN_CHECK_WEIGHTS``);
        ``renames``: (pattern, replacement, stored transposed) rules mapping stored names to the ones asked for."""
        self.path = Path(path)
        self.check_finite = check_weights_enabled() if check_finite is None else check_finite
        self.drop_cache = False
        """Drop the pages of each read from the page cache (a budgeted load streaming experts it will not reread)."""
        self.infos: dict[str, TensorInfo] = {}
        self._handles: dict[Path, Any] = {}
        self.used: set[str] = set()
        if not self.path.is_dir():
            raise CheckpointError(f"model folder not found: {self.path}")
        self.files = checkpoint_files(self.path)
        self._stored: dict[Path, dict[str, TensorInfo]] = {}  # per file, as stored (``infos`` may be remapped)
        self.transposed = set()
        for file in self.files:
            self._stored[file] = read_header(file)
            if renames:
                self._stored[file] = self._renamed(self._stored[file], renames)
            for name, info in self._stored[file].items():
                if name in self.infos:
                    raise CorruptCheckpointError(f"tensor {name!r} appears in both {self.infos[name].file.name} and {file.name}")
                self.infos[name] = replace(info, shape=info.shape[::-1]) if name in self.transposed else info

    def _renamed(self, infos: dict[str, TensorInfo], renames: Sequence[tuple[str, str, bool]]
                 ) -> dict[str, TensorInfo]:
        """One file's tensors under their renamed names (``TensorInfo.name`` keeps the stored one)."""
        out: dict[str, TensorInfo] = {}
        for stored, info in infos.items():
            name, flip = stored, False
            for pattern, replacement, transposed in renames:
                new = re.sub(pattern, replacement, name)
                if new != name:
                    name, flip = new, flip or transposed
            if flip and len(info.shape) != 2:
                raise CorruptCheckpointError(f"{info.file.name}: tensor {stored!r} should be a matrix stored "
                                             f"transposed, but has shape {list(info.shape)}")
            if name in out:
                raise CorruptCheckpointError(f"{info.file.name}: tensors {out[name].name!r} and {stored!r} are both "
                                             f"read as {name!r}")
            out[name] = info
            if flip:
                self.transposed.add(name)
        return out

    def __contains__(self, name: str) -> bool:
        return name in self.infos

    def shape(self, name: str) -> tuple[int, ...]:
        return self.infos[name].shape

    def dtype(self, name: str) -> torch.dtype:
        """The dtype ``read(name)`` returns, from the header (no data read)."""
        return _DTYPES[self.infos[name].dtype]

    def get(self, name: str) -> torch.Tensor:
        """Read one tensor (memory-mapped), check it and mark it used."""
        return self.checked(name, self.read(name))

    def get_row(self, name: str, index: int) -> torch.Tensor:
        """Read ``tensor[index]`` of a stacked tensor without reading the rest (one expert of a fused tensor)."""
        return self.checked(name, self.read_row(name, index), f"row {index}")

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Read ``tensor[start:stop]`` without reading the rest (one expert of a row-stacked tensor)."""
        if name in self.transposed:
            return self.checked(name, self.read(name)[start:stop].contiguous(), f"rows {start}:{stop}")
        return self.checked(name, self._handle(name).get_slice(name)[start:stop], f"rows {start}:{stop}")

    def read(self, name: str) -> torch.Tensor:
        """``get`` without the checks (subclasses that decode formats override this and ``read_row``)."""
        tensor = self._handle(name).get_tensor(name)
        return tensor.t().contiguous() if name in self.transposed else tensor

    def read_row(self, name: str, index: int) -> torch.Tensor:
        if name in self.transposed:
            return self.read(name)[index].contiguous()
        return self._handle(name).get_slice(name)[index]

    def checked(self, name: str, tensor: torch.Tensor, part: str = "") -> torch.Tensor:
        """``tensor`` (read as ``name``) when it is floating point and, if checking, finite; else a clear error."""
        info = self.infos.get(name) or self._info(name)
        where = f"{info.file.name}: tensor {name!r}" + (f" ({part})" if part else "")
        if not tensor.is_floating_point():
            raise WeightDtypeError(
                f"{where} is stored as {str(tensor.dtype).removeprefix('torch.')}, but the model computes with it "
                "as floating-point weights (an integer tensor here is a damaged checkpoint or a quantization "
                "format this engine does not read)")
        if self.check_finite and tensor.numel() and not _finite(tensor):
            nan = int(torch.isnan(tensor.float()).sum())
            inf = int(torch.isinf(tensor.float()).sum())
            raise NonFiniteWeightError(
                f"{where} holds {nan} NaN and {inf} infinite value(s): the checkpoint is damaged "
                f"(checked because {CHECK_WEIGHTS_ENV} is not 0)")
        return tensor

    def _info(self, name: str) -> TensorInfo:
        """Where ``name`` is stored (subclasses may also know tensors they hide from ``infos``)."""
        return self.infos[name]

    def _handle(self, name: str) -> Any:
        info = self._info(name)
        handle = self._handles.get(info.file)
        if handle is None:
            handle = TensorFile(info.file, self._stored[info.file])
            self._handles[info.file] = handle
        handle.drop_cache = self.drop_cache
        self.used.add(name)
        return handle

    def unused(self) -> list[str]:
        return sorted(set(self.infos) - self.used)

    def total_bytes(self) -> int:
        return sum(info.nbytes for info in self.infos.values())


def _finite(tensor: torch.Tensor) -> bool:
    """No NaN or infinity in ``tensor``: min and max in one pass (NaN propagates into both); far cheaper than
    ``isfinite().all()``, which materializes a mask. FP8 has no CPU min/max: widened first."""
    if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        tensor = tensor.float()
    lo, hi = torch.aminmax(tensor)
    return math.isfinite(float(lo)) and math.isfinite(float(hi))
