"""Decode / multi-query attention over a 16-bit (fp16, bf16) or 8-bit (fp8 e4m3fn) KV cache read as is, against
plain-torch references, on every ISA path this CPU has plus the portable one, at 1-3 pool threads.

A narrow cache widens exactly to fp32, and the kernel runs the fp32 arithmetic on the widened values, so two facts
are checked: the narrow call equals the fp32 kernel on the widened cache bit for bit, and both are within fp32
rounding of a float64 softmax attention over the widened values. Against the unrounded (fp32) cache the error is
the cache's own rounding: ``ROUNDING_TOL``. Where a bf16 cache's score pass runs on AVX512-BF16 dot products (the
default on CPUs that have them, ``ops.attn_uses_bf16_dot``) the query is rounded to bf16 first: the reference then
takes the rounded query (``_scored``), and the error against the unrounded cache stays within ``ROUNDING_TOL``.
"""

from __future__ import annotations

import pytest
import torch

from freetoken_agent.runtime.errors import FreeTokenError
from freetoken_agent.runtime.kernels import ops
from freetoken_agent.runtime.model import layers
from freetoken_agent.runtime.model.spec import AttentionSpec
from tests.runtime.kernels.test_ops import every_path, isas  # noqa: F401  (the every-ISA x thread-count helper)

DTYPES = [torch.float16, torch.bfloat16, torch.float8_e4m3fn]
IDS = ["fp16", "bf16", "fp8"]
ROUNDING_TOL = {torch.float16: 4e-3, torch.bfloat16: 3e-2, torch.float8_e4m3fn: 0.65}
"""Max |out - out over the unrounded cache| for keys of std 3 and values of std 1: measured 1.9e-3 (fp16), 1.5e-2
(bf16) and 0.33 (fp8: 3 mantissa bits, so scores of std ~3 move by up to 1/16 of each term) over ``LAYOUTS``,
bounds at 2x."""

# (S keys, H, Hkv, Dh, Dv): GQA ratios 1/2/4/8/64, odd head dims, lengths off the 128-key block and the 8-key group
LAYOUTS = [(1, 16, 4, 128, 128), (300, 16, 4, 128, 128), (129, 4, 1, 72, 40), (513, 6, 2, 24, 136),
           (37, 8, 8, 63, 65), (200, 64, 1, 16, 8), (1000, 8, 1, 64, 64)]


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lo: int, hi: int, scale: float,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
    """float64 softmax attention of q [H, Dh] over keys lo..hi-1 of k [S, Hkv, Dh], v [S, Hkv, Dv] → fp32 [H, Dv]."""
    g = q.shape[0] // k.shape[1]
    kk = k[lo:hi].double().repeat_interleave(g, dim=1)
    vv = v[lo:hi].double().repeat_interleave(g, dim=1)
    scores = torch.einsum("hd,shd->hs", q.double(), kk) * scale
    if sinks is not None:
        scores = torch.cat([scores, sinks.double()[:, None]], dim=-1)
    probs = torch.softmax(scores, dim=-1)[:, : hi - lo]
    return torch.einsum("hs,shd->hd", probs, vv).float()


