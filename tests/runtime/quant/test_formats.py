"""The block-format registry: each format's layout, dequantization and kernel in one entry, and the user's
``--quant`` normalized there."""

from __future__ import annotations

import pytest
import torch
from freetoken_agent.runtime.errors import FreeTokenError, OptionError
from freetoken_agent.runtime.kernels import build, ops
from freetoken_agent.runtime.quant.formats import (
    FORMATS,
    GGUF_NATIVE,
    GGUF_TYPES,
    KERNEL_FORMATS,
    block_format,
    check_quant,
)

# relative RMS error of quantize → dequantize on Gaussian weights (measured: q8_0 ~0.005, q4_0 ~0.08, q4_k ~0.07,
# q5_k ~0.036, q6_k ~0.018, mxfp4 ~0.115)
MAX_ERROR = {"q8_0": 0.01, "q4_0": 0.15, "q4_k": 0.15, "q5_k": 0.05, "q6_k": 0.03, "mxfp4": 0.15}


@pytest.mark.parametrize("name", list(FORMATS))
def test_each_format_round_trips_its_plain_layout(name: str) -> None:
    fmt = block_format(name)
    n, k = 24, 3 * fmt.block_values + 64  # a ragged last block: rows are zero-padded to whole blocks
    w = torch.randn(n, k)
    blocks = fmt.quantize_rows(w)
    assert blocks.dtype == torch.uint8 and tuple(blocks.shape) == (n, fmt.nb(k), fmt.block_bytes)
    stored = fmt.storage(blocks, packed=False)
    assert stored.numel() == fmt.matrix_bytes(n, k)
    assert torch.equal(fmt.blocks(stored, n, k, packed=False), blocks)
    back = fmt.dequantize(stored, n, k)
    assert back.shape == (n, k)
    assert float((back - w).norm() / w.norm()) <= MAX_ERROR[name]
    assert torch.equal(back, fmt.dequantize_rows(blocks, k))


@pytest.mark.parametrize("name", KERNEL_FORMATS)
def test_kernel_formats_pack_into_the_kernels_tiles(name: str) -> None:
    fmt = block_format(name)
    assert fmt.kernel and fmt.runs_as == name
    n, k = 20, 4 * fmt.block_values  # 20 rows: the last tile is padded
    w = torch.randn(3, n, k)  # three experts' matrices at once
    blocks = torch.stack([fmt.quantize_rows(m) for m in w])
    tiles = fmt.storage(blocks, packed=True)
    assert tuple(tiles.shape) == (3, fmt.matrix_bytes(n, k, packed=True))
    assert torch.equal(fmt.blocks(tiles, n, k, packed=True), blocks)
    assert torch.equal(fmt.dequantize(tiles[1], n, k, packed=True), fmt.dequantize_rows(blocks[1], k))
    if build.load() is not None:  # the C dequantizer reads the same tiles as the same values
        got = ops.dequantize(ops.PackedWeight(name, n, k, tiles[2]))
        assert torch.equal(got, fmt.dequantize_rows(blocks[2], k))


def test_k_quants_run_as_themselves_on_whole_super_blocks() -> None:
    for name in ("Q4_K", "Q5_K", "Q6_K"):
        f = block_format(name)
        assert f.kernel and f.runs_as == f.name and f.block_values == 256
    if build.load() is None:
        return
    blocks = block_format("q6_k").quantize_rows(torch.randn(8, 300))  # zero-padded to 512 in the plain layout
    with pytest.raises(FreeTokenError, match="multiple of 256 values, got 300"):
        ops.PackedWeight.from_rows("q6_k", blocks, 300)
    with pytest.raises(FreeTokenError, match="unknown block format 'q3_k'"):
        ops.kernel_format("q3_k")


def test_gguf_types_map_onto_kernel_formats() -> None:
    assert set(GGUF_TYPES.values()) <= set(KERNEL_FORMATS)
    assert all(GGUF_TYPES[t] == f for t, f in GGUF_NATIVE.items())
    assert GGUF_NATIVE["Q4_K"] == "q4_k" and GGUF_NATIVE["Q6_K"] == "q6_k"  # a Q4_K_M file's experts, as stored
    assert GGUF_NATIVE["Q5_K"] == "q5_k" and GGUF_NATIVE["MXFP4"] == "mxfp4"  # Q5_K_M and GPT-OSS files, as stored
    assert GGUF_TYPES["Q5_0"] == "q8_0" and GGUF_TYPES["IQ4_XS"] == "q4_0"  # the nearest one at least as wide


def test_names_and_quant_values() -> None:
    assert block_format("q4") is FORMATS["q4_0"] and block_format("Q8_0") is FORMATS["q8_0"]
    with pytest.raises(FreeTokenError, match="unknown block format 'q3'"):
        block_format("q3")
    assert [check_quant(q) for q in (None, "", "none", "q8", "Q4_0")] == ["none", "none", "none", "q8_0", "q4_0"]
    with pytest.raises(OptionError, match="unknown --quant 'q2'"):
        check_quant("q2")
