"""The Triton paged decode attention kernel against its plain-torch reference, under TRITON_INTERPRET=1 on the CPU
(compiled on a CUDA machine)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # a CUDA machine runs the compiled kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first triton import

import pytest

from freetoken_agent.runtime.kv.triton import paged_attention_decode, reference_paged_attention
from freetoken_agent.runtime.model.layers import attention_scores
from freetoken_agent.runtime.model.spec import AttentionSpec

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def _case(b: int, h: int, hkv: int, d: int, dv: int, page: int, lens: list[int], seed: int):
    g = torch.Generator().manual_seed(seed)
    max_pages = max(-(-n // page) for n in lens)
    pool_pages = b * max_pages + 3
    k_pool = torch.randn(pool_pages, page, hkv, d, generator=g)
    v_pool = torch.randn(pool_pages, page, hkv, dv, generator=g)
    perm = torch.randperm(pool_pages, generator=g)[: b * max_pages].view(b, max_pages)  # scattered pages
    q = torch.randn(b, h, d, generator=g)
    return [t.to(DEVICE) for t in (q, k_pool, v_pool, perm.int(), torch.tensor(lens, dtype=torch.int32))]


@pytest.mark.parametrize(
    "b,h,hkv,d,dv,page,lens,window,sinks",
    [
        (1, 4, 4, 16, 16, 4, [1], 0, False),
        (3, 4, 2, 16, 16, 4, [5, 17, 32], 0, False),  # GQA, lengths not multiple of the page
        (2, 6, 2, 24, 20, 8, [9, 30], 0, True),  # dims not powers of two, sinks (GPT-OSS)
        (2, 4, 1, 16, 16, 4, [40, 13], 7, False),  # MQA, sliding window
        (2, 2, 2, 12, 12, 16, [33, 3], 5, True),
    ],
)
def test_kernel_matches_reference(b, h, hkv, d, dv, page, lens, window, sinks) -> None:
    q, k_pool, v_pool, table, lens_t = _case(b, h, hkv, d, dv, page, lens, seed=b * 100 + h)
    sink = torch.randn(h, generator=torch.Generator().manual_seed(7)).to(DEVICE) if sinks else None
    got = paged_attention_decode(q, k_pool, v_pool, table, lens_t, scale=d**-0.5, sinks=sink, window=window)
    want = reference_paged_attention(q, k_pool, v_pool, table, lens_t, d**-0.5, sink, window)
    assert (got - want).abs().max().item() <= 1e-4


def test_reference_equals_decoder_attention() -> None:
    """The reference agrees with the decoder's own attention over the same (gathered) keys."""
    q, k_pool, v_pool, table, lens_t = _case(1, 4, 2, 16, 16, 4, [11], seed=3)
    spec = AttentionSpec(kind="gqa", num_heads=4, num_kv_heads=2, head_dim=16, v_head_dim=16, scale=0.25, rope=None,
                         sliding_window=6, sinks=True)
    sinks = torch.randn(4).to(DEVICE)
    pages = table[0, :3].long()
    k = k_pool[pages].reshape(-1, 2, 16)[:11]
    v = v_pool[pages].reshape(-1, 2, 16)[:11]
    ours = attention_scores(q[0][None], k, v, torch.tensor([10], device=q.device), spec, sinks).view(4, 16)
    ref = reference_paged_attention(q, k_pool, v_pool, table, lens_t, 0.25, sinks, 6)[0]
    assert (ours - ref).abs().max().item() <= 1e-5


def test_launcher_rejects_bad_shapes() -> None:
    q, k_pool, v_pool, table, lens_t = _case(1, 4, 2, 16, 16, 4, [5], seed=1)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention_decode(q[:, :3], k_pool, v_pool, table, lens_t, 0.25)
    with pytest.raises(ValueError, match="shape mismatch"):
        paged_attention_decode(q[..., :8], k_pool, v_pool, table, lens_t, 0.25)
