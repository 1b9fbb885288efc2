"""Attention over a bf16 cache on AMX-BF16 tiles (``ops.set_attn_amx``, opt-in): against a float64 reference and the
vector loops, batch invariant (a query's bits alone, in a chunk, in a window, at any thread count), and through the
engine on the trained built-in model. The dispatch itself is checked on every CPU; the tile path only where the CPU
has AMX-BF16 (skipped elsewhere with the reason)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from freetoken_agent.runtime.kernels import build, ops
from tests.runtime.kernels.test_attn_kv16 import _paged, _reference

# (S keys, H, Hkv, Dh, Dv): GQA 4 / 8 / 1 / 16 query heads per kv head (one tile's 5 rows, several), MLA-like Dh != Dv,
# lengths off the 128-key block, the 32-key step and the 16-key tile
SHAPES = [(1, 16, 4, 128, 128), (300, 16, 4, 128, 128), (257, 32, 4, 128, 128), (129, 12, 2, 192, 128),
          (1000, 8, 1, 64, 64), (50, 16, 16, 64, 32), (77, 16, 1, 32, 64)]


@pytest.fixture()
def amx() -> Iterator[None]:
    if build.load() is None:
        pytest.skip(f"C kernels unavailable here: {build.status().reason}")
    before = ops.set_attn_amx(True)
    try:
        if not ops.attn_uses_amx(torch.bfloat16, 128):
            pytest.skip(f"no AMX-BF16 attention on this CPU (ISA path {ops.current_isa()})")
        yield
    finally:
        ops.set_attn_amx(before)
        ops.set_isa("best")


def test_the_dispatch_takes_only_bf16_caches_of_whole_tiles_on_amx() -> None:
    if build.load() is None:
        pytest.skip(f"C kernels unavailable here: {build.status().reason}")
    before = ops.set_attn_amx(False)
    try:
        assert not ops.attn_uses_amx(torch.bfloat16, 128)  # off unless asked for
        ops.set_attn_amx(True)
        for dtype in (torch.float32, torch.float16, torch.float8_e4m3fn, torch.int8):
            assert not ops.attn_uses_amx(dtype, 128), dtype
        for dh, dv in ((72, 72), (128, 40), (16, 16)):
            assert not ops.attn_uses_amx(torch.bfloat16, dh, dv), (dh, dv)
        ops.set_isa("avx512vnni" if "avx512vnni" in ops.available_isas() else "portable")
        assert not ops.attn_uses_amx(torch.bfloat16, 128)  # only on the amx path
    finally:
        ops.set_attn_amx(before)
        ops.set_isa("best")


@pytest.mark.parametrize("dims", SHAPES)
def test_decode_on_tiles_is_the_reference_at_fp32_accuracy(dims: tuple[int, ...], amx: None) -> None:
    s, h, hkv, dh, dv = dims
    _, _, k16, v16 = _paged(s, hkv, dh, dv, torch.bfloat16, seed=s + h)
    q = torch.randn(h, dh, generator=torch.Generator().manual_seed(1)) * 2
    sinks = torch.randn(h, generator=torch.Generator().manual_seed(2)) * 2
    for with_sinks in (None, sinks):
        want = _reference(q, k16.float(), v16.float(), 0, s, dh**-0.5, with_sinks)
        outs = []
        for threads in (1, 2, 3):
            ops.set_threads(threads)
            calls = ops.attn_amx_calls()
            outs.append(ops.attn_decode(q, k16, v16, dh**-0.5, with_sinks))
            assert ops.attn_amx_calls() > calls  # the tiles did the work
            assert torch.allclose(outs[-1], want, rtol=1e-5, atol=1e-5), (threads, (outs[-1] - want).abs().max())
        assert all(torch.equal(outs[0], o) for o in outs)  # the same bits on any pool size
        ops.set_attn_amx(False)  # the vector loops at fp32 accuracy (not their bf16 dot products' rounded query)
        dot = ops.set_attn_bf16_dot(False)
        vector = ops.attn_decode(q, k16, v16, dh**-0.5, with_sinks)
        ops.set_attn_bf16_dot(dot)
        ops.set_attn_amx(True)
        assert torch.allclose(outs[0], vector, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dims", [(300, 16, 4, 128, 128), (257, 32, 4, 128, 128), (129, 12, 2, 192, 128),
                                  (77, 16, 1, 32, 64)])
def test_a_query_in_a_chunk_or_window_is_bitwise_the_query_alone(dims: tuple[int, ...], amx: None) -> None:
    """Causal chunks (verify rows, prefill) and sliding windows: every query of ``attn_queries`` is bitwise what
    ``attn_decode`` gives it over its own keys, and the float64 reference within fp32 rounding."""
    s, h, hkv, dh, dv = dims
    _, _, k16, v16 = _paged(s, hkv, dh, dv, torch.bfloat16, seed=s)
    for t in (3, 9, 20):
        q = torch.randn(t, h, dh, generator=torch.Generator().manual_seed(t))
        hi = torch.arange(s - t, s) + 1
        lo = torch.where(torch.arange(t) % 3 == 1, (hi - 70).clamp(min=0), torch.zeros_like(hi))
        out = ops.attn_queries(q, k16, v16, lo, hi, 0.11)
        for i in range(t):
            a, b = int(lo[i]), int(hi[i])
            assert torch.equal(out[i], ops.attn_decode(q[i], k16[a:b], v16[a:b], 0.11)), (t, i)
            ref = _reference(q[i], k16.float(), v16.float(), a, b, 0.11)
            assert torch.allclose(out[i], ref, rtol=1e-5, atol=1e-5), (t, i)


def test_the_builtin_model_decodes_the_same_tokens_on_tiles(amx: None) -> None:
    """The trained built-in model with a bf16 cache: greedy tokens after an agent prompt (chunked prefill, decode
    steps, speculative verify rows) are the vector loops' tokens, with the tiles doing the attention."""
    from freetoken_agent.runtime.builtin import builtin_model_dir
    from freetoken_agent.runtime.engine import Engine

    engine = Engine.from_pretrained(builtin_model_dir(), kv_dtype="bf16")
    try:
        spec = engine.spec.layers[0].attention
        if not ops.attn_uses_amx(torch.bfloat16, spec.head_dim, spec.v_head_dim):
            pytest.skip(f"the built-in model's heads ({spec.head_dim}/{spec.v_head_dim}) are not whole tiles")
        prompt = engine.tokenizer.encode("def median(values):\n    \"\"\"Return the median of a list.\"\"\"\n" * 20)
        runs = {}
        for on in (True, False):
            ops.set_attn_amx(on)
            calls = ops.attn_amx_calls()
            runs[on] = engine.generate(prompt, max_new_tokens=40, temperature=0.0, stop_token_ids=[]).token_ids
            assert (ops.attn_amx_calls() > calls) == on
        assert runs[True] == runs[False]
    finally:
        engine.close()


