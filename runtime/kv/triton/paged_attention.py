"""Launcher and plain-torch reference for paged decode attention.

Legend: B sequences (one new query each), H query heads, Hkv key/value heads (GQA: head h reads kv head
h // (H / Hkv)), D query/key dim, Dv value dim, P pool pages, S positions per page, M max pages per sequence.

- ``q``      [B, H, D]       queries of the newest position of each sequence (already rotated)
- ``k_pool`` [P, S, Hkv, D]  keys, ``v_pool`` [P, S, Hkv, Dv] values (a ``PagePool`` layer's tensors)
- ``table``  [B, M] int32    page ids per sequence (entries past the sequence's pages are ignored)
- ``lens``   [B] int32       positions per sequence, the new one included
- ``sinks``  [H] or None     per-head sink logit (GPT-OSS); ``window`` > 0: sliding window length
Returns [B, H, Dv] in fp32.
"""

from __future__ import annotations

import torch


def reference_paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                              lens: torch.Tensor, scale: float, sinks: torch.Tensor | None = None,
                              window: int = 0) -> torch.Tensor:
    b, h, _ = q.shape
    page, hkv = k_pool.shape[1], k_pool.shape[2]
    out = torch.empty(b, h, v_pool.shape[-1], dtype=torch.float32, device=q.device)
    for i in range(b):
        n = int(lens[i])
        pages = table[i, : -(-n // page)].long()
        k = k_pool[pages].reshape(-1, hkv, k_pool.shape[-1])[:n].float()  # [n, Hkv, D]
        v = v_pool[pages].reshape(-1, hkv, v_pool.shape[-1])[:n].float()
        k, v = (t.repeat_interleave(h // hkv, dim=1) for t in (k, v))  # [n, H, *]
        scores = torch.einsum("hd,nhd->hn", q[i].float(), k) * scale  # [H, n]
        if window > 0:
            scores[:, : max(0, n - window)] = float("-inf")
        if sinks is not None:
            scores = torch.cat([scores, sinks.float()[:, None]], dim=1)
        probs = torch.softmax(scores, dim=-1)[:, :n]
        out[i] = torch.einsum("hn,nhd->hd", probs, v)
    return out


def paged_attention_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                           lens: torch.Tensor, scale: float, sinks: torch.Tensor | None = None,
                           window: int = 0, block_n: int = 16) -> torch.Tensor:
    """Decode attention over paged KV with one Triton program per (sequence, head)."""
    import triton

    from freetoken_agent.runtime.kv.triton.kernel import paged_decode_kernel

    if q.dim() != 3 or k_pool.dim() != 4 or v_pool.dim() != 4:
        raise ValueError("expected q [B, H, D], k_pool [P, S, Hkv, D], v_pool [P, S, Hkv, Dv]")
    b, h, d = q.shape
    pages, page, hkv, dk = k_pool.shape
    if dk != d or v_pool.shape[:3] != k_pool.shape[:3]:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k_pool {tuple(k_pool.shape)}, v_pool {tuple(v_pool.shape)}")
    if h % hkv:
        raise ValueError(f"{h} query heads are not a multiple of {hkv} kv heads")
    if table.shape[0] != b or lens.shape != (b,):
        raise ValueError("table must be [B, M] and lens [B]")
    for name, t in (("q", q), ("k_pool", k_pool), ("v_pool", v_pool)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    table = table.to(torch.int32).contiguous()
    lens = lens.to(torch.int32).contiguous()
    dv = v_pool.shape[-1]
    out = torch.empty(b, h, dv, dtype=torch.float32, device=q.device)
    sinks_arg = sinks if sinks is not None else out  # unused pointer when HAS_SINKS is False
    paged_decode_kernel[(b, h)](
        q, k_pool, v_pool, table, lens, sinks_arg, out,
        float(scale), int(window), table.shape[1],
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2), out.stride(0), out.stride(1),
        GROUP=h // hkv, PAGE=page, D=d, DV=dv, BLOCK_D=triton.next_power_of_2(d),
        BLOCK_DV=triton.next_power_of_2(dv), BLOCK_N=block_n, HAS_SINKS=sinks is not None,
    )  # fmt: skip
    return out
