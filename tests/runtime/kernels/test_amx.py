"""The AMX path (Intel AMX tiles for q4/q8 weights against many tokens) against the AVX-512 VNNI tile kernels. Exact
mode: the same int32 block sums and the same fp32 order, so every output must be bit-identical. bf16 mode: weights
dequantized to bf16, activations rounded to bf16: checked against the fp32 product of the dequantized weights. The
default prompts mode: bf16 inside a prompt step (the runner's steps of prompt chunks only), exact elsewhere. Runs
only on CPUs with AMX (and a Linux kernel that grants the tile state); elsewhere `available_isas()` has no "amx" and
these skip."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from freetoken_agent.runtime.errors import FreeTokenError
from freetoken_agent.runtime.kernels import build, ops
from freetoken_agent.runtime.quant import quantize
from freetoken_agent.runtime.quant.formats import block_format


@pytest.fixture
def amx() -> Iterator[None]:
    if build.load() is None:
        pytest.skip(f"C kernels unavailable here: {build.status().reason}")
    if "amx" not in ops.available_isas():
        pytest.skip("this CPU (or its kernel) has no AMX")
    before = ops.set_amx_min_tokens(1)  # every call with tokens runs on the tiles
    mode = ops.set_amx_mode("exact")
    yield
    ops.set_amx_mode(mode)
    ops.set_amx_min_tokens(before)
    ops.set_isa("best")


def _both(fn):
    """fn() on the AVX-512 VNNI path and on the AMX path; asserts the AMX path ran."""
    ops.set_isa("avx512vnni")
    vnni = fn()
    ops.set_isa("amx")
    calls = ops.amx_calls()
    tiles = fn()
    assert ops.amx_calls() > calls, "the AMX path did not run"
    return vnni, tiles


@pytest.mark.parametrize("fmt", ["q8", "q4"])
@pytest.mark.parametrize("shape", [(64, 256), (37, 100), (8, 64), (200, 96), (24, 2048)])  # ragged N, a lone tile, K % 32
@pytest.mark.parametrize("m", [1, 5, 16, 17, 70])  # one token, < 16, one whole chunk, a chunk + 1, several
def test_linear_is_bit_identical_to_vnni(fmt: str, shape: tuple[int, int], m: int, amx: None) -> None:
    torch.manual_seed(m * 1000 + shape[0])
    n, k = shape
    pw = ops.PackedWeight.from_blocks(quantize(torch.randn(n, k), fmt))
    x = torch.randn(m, k) * torch.rand(m, 1) * 4  # rows of different scales
    vnni, tiles = _both(lambda: ops.linear(pw, x))
    assert torch.equal(tiles, vnni)


def _packed(fmt: str, n: int, k: int) -> torch.Tensor:
    return ops.PackedWeight.from_rows(fmt, block_format(fmt).quantize_rows(torch.randn(n, k)), k).data


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k"])
@pytest.mark.parametrize("shape", [(40, 256), (8, 512), (24, 2048)])
@pytest.mark.parametrize("m", [5, 17, 70])
def test_k_quant_linear_is_bit_identical_to_vnni(fmt: str, shape: tuple[int, int], m: int, amx: None) -> None:
    # a Q4_K_M file's formats: Q4_K (a scale and a min per 32 values), Q6_K (a scale per 16 values, codes - 32)
    torch.manual_seed(m + shape[0])
    n, k = shape
    pw = ops.PackedWeight.from_rows(fmt, block_format(fmt).quantize_rows(torch.randn(n, k)), k)
    x = torch.randn(m, k) * torch.rand(m, 1) * 4
    vnni, tiles = _both(lambda: ops.linear(pw, x))
    assert torch.equal(tiles, vnni)


@pytest.mark.parametrize("fmts", [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q4_0", "q8_0"), ("q4_k", "q8_0"),
                                  ("q4_k", "q6_k")])
@pytest.mark.parametrize("tokens", [3, 40, 130])
def test_moe_is_bit_identical_to_vnni(fmts: tuple[str, str], tokens: int, amx: None) -> None:
    torch.manual_seed(tokens)
    fmt, down_fmt = fmts
    d, i, e, k = 256, 96 if fmt != "q4_k" and down_fmt != "q6_k" else 256, 6, 3
    w13 = torch.stack([_packed(fmt, 2 * i, d) for _ in range(e)])
    w2 = torch.stack([_packed(down_fmt, d, i) for _ in range(e)])
    x = torch.randn(tokens, d)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(tokens)])
    ids[0, 0] = -1  # a skipped slot
    wts = torch.rand(tokens, k)
    vnni, tiles = _both(lambda: ops.moe(fmt, w13, w2, (d, i), x, ids, wts, down_fmt=down_fmt))
    assert torch.equal(tiles, vnni)


def test_moe_in_many_passes_is_bit_identical(amx: None) -> None:
    # a small work-buffer budget cuts the step into many passes of whole experts, each with its own panels
    torch.manual_seed(1)
    d, i, e, k, t = 128, 64, 8, 2, 200
    w13 = torch.stack([ops.quantize_packed(torch.randn(2 * i, d), "q4") for _ in range(e)])
    w2 = torch.stack([ops.quantize_packed(torch.randn(d, i), "q4") for _ in range(e)])
    x, ids, wts = torch.randn(t, d), torch.stack([torch.randperm(e)[:k] for _ in range(t)]), torch.rand(t, k)
    whole = _both(lambda: ops.moe("q4", w13, w2, (d, i), x, ids, wts))[1]
    before = ops.set_moe_pass_bytes(64 << 10)
    try:
        passes = _both(lambda: ops.moe("q4", w13, w2, (d, i), x, ids, wts))
    finally:
        ops.set_moe_pass_bytes(before)
    assert torch.equal(passes[1], passes[0]) and torch.equal(passes[1], whole)


def test_threshold_sends_small_calls_to_the_tile_kernels(amx: None) -> None:
    pw = ops.PackedWeight.from_blocks(quantize(torch.randn(32, 64), "q8"))
    ops.set_isa("amx")
    ops.set_amx_min_tokens(8)
    calls = ops.amx_calls()
    ops.linear(pw, torch.randn(7, 64))
    assert ops.amx_calls() == calls
    ops.linear(pw, torch.randn(8, 64))
    assert ops.amx_calls() == calls + 2  # 32 rows: two 16-row items
    assert ops.set_amx_min_tokens(0) == 8  # 0: back to the default


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture
def bf16(amx: None) -> Iterator[None]:
    if not ops.amx_bf16_supported():
        pytest.skip("this CPU has no AMX-BF16 / AVX512-BF16")
    ops.set_amx_mode("bf16")
    wide_from = ops.set_amx_bf16_min_tokens(1)  # every call in bf16 mode runs the bf16 tiles
    yield
    ops.set_amx_bf16_min_tokens(wide_from)
    ops.set_amx_mode("exact")


@pytest.mark.parametrize("fmt", ["q8", "q4"])
@pytest.mark.parametrize("shape", [(64, 256), (37, 100), (8, 64), (24, 2048)])
@pytest.mark.parametrize("m", [1, 17, 70])
def test_bf16_mode_linear_tracks_the_fp32_product(fmt: str, shape: tuple[int, int], m: int, bf16: None) -> None:
    torch.manual_seed(m + shape[1])
    n, k = shape
    q = quantize(torch.randn(n, k), fmt)
    pw = ops.PackedWeight.from_blocks(q)
    x = torch.randn(m, k)
    ref = x @ q.dequantize().T
    ops.set_isa("avx512vnni")
    int8 = ops.linear(pw, x)
    ops.set_isa("amx")
    calls = ops.amx_calls()
    out = ops.linear(pw, x)
    assert ops.amx_calls() > calls
    # bf16 activations and weights: ~0.3% relative error on random data, under the int8 path's ~0.5%; a wrong
    # layout, pairing or scale gives O(1)
    assert _rel(out, ref) < 0.006 and _rel(out, ref) < _rel(int8, ref) * 1.2


@pytest.mark.parametrize("fmt", ["q8", "q4"])
def test_bf16_mode_moe_tracks_the_int8_path_and_is_the_same_in_any_passes(fmt: str, bf16: None) -> None:
    torch.manual_seed(3)
    d, i, e, k, t = 256, 96, 6, 2, 90
    w13 = torch.stack([ops.quantize_packed(torch.randn(2 * i, d), fmt) for _ in range(e)])
    w2 = torch.stack([ops.quantize_packed(torch.randn(d, i), fmt) for _ in range(e)])
    x, ids, wts = torch.randn(t, d), torch.stack([torch.randperm(e)[:k] for _ in range(t)]), torch.rand(t, k)
    ops.set_isa("avx512vnni")
    int8 = ops.moe(fmt, w13, w2, (d, i), x, ids, wts)
    ops.set_isa("amx")
    calls = ops.amx_calls()
    out = ops.moe(fmt, w13, w2, (d, i), x, ids, wts)
    assert ops.amx_calls() > calls and not torch.equal(out, int8)  # the bf16 tiles ran, not the int8 path
    assert _rel(out, int8) < 0.02  # two roundings of each path's activations apart
    before = ops.set_moe_pass_bytes(32 << 10)
    try:
        assert torch.equal(ops.moe(fmt, w13, w2, (d, i), x, ids, wts), out)
    finally:
        ops.set_moe_pass_bytes(before)


def test_deterministic_mode_runs_amx_exact(bf16: None) -> None:
    pw = ops.PackedWeight.from_blocks(quantize(torch.randn(48, 128), "q4"))
    x = torch.randn(33, 128)
    ops.set_isa("avx512vnni")
    vnni = ops.linear(pw, x)
    ops.set_isa("amx")
    assert not torch.equal(ops.linear(pw, x), vnni)  # bf16 mode
    ops.set_deterministic(True)
    try:
        assert torch.equal(ops.linear(pw, x), vnni)
    finally:
        ops.set_deterministic(False)
    assert not torch.equal(ops.linear(pw, x), vnni)  # the mode it replaced comes back



@pytest.mark.parametrize("fmt", ["q4_k", "q6_k"])
@pytest.mark.parametrize("shape", [(48, 512), (24, 2048), (40, 256)])
@pytest.mark.parametrize("m", [17, 70])
def test_bf16_mode_k_quant_linear_tracks_the_fp32_product(fmt: str, shape: tuple[int, int], m: int,
                                                          bf16: None) -> None:
    # a Q4_K_M file's formats: Q4_K (d * sc * q - dmin * m per 32 values), Q6_K (d * sc * (q - 32) per 16 values)
    torch.manual_seed(m + shape[0])
    n, k = shape
    pw = ops.PackedWeight.from_rows(fmt, block_format(fmt).quantize_rows(torch.randn(n, k)), k)
    x = torch.randn(m, k)
    ref = x @ ops.dequantize(pw).T
    ops.set_isa("avx512vnni")
    int8 = ops.linear(pw, x)
    ops.set_isa("amx")
    calls = ops.amx_calls()
    out = ops.linear(pw, x)
    assert ops.amx_calls() > calls and not torch.equal(out, int8)  # the bf16 tiles ran, not the exact ones
    assert _rel(out, ref) < 0.006 and _rel(out, ref) < _rel(int8, ref) * 1.2


def test_prompts_mode_runs_bf16_only_inside_a_prompt_step(bf16: None) -> None:
    pw = ops.PackedWeight.from_blocks(quantize(torch.randn(48, 256), "q4"))
    x = torch.randn(40, 256)
    ops.set_isa("amx")
    every = ops.linear(pw, x)  # bf16 mode
    ops.set_amx_mode("exact")
    exact = ops.linear(pw, x)
    assert not torch.equal(every, exact)
    assert ops.set_amx_mode("prompts") == "exact"
    assert torch.equal(ops.linear(pw, x), exact)
    seen: list[torch.Tensor] = []
    with ops.prompt_step():
        assert torch.equal(ops.linear(pw, x), every)
        with ops.prompt_step():  # nested: the outer mark survives the inner one's exit
            pass
        assert torch.equal(ops.linear(pw, x), every)
        other = threading.Thread(target=lambda: seen.append(ops.linear(pw, x)))  # the mark is the thread's own
        other.start()
        other.join()
    assert torch.equal(seen[0], exact)
    assert torch.equal(ops.linear(pw, x), exact)
    ops.set_deterministic(True)  # holds exact mode, then gives back the mode it replaced
    try:
        with ops.prompt_step():
            assert torch.equal(ops.linear(pw, x), exact)
    finally:
        ops.set_deterministic(False)
    assert ops.set_amx_mode("bf16") == "prompts"
    with pytest.raises(FreeTokenError, match="unknown AMX mode"):
        ops.set_amx_mode("fp8")


def test_the_runner_runs_prompt_steps_in_bf16_and_decode_rows_exact(bf16: None, tmp_path: Path) -> None:
    # A prompt-only step in the default mode gives the bits of bf16 mode; a verify row (a token and its drafts) and a
    # decode token the bits of exact mode, so speculation and batching keep a decode token's one-token kernels.
    pytest.importorskip("transformers")
    from freetoken_agent.runtime.engine import Engine
    from freetoken_agent.runtime.runner import Row
    from tests.runtime.checkpoints import save_checkpoint

    save_checkpoint("qwen3_moe", tmp_path)
    engine = Engine.from_pretrained(tmp_path, quant="q4", speculate=False)
    ops.set_isa("amx")
    gen = torch.Generator().manual_seed(0)
    prompt, row, token = (torch.randint(0, 256, (n,), generator=gen) for n in (40, 4, 1))

    def steps(prompt_mode: str, decode_mode: str) -> list[torch.Tensor]:
        cache = engine.decoder.new_cache()
        ops.set_amx_mode(prompt_mode)
        out = engine.runner.run([Row(cache, prompt, "last")])
        ops.set_amx_mode(decode_mode)
        out += engine.runner.run([Row(cache, row, "draft", draft=3)])
        out += engine.runner.run([Row(cache, token, "last")])
        return [t for t in out if t is not None]

    default = steps("prompts", "prompts")
    assert all(torch.equal(a, b) for a, b in zip(default, steps("bf16", "exact"), strict=True))
    assert not torch.equal(default[0], steps("exact", "exact")[0])  # the prompt step did run the bf16 tiles


@pytest.mark.parametrize("fmts", [("q4_0", "q4_0"), ("q4_0", "q8_0"), ("q8_0", "q6_k"), ("q4_k", "q6_k")])
def test_a_prompt_step_runs_bf16_tiles_only_for_experts_with_enough_tokens(fmts: tuple[str, str], bf16: None) -> None:
    # One call, top-1 routing: expert 0 has 40 tokens (bf16 tiles), expert 1 has 14 (exact int8 tiles: below the
    # bf16 threshold), expert 2 has 5 (the VNNI kernels). Each token's row must be its own expert's path's bits, in
    # one pass and in many (a Q6_K down among them: every format AMX runs has a bf16 fill).
    torch.manual_seed(7)
    fmt, down_fmt = fmts
    d, i, e = 256, 256, 3
    w13 = torch.stack([_packed(fmt, 2 * i, d) for _ in range(e)])
    w2 = torch.stack([_packed(down_fmt, d, i) for _ in range(e)])
    ids = torch.tensor([0] * 40 + [1] * 14 + [2] * 5)[torch.randperm(59)][:, None]
    x, wts = torch.randn(59, d), torch.rand(59, 1)
    ops.set_isa("amx")

    def call() -> torch.Tensor:
        return ops.moe(fmt, w13, w2, (d, i), x, ids, wts, down_fmt=down_fmt)

    wide = call()  # bf16 mode, every AMX group on the bf16 tiles (the fixture's threshold of 1)
    ops.set_amx_mode("exact")
    exact = call()
    ops.set_amx_mode("prompts")
    ops.set_amx_bf16_min_tokens(0)  # the default: 20
    on16 = ids[:, 0] == 0
    assert not torch.equal(wide[on16], exact[on16])
    for pass_bytes in (0, 48 << 10):
        before = ops.set_moe_pass_bytes(pass_bytes)
        try:
            with ops.prompt_step():
                got = call()
        finally:
            ops.set_moe_pass_bytes(before)
        assert torch.equal(got[on16], wide[on16]) and torch.equal(got[~on16], exact[~on16])
        assert torch.equal(call(), exact)  # outside a prompt step: exact
