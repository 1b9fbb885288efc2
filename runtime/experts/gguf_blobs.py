"""A GGUF file's routed experts as expert cache blobs: what a budgeted (managed) load of a GGUF model stores.

Legend: ``E`` experts per layer, ``R`` rows of one expert's stored matrix, ``nb`` blocks per row, ``P`` bytes per block.

``gguf_layouts`` gives each MoE layer whose experts run as blocks (``gguf.model.layer_formats``) the blob layout the
unbudgeted GGUF load runs them in: gate/up and down each in its own format (a Q4_K_M file: Q4_K gate/up, Q6_K down
in some layers and Q4_K in the others), in the kernels' tiles where they load. ``GGUFExpertReader.blob(layer, e)``
makes one expert's blob. GGUF stacks experts outermost, so one expert's rows of each stored tensor are one contiguous
run of the file: it is read with ``pread`` (the file's mapping is not touched, and with ``drop_cache`` the pages read
leave the page cache), converted exactly as the unbudgeted load converts it (``gguf.model.expert_blocks``: native
block types byte for byte, others dequantized and requantized) and laid out in the tiles. Writing the expert cache
file from it holds two experts in memory (one read ahead).
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from freetoken_agent.runtime.errors import CorruptCheckpointError, FreeTokenError
from freetoken_agent.runtime.experts.layout import ExpertLayout
from freetoken_agent.runtime.gguf.model import expert_blocks, layer_formats, part_format
from freetoken_agent.runtime.gguf.reader import dequantize
from freetoken_agent.runtime.quant.formats import block_format


def gguf_layouts(gguf: Any, quant: str, kernels: bool) -> dict[int, ExpertLayout]:
    """MoE layer → its experts' blob layout, for the layers of ``gguf`` (a ``runtime.gguf.GGUFModel``) whose experts
    run as blocks with ``quant`` (``none``: each layer's own formats); layers of float experts are left out."""
    spec = gguf.spec
    out: dict[int, ExpertLayout] = {}
    for layer, group in sorted(gguf.reader.experts.items()):
        formats = layer_formats(group, quant)
        moe = spec.layers[layer].moe
        if formats is not None and moe is not None:
            out[layer] = ExpertLayout(formats[0], spec.hidden_size, moe.intermediate, moe.expert_bias, kernels,
                                      formats[1])
    return out


class GGUFExpertReader:
    """One expert at a time of a GGUF file's block experts, as blobs in ``layouts`` (see the module docstring)."""

    def __init__(self, gguf: Any, layouts: dict[int, ExpertLayout], drop_cache: bool = False) -> None:
        self.groups = gguf.reader.experts
        self.layouts = layouts
        self.drop_cache = drop_cache
        """Drop the pages each read leaves in the page cache (a memory cgroup counts them)."""
        self.errors = [0.0, 0.0]
        """Converted experts' ||Δ||², ||w||², summed (the relative error of the conversions)."""
        self._fds: dict[Path, int] = {}

    def blob(self, layer: int, e: int) -> torch.Tensor:
        """Expert ``e`` of MoE layer ``layer`` as its blob (uint8 ``[layouts[layer].blob_bytes]``)."""
        group, layout = self.groups[layer], self.layouts[layer]
        blocks = {part: expert_blocks(self._expert(t, e), 0, part_format(layout.formats, part), self.errors)
                  for part, t in group.parts()}  # each [R, nb, P]
        w13 = blocks["gate_up"] if "gate_up" in blocks else torch.cat([blocks["gate"], blocks["up"]])  # gate, up rows
        f13, f2 = (block_format(f) for f in layout.formats)
        parts = {"gate_up": f13.storage(w13, layout.packed), "down": f2.storage(blocks["down"], layout.packed)}
        if layout.bias:  # GPT-OSS: in the kernels' row order (gate, then up), fp32
            biases = (group.gate_bias, group.up_bias, group.down_bias)
            if any(b is None for b in biases):
                raise FreeTokenError(f"MoE layer {layer} of the GGUF file has no expert biases; its spec expects them")
            gate, up, down = (dequantize(self._expert(b, e), 0) for b in biases)
            parts["gate_up_bias"], parts["down_bias"] = torch.cat([gate, up]), down
        return layout.place(parts)

    def _expert(self, t: Any, e: int) -> Any:
        """A one-expert stand-in for stored tensor ``t`` (``gguf.file.GGUFTensor``): expert ``e``'s data, read from
        the file with ``pread``, as its only expert (index 0)."""
        n = t.nbytes // t.shape[0]
        start = t.offset + e * n
        buf = np.empty(n, dtype=np.uint8)
        fd = self._fds.get(t.file)
        if fd is None:
            fd = self._fds[t.file] = os.open(t.file, os.O_RDONLY)
        view, got = memoryview(buf), 0
        while got < n:  # pread may return less than asked (large reads, signals)
            step = os.preadv(fd, [view[got:]], start + got)
            if step <= 0:
                raise CorruptCheckpointError(f"{t.file}: GGUF tensor {t.name} is truncated (expert {e})")
            got += step
        if self.drop_cache:
            os.posix_fadvise(fd, start, n, os.POSIX_FADV_DONTNEED)
        return replace(t, data=buf.view(t.data.dtype).reshape(1, *t.data.shape[1:]))

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> GGUFExpertReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
