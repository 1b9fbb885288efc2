"""Lazy reader over a model folder's ``*.safetensors`` files.

Headers are parsed up front (cheap, and it lets us name the bad file and tensor in errors); tensor data is read
through ``safetensors.safe_open`` (memory-mapped) only when asked. The reader records which tensors were taken
so strict loading can report anything left unused.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from freetoken_agent.runtime.errors import CheckpointError, ConfigError, CorruptCheckpointError

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER = 100 * 1024 * 1024


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
    if not path.is_dir():
        raise ConfigError(f"model folder not found: {path}")
    if not cfg.is_file():
        raise ConfigError(f"no config.json in {path} (is this a Hugging Face model folder?)")
    try:
        data = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot parse {cfg}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{cfg} does not hold a JSON object")
    return data


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


class CheckpointReader:
    """All tensors of a model folder, addressed by name, read lazily."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.infos: dict[str, TensorInfo] = {}
        self._handles: dict[Path, Any] = {}
        self.used: set[str] = set()
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            files = self._files_from_index(index)
        else:
            files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no *.safetensors files in {self.path}")
        for file in files:
            for name, info in read_header(file).items():
                if name in self.infos:
                    raise CorruptCheckpointError(f"tensor {name!r} appears in both {self.infos[name].file.name} and {file.name}")
                self.infos[name] = info

    def _files_from_index(self, index: Path) -> list[Path]:
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, KeyError, TypeError, json.JSONDecodeError) as exc:
            raise CorruptCheckpointError(f"{index}: cannot read the shard index ({exc})") from None
        files = sorted({self.path / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index.name} lists shard(s) that are missing: {', '.join(missing)}")
        return files

    def __contains__(self, name: str) -> bool:
        return name in self.infos

    def shape(self, name: str) -> tuple[int, ...]:
        return self.infos[name].shape

    def get(self, name: str) -> torch.Tensor:
        """Read one tensor (memory-mapped) and mark it used."""
        return self._handle(name).get_tensor(name)

    def get_row(self, name: str, index: int) -> torch.Tensor:
        """Read ``tensor[index]`` of a stacked tensor without reading the rest (one expert of a fused tensor)."""
        return self._handle(name).get_slice(name)[index]

    def _info(self, name: str) -> TensorInfo:
        """Where ``name`` is stored (subclasses may also know tensors they hide from ``infos``)."""
        return self.infos[name]

    def _handle(self, name: str) -> Any:
        info = self._info(name)
        handle = self._handles.get(info.file)
        if handle is None:
            try:
                handle = safe_open(str(info.file), framework="pt")
            except Exception as exc:  # safetensors raises its own error types for corrupt files
                raise CorruptCheckpointError(f"{info.file}: {exc}") from None
            self._handles[info.file] = handle
        self.used.add(name)
        return handle

    def unused(self) -> list[str]:
        return sorted(set(self.infos) - self.used)

    def total_bytes(self) -> int:
        return sum(info.nbytes for info in self.infos.values())