def test_long_prefill_chunks_over_a_bf16_cache_take_the_tiles(amx: None) -> None:
    """With the tiles on, a chunk longer than ``EAGER_ATTENTION_TOKENS`` over a bf16 cache goes through the C kernel
    (not widened for torch's fused attention): the tiles run, each query is bitwise itself decoded alone, and the
    result is the widened cache's attention within fp32 rounding."""
    from freetoken_agent.runtime.model import layers
    from freetoken_agent.runtime.model.spec import AttentionSpec

    s, h, hkv, d = 200, 8, 2, 64
    t = layers.EAGER_ATTENTION_TOKENS + 24
    spec = AttentionSpec(kind="gqa", rope=None, num_heads=h, num_kv_heads=hkv, head_dim=d, v_head_dim=d, scale=d**-0.5)
    _, _, k16, v16 = _paged(s, hkv, d, d, torch.bfloat16, seed=5)
    q = torch.randn(t, h, d, generator=torch.Generator().manual_seed(6))
    q_pos = torch.arange(s - t, s)
    calls = ops.attn_amx_calls()
    got = layers.attention_scores(q, k16, v16, q_pos, spec, None)
    assert ops.attn_amx_calls() > calls
    for i in (0, t // 2, t - 1):
        b = int(q_pos[i]) + 1
        assert torch.equal(got[i], ops.attn_decode(q[i], k16[:b], v16[:b], spec.scale).reshape(-1)), i
    want = layers.attention_scores(q, k16.float(), v16.float(), q_pos, spec, None)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