def _scored(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q`` as the score pass on the ISA path in use takes it: rounded to bf16 where a bf16 cache's scores run on
    AVX512-BF16 dot products (``ops.attn_uses_bf16_dot``), else as it is."""
    return q.bfloat16().float() if ops.attn_uses_bf16_dot(dtype) else q


def _paged(s: int, hkv: int, dh: int, dv: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    """fp32 k, v and their 16-bit copies as strided views (a run of pool pages: offset rows, an extra head)."""
    g = torch.Generator().manual_seed(seed)
    pool_k, pool_v = torch.randn(s + 7, hkv + 1, dh, generator=g) * 3, torch.randn(s + 7, hkv + 1, dv, generator=g)
    k32, v32 = pool_k[5 : 5 + s, :hkv], pool_v[2 : 2 + s, 1:]
    k16, v16 = pool_k.to(dtype)[5 : 5 + s, :hkv], pool_v.to(dtype)[2 : 2 + s, 1:]
    assert k16.stride(0) == (hkv + 1) * dh and v16.stride(0) == (hkv + 1) * dv  # strided between positions
    return k32, v32, k16, v16


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("dims", LAYOUTS)
def test_decode_over_a_16bit_cache(dims: tuple[int, ...], dtype: torch.dtype, isas: list[str]) -> None:
    s, h, hkv, dh, dv = dims
    k32, v32, k16, v16 = _paged(s, hkv, dh, dv, dtype, seed=s + h)
    q = torch.randn(h, dh, generator=torch.Generator().manual_seed(1))
    sinks = torch.randn(h, generator=torch.Generator().manual_seed(2)) * 2
    scale = dh**-0.5
    widened = _reference(q, k16.float(), v16.float(), 0, s, scale, sinks)
    unrounded = _reference(q, k32, v32, 0, s, scale, sinks)
    assert (widened - unrounded).abs().max().item() <= ROUNDING_TOL[dtype]
    with every_path(isas) as paths:
        for isa, threads in paths:
            got = ops.attn_decode(q, k16, v16, scale, sinks)
            qs = _scored(q, dtype)
            if qs is q:  # the fp32 arithmetic on the widened values
                assert torch.equal(got, ops.attn_decode(q, k16.float(), v16.float(), scale, sinks)), (isa, threads)
                assert torch.allclose(got, widened, rtol=1e-5, atol=1e-5), (isa, threads)
            else:  # bf16 dot products: exact products of the rounded query, fp32 sums
                ref = _reference(qs, k16.float(), v16.float(), 0, s, scale, sinks)
                assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5), (isa, threads)
                assert (got - unrounded).abs().max().item() <= ROUNDING_TOL[dtype], (isa, threads)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("dims", [(300, 16, 4, 128, 128), (129, 4, 1, 72, 40), (37, 8, 8, 63, 65),
                                  (2100, 16, 4, 128, 128), (6000, 6, 2, 24, 136)])
def test_query_chunks_over_a_16bit_cache(dims: tuple[int, ...], dtype: torch.dtype, isas: list[str]) -> None:
    """``attn_queries`` (short prefill chunks, sliding windows): each query over its own key range, as the
    reference, and bitwise as that query decoded alone over those keys. The two long layouts make a query decoded
    alone split its merge of blocks over heads on the pool (4 heads an item; 6 heads: a short last item), which
    the chunk's queries merge one query an item."""
    s, h, hkv, dh, dv = dims
    _, _, k16, v16 = _paged(s, hkv, dh, dv, dtype, seed=s)
    t = 9  # more than ATTN_QUERIES_PER_ITEM: two query groups
    q = torch.randn(t, h, dh, generator=torch.Generator().manual_seed(3))
    hi = torch.linspace(1, s, t).round().long()
    lo = torch.where(torch.arange(t) % 2 == 0, torch.zeros_like(hi), (hi - 100).clamp(min=0))  # causal / window
    sinks = torch.randn(h, generator=torch.Generator().manual_seed(4))
    with every_path(isas) as paths:
        for isa, threads in paths:
            out = ops.attn_queries(q, k16, v16, lo, hi, 0.2, sinks)
            for i in range(t):
                a, b = int(lo[i]), int(hi[i])
                assert torch.equal(out[i], ops.attn_decode(q[i], k16[a:b], v16[a:b], 0.2, sinks)), (isa, threads, i)
                ref = _reference(_scored(q[i], dtype), k16.float(), v16.float(), a, b, 0.2, sinks)
                assert torch.allclose(out[i], ref, rtol=1e-5, atol=1e-5), (isa, threads, i)


def test_mixed_or_unsupported_cache_dtypes_are_refused(isas: list[str]) -> None:
    q, k, v = torch.randn(4, 16), torch.randn(10, 2, 16).half(), torch.randn(10, 2, 16)
    with pytest.raises(FreeTokenError):
        ops.attn_decode(q, k, v, 1.0)  # k fp16, v fp32
    with pytest.raises(FreeTokenError):
        ops.attn_decode(q, k.double(), v.double(), 1.0)
    with pytest.raises(FreeTokenError):
        ops.attn_decode(q.half(), k, v.half(), 1.0)  # queries stay fp32


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("with_sinks", [False, True])
def test_torch_fallback_widens_block_by_block(dtype: torch.dtype, with_sinks: bool) -> None:
    """Without the C kernels a decode step over a 16-bit cache folds blocks of ``WIDEN_BLOCK`` keys (the
    flash-decoding merge in torch): the same attention as one softmax over the widened cache."""
    s, h, hkv, dh, dv = layers.WIDEN_BLOCK * 2 + 37, 8, 2, 32, 24
    _, _, k16, v16 = _paged(s, hkv, dh, dv, dtype, seed=7)
    q = torch.randn(1, h, dh)
    sinks = torch.randn(h) * 3 if with_sinks else None
    got = layers._blocked_one_query(q, k16, v16, 0.3, sinks)
    ref = _reference(q[0], k16.float(), v16.float(), 0, s, 0.3, sinks).reshape(1, -1)
    assert got.dtype == torch.float32 and torch.allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("case", ["decode", "window_decode", "sinks_chunk", "chunked_attention", "long_prefill"])
def test_engine_attention_over_a_16bit_cache_equals_the_widened_cache(dtype: torch.dtype, case: str,
                                                                       isas: list[str]) -> None:
    """``layers.attention_scores`` with a 16-bit cache under fp32 queries (every path it routes to: the decode
    kernel, the range kernel for windows / sinks / chunks up to ``EAGER_ATTENTION_TOKENS``, widening for long
    prefills) gives what it gives over the widened fp32 cache."""
    s, h, hkv, d = 70, 8, 2, 16
    kw = {"sliding_window": 24} if case == "window_decode" else {"chunk_size": 32} if case == "chunked_attention" else {}
    spec = AttentionSpec(kind="gqa", rope=None, num_heads=h, num_kv_heads=hkv, head_dim=d, v_head_dim=d, scale=d**-0.5, **kw)
    t = {"decode": 1, "window_decode": 1, "sinks_chunk": 5, "chunked_attention": 7, "long_prefill": 40}[case]
    _, _, k16, v16 = _paged(s, hkv, d, d, dtype, seed=11)
    q = torch.randn(t, h, d)
    q_pos = torch.arange(s - t, s)
    sinks = torch.randn(h) if case == "sinks_chunk" else None
    with every_path(isas, threads=(1, 2)) as paths:
        for isa, threads in paths:
            got = layers.attention_scores(q, k16, v16, q_pos, spec, sinks)
            qs = q if case == "long_prefill" else _scored(q, dtype)  # long prefills widen the cache for torch
            want = layers.attention_scores(qs, k16.float(), v16.float(), q_pos, spec, sinks)
            assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-5), (isa, threads)


