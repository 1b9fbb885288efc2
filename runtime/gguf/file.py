"""Find and open GGUF files: one file, the parts of a split file, or a folder holding one; metadata and tensors.

Legend: a *part* is one file of a split model (``name-00001-of-00003.gguf``, as ``gguf-split`` and llama.cpp's
converter write them): every part is a complete GGUF file with its own header; the first holds the model's metadata,
each holds some of the tensors (``split.no`` / ``split.count`` / ``split.tensors.count`` say which and how many).

Files are read with the ``gguf`` package (llama.cpp's own reader): the header is parsed up front and every tensor's
data stays memory-mapped (``numpy.memmap``) until a weight is read. Everything that can be wrong with a file ends in
one of the named errors below, one line each.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from freetoken_agent.runtime.errors import ConfigError, CorruptCheckpointError, UnsupportedArchitectureError

GGUF_MAGIC = b"GGUF"
SPLIT_NAME = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
_REQUIRED = object()


class GGUFError(CorruptCheckpointError):
    """A GGUF file that cannot be read: wrong magic, truncated, inconsistent split parts."""


class GGUFTensorTypeError(GGUFError):
    """A tensor stored in a type this engine does not read (an unknown or unsupported ggml type)."""


class GGUFMetadataError(ConfigError):
    """A metadata key the model needs is missing from the file, or has the wrong type."""


class GGUFArchitectureError(UnsupportedArchitectureError):
    """The file's ``general.architecture`` is not an MoE architecture this engine runs from GGUF."""


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` names a GGUF model: a ``.gguf`` file, or a folder holding one and no safetensors checkpoint."""
    p = Path(path)
    if p.is_file():
        return p.suffix.lower() == ".gguf"
    if p.is_dir():
        if any(p.glob("*.safetensors")) or (p / "model.safetensors.index.json").is_file():
            return False
        return bool(_model_files(p))
    return False


def _model_files(folder: Path) -> list[Path]:
    """The GGUF files of a folder that hold a language model (vision projectors, ``mmproj*.gguf``, left out)."""
    return sorted(f for f in folder.glob("*.gguf") if f.is_file() and not f.name.lower().startswith("mmproj"))


def find_gguf(path: str | Path) -> Path:
    """The GGUF file to open for ``path``: the file itself, or the one model file (first part) inside a folder."""
    p = Path(path).expanduser()
    if p.is_dir():
        files = _model_files(p)
        firsts = [f for f in files if not (m := SPLIT_NAME.match(f.name)) or int(m["no"]) == 1]
        if not firsts:
            raise GGUFError(f"no .gguf model file in {p}" + (" (only parts after the first of a split file)"
                                                              if files else ""))
        if len(firsts) > 1:
            shown = ", ".join(f.name for f in firsts[:4]) + (" ..." if len(firsts) > 4 else "")
            raise ConfigError(f"{p} holds {len(firsts)} GGUF models ({shown}); give the file to load")
        return firsts[0]
    if not p.is_file():
        raise ConfigError(f"model file not found: {p}")
    m = SPLIT_NAME.match(p.name)
    if m and int(m["no"]) != 1:
        first = p.with_name(f"{m['stem']}-00001-of-{m['count']}.gguf")
        raise ConfigError(f"{p.name} is part {int(m['no'])} of a split GGUF file; give the first part, {first.name}")
    return p


def split_parts(first: Path) -> list[Path]:
    """All parts of the model whose first file is ``first`` (``[first]`` for a file that is not split)."""
    m = SPLIT_NAME.match(first.name)
    if not m:
        return [first]
    count = int(m["count"])
    parts = [first.with_name(f"{m['stem']}-{i:05d}-of-{m['count']}.gguf") for i in range(1, count + 1)]
    missing = [q.name for q in parts if not q.is_file()]
    if missing:
        raise GGUFError(f"split GGUF {first.name}: part(s) missing: {', '.join(missing)}")
    return parts


def _open_one(file: Path) -> Any:
    """``gguf.GGUFReader`` over one file, every failure turned into a named one-line error."""
    import gguf

    try:
        with file.open("rb") as fh:
            head = fh.read(4)
    except OSError as exc:
        raise GGUFError(f"cannot read {file}: {exc.strerror or exc}") from None
    if head != GGUF_MAGIC:
        raise GGUFError(f"{file} is not a GGUF file (magic {head!r}, expected {GGUF_MAGIC!r})")
    size = file.stat().st_size
    try:
        reader = gguf.GGUFReader(str(file))
    except ValueError as exc:
        if "GGMLQuantizationType" in str(exc):
            raise GGUFTensorTypeError(f"{file}: a tensor has an unknown ggml type ({exc}); this file needs a newer "
                                      "reader than the installed gguf package") from None
        raise GGUFError(f"{file}: truncated or corrupt GGUF file ({size} bytes; {exc})") from None
    except (IndexError, OverflowError, UnicodeDecodeError, KeyError, TypeError, MemoryError) as exc:
        raise GGUFError(f"{file}: truncated or corrupt GGUF file ({size} bytes; {type(exc).__name__}: {exc})") from None
    for t in reader.tensors:
        if int(t.data_offset) + int(t.n_bytes) > size:
            raise GGUFError(f"{file}: truncated GGUF file: tensor {t.name} ends at byte "
                            f"{int(t.data_offset) + int(t.n_bytes)} of {size}")
    return reader


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF model: where it is, its ggml type, its numpy shape (rows first) and its raw data."""

    name: str
    file: Path
    type_name: str
    type_id: int
    shape: tuple[int, ...]
    """Element shape, outermost first (PyTorch order; GGUF's own ``ne`` is the reverse)."""
    data: np.ndarray
    """Memory-mapped: element values for F32/F16/BF16 (BF16 as uint16), bytes per row ``[..., row_bytes]`` for
    block-quantized types."""
    offset: int
    nbytes: int


class GGUFFile:
    """A GGUF model, possibly split into parts: metadata from the first part, tensors from all of them."""

    def __init__(self, path: str | Path) -> None:
        self.path = find_gguf(path)
        self.parts = split_parts(self.path)
        self._readers = [_open_one(p) for p in self.parts]
        first = self._readers[0]
        self.metadata: dict[str, Any] = {}
        for key, field in first.fields.items():
            if key.startswith("GGUF."):
                continue
            try:
                self.metadata[key] = field.contents()
            except (ValueError, IndexError, UnicodeDecodeError) as exc:
                raise GGUFError(f"{self.path}: metadata key {key!r} cannot be decoded ({exc})") from None
        self.tensors: dict[str, GGUFTensor] = {}
        for file, reader in zip(self.parts, self._readers):
            for t in reader.tensors:
                if t.name in self.tensors:
                    raise GGUFError(f"tensor {t.name} appears twice ({self.tensors[t.name].file.name} and {file.name})")
                shape = tuple(int(s) for s in reversed(t.shape.tolist()))
                self.tensors[t.name] = GGUFTensor(t.name, file, t.tensor_type.name, int(t.tensor_type), shape, t.data,
                                                  int(t.data_offset), int(t.n_bytes))
        self._check_split()

    def _check_split(self) -> None:
        count = self.metadata.get("split.count")
        if count is None:
            if len(self.parts) > 1:
                raise GGUFError(f"{self.path.name}: named as a split file but has no split.count metadata")
            return
        if int(count) != len(self.parts):
            raise GGUFError(f"{self.path.name}: split.count says {int(count)} parts, the file names say "
                            f"{len(self.parts)}")
        expected = self.metadata.get("split.tensors.count")
        if expected is not None and int(expected) != len(self.tensors):
            raise GGUFError(f"split GGUF {self.path.name}: {len(self.tensors)} tensors in its {len(self.parts)} "
                            f"parts, split.tensors.count says {int(expected)}")

    @property
    def architecture(self) -> str:
        return str(self.get("general.architecture"))

    def get(self, key: str, default: Any = _REQUIRED) -> Any:
        """A metadata value; a ``GGUFMetadataError`` naming the key when it is missing and no default is given."""
        if key in self.metadata:
            return self.metadata[key]
        if default is _REQUIRED:
            raise GGUFMetadataError(f"{self.path.name}: metadata key {key!r} is missing")
        return default

    def arch_get(self, key: str, default: Any = _REQUIRED) -> Any:
        """``{architecture}.{key}``."""
        return self.get(f"{self.architecture}.{key}", default)

    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())