@pytest.mark.parametrize("dtype", [torch.float32, *DTYPES], ids=["fp32", *IDS])
# head dims: whole 16-value steps (64, 48), a tail after them (36), an even 8-value piece alone then a tail (59)
@pytest.mark.parametrize("dims", [(133, 8, 2, 64, 64), (70, 6, 2, 36, 20), (150, 8, 2, 48, 112),
                                  (100, 8, 2, 59, 72)])
def test_a_verify_row_reads_its_keys_once_and_matches_decoding_alone(dims: tuple[int, ...], dtype: torch.dtype,
                                                                       isas: list[str]) -> None:
    """A row of consecutive queries over one key range (speculative decoding's last token and drafts, a causal
    chunk) runs as one pass per block for all of them; the ranges end on both sides of a block boundary, so the
    last block has fewer queries than the first. Each query is bitwise what it is decoded alone."""
    s, h, hkv, dh, dv = dims
    k32, v32, k16, v16 = _paged(s, hkv, dh, dv, dtype if dtype != torch.float32 else torch.float16, seed=s)
    k, v = (k32, v32) if dtype == torch.float32 else (k16, v16)
    for t in (3, 11):  # one item's queries, and more than one item
        q = torch.randn(t, h, dh, generator=torch.Generator().manual_seed(t))
        hi = torch.arange(s - t, s) + 1
        lo = torch.zeros_like(hi)
        vector: dict[str, torch.Tensor] = {}
        with every_path(isas) as paths:
            for isa, threads in paths:
                out = ops.attn_queries(q, k, v, lo, hi, 0.15, None)
                dot = ops.attn_uses_bf16_dot(k.dtype)
                if isa != "portable":  # the AVX2 loops and their 512-bit form: the same arithmetic, the same bits
                    assert torch.equal(vector.setdefault(f"dot={dot}", out), out), (isa, threads, t)
                for i in range(t):
                    b = int(hi[i])
                    assert torch.equal(out[i], ops.attn_decode(q[i], k[:b], v[:b], 0.15)), (isa, threads, t, i)
                    ref = _reference(_scored(q[i], k.dtype), k.float(), v.float(), 0, b, 0.15, None)
                    assert torch.allclose(out[i], ref, rtol=1e-5, atol=1e-5), (isa, threads, t, i)


def test_every_fp8_code_widens_exactly_and_writes_round_as_torch_casts(isas: list[str]) -> None:
    """Each of the 254 finite e4m3fn codes read by the kernels is torch's widening of it (a one-key cache: the output
    is the value row itself), on every path; ``ops.kv_store`` (the fused step's cache write) narrows as the pool's
    clamp-then-cast does, ties, subnormals, saturation and NaN included."""
    codes = torch.arange(256, dtype=torch.uint8)
    finite = codes[(codes & 0x7F) != 0x7F].view(torch.float8_e4m3fn)
    v = finite.reshape(1, 1, -1)
    k = torch.zeros(1, 1, 8, dtype=torch.float8_e4m3fn)
    q = torch.randn(1, 8, generator=torch.Generator().manual_seed(0))
    with every_path(isas) as paths:
        for isa, threads in paths:
            assert torch.equal(ops.attn_decode(q, k, v, 1.0)[0], finite.float()), (isa, threads)
    g = torch.Generator().manual_seed(1)
    special = torch.tensor([0.0, -0.0, 448.0, -448.0, 464.0, 479.9, 480.0, 1e9, -1e9, 2.0**-9, 2.0**-10,
                            1.5 * 2.0**-10, 3 * 2.0**-10, 2.0**-6, 2.0**-6 * (1 + 2.0**-4), 1.0 + 2.0**-4,
                            1.0 + 3 * 2.0**-4, float("inf"), -float("inf"), float("nan"), 1e-40])
    x = torch.cat([special, torch.randn(20000, generator=g) * 10.0 ** torch.randint(-4, 3, (20000,), generator=g)])
    nan = x.isnan()
    for dtype, top in ((torch.float8_e4m3fn, 448.0), (torch.float16, 65504.0), (torch.bfloat16, None)):
        want = (x.clamp(-top, top) if top else x).to(dtype)
        got = ops.kv_store(x, dtype)
        bits = torch.int8 if dtype == torch.float8_e4m3fn else torch.int16
        assert torch.equal(got.view(bits)[~nan], want.view(bits)[~nan]), dtype
        assert got.float()[nan].isnan().all(), dtype  # a NaN stays a NaN (torch's bf16 NaN bits vary by path)
    with pytest.raises(FreeTokenError, match="kv_store"):
        ops.kv_store(x, torch.int8)


@pytest.mark.parametrize("dtype", [torch.float32, *DTYPES], ids=["fp32", *IDS])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("pos", [5, layers.WIDEN_BLOCK + 3, layers.WIDEN_BLOCK * 2 + 36])
def test_a_lone_query_masks_later_keys_without_reading_its_position(dtype: torch.dtype, with_sinks: bool,
                                                                   pos: int) -> None:
    """The accelerator's decode step: the query's position stays a device tensor and keys past it are masked there
    (no read back to the host, i.e. no sync per layer), in one softmax and in the block-by-block 16-bit fallback
    (a position in block 0 masks the whole of blocks 1 and 2)."""
    s, h, hkv, dh, dv = layers.WIDEN_BLOCK * 2 + 37, 8, 2, 32, 24
    _, _, k16, v16 = _paged(s, hkv, dh, dv, dtype if dtype != torch.float32 else torch.float16, seed=3)
    k, v = (k16, v16) if dtype != torch.float32 else (k16.float(), v16.float())
    q = torch.randn(1, h, dh)
    sinks = torch.randn(h) * 3 if with_sinks else None
    got = layers._one_query_attention(q, k, v, 0.3, sinks, torch.tensor([pos]))
    ref = _reference(q[0], k.float(), v.float(), 0, pos + 1, 0.3, sinks).reshape(1, -1)
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_an_accelerator_decode_step_takes_the_masked_path() -> None:
    """On a non-CPU device ``attention_scores`` of one query never reads its position back: on the meta device (no
    data at all) it runs, where reading the position would raise."""
    spec = AttentionSpec(kind="gqa", num_heads=4, num_kv_heads=2, head_dim=16, v_head_dim=16, scale=0.25, rope=None)
    q, k, v = torch.randn(1, 4, 16), torch.randn(9, 2, 16), torch.randn(9, 2, 16)
    for kv in (torch.float32, torch.float16):
        out = layers.attention_scores(q.to("meta"), k.to("meta", kv), v.to("meta", kv), torch.tensor([8]).to("meta"),
                                      spec, None)
        assert out.shape == (1, 64)
    with pytest.raises(RuntimeError, match="meta tensors"):  # what reading the position would have done
        int(torch.tensor([8]).to("meta")[0])


def _cpu_has_avx512_bf16() -> bool:
    try:
        return " avx512_bf16" in open("/proc/cpuinfo").read()
    except OSError:
        return False


def test_bf16_score_pass_mode(isas: list[str]) -> None:
    """A bf16 cache's score pass runs on AVX512-BF16 dot products by default where the CPU has them and an AVX-512
    path is in use: the query rounded to bf16, exact products, fp32 sums. Turned off it is the fp32 kernel's
    arithmetic on the widened cache, bit for bit; fp16 caches and the AVX2 / portable paths never take it."""
    s, h, hkv, dh = 700, 16, 4, 72
    _, _, k16, v16 = _paged(s, hkv, dh, dh, torch.bfloat16, seed=21)
    q = torch.randn(h, dh, generator=torch.Generator().manual_seed(5)) * 2
    assert not ops.attn_uses_bf16_dot(torch.float16) and not ops.attn_uses_bf16_dot(torch.float32)
    with every_path(isas, threads=(2,)) as paths:
        for isa, _ in paths:
            exact = ops.attn_decode(q, k16.float(), v16.float(), 0.1)  # this path's fp32 kernel, widened cache
            dot = ops.attn_uses_bf16_dot(torch.bfloat16)
            assert dot == (isa in ("avx512vnni", "amx") and _cpu_has_avx512_bf16()), isa
            before = ops.set_attn_bf16_dot(False)
            try:
                assert not ops.attn_uses_bf16_dot(torch.bfloat16)
                assert torch.equal(ops.attn_decode(q, k16, v16, 0.1), exact), isa
                ops.set_attn_bf16_dot(True)
                assert ops.attn_uses_bf16_dot(torch.bfloat16) == dot, isa
                got = ops.attn_decode(q, k16, v16, 0.1)
                want = _reference(q.bfloat16().float() if dot else q, k16.float(), v16.float(), 0, s, 0.1)
                assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), isa
                assert dot or torch.equal(got, exact), isa
            finally:
                ops.set_attn_bf16_dot(before)


def test_bf16_score_pass_can_be_turned_off_at_load(isas: list[str]) -> None:
    """``$FREETOKEN_ATTN_BF16_DOT=0`` keeps a bf16 cache's scores on the widened fp32 arithmetic from the start."""
    import os
    import subprocess
    import sys

    code = ("import torch; from freetoken_agent.runtime.kernels import ops\n"
            "print(ops.attn_uses_bf16_dot(torch.bfloat16), ops.set_attn_bf16_dot(True), ops.attn_uses_bf16_dot())")
    has = str(ops.attn_uses_bf16_dot())  # the default here (the isas fixture restored the best path)
    for value, want in (("0", ["False", "False", has]), ("1", [has, "True", has])):
        env = {**os.environ, "FREETOKEN_ATTN_BF16_DOT": value}
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == want, (value, proc.stdout)
