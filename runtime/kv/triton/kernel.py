"""The @triton.jit paged-attention decode kernel (shapes and layouts: see ``paged_attention.py``)."""

import triton
import triton.language as tl


@triton.jit
def paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, sinks_ptr, out_ptr,
    scale, window, max_pages,
    stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_ob, stride_oh,
    GROUP: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SINKS: tl.constexpr,
):  # fmt: skip
    b, h = tl.program_id(0), tl.program_id(1)
    kvh = h // GROUP
    seq_len = tl.load(lens_ptr + b)
    q_pos = seq_len - 1
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
    if HAS_SINKS:  # the sink joins the softmax as one extra logit with a zero value vector
        m_i = tl.load(sinks_ptr + h).to(tl.float32)
        l_i = 1.0
    else:
        m_i = -float("inf")
        l_i = 0.0
    acc = tl.zeros((BLOCK_DV,), dtype=tl.float32)
    start = 0
    if window > 0:
        start = tl.maximum(q_pos - window + 1, 0)
    start = (start // BLOCK_N) * BLOCK_N
    for n0 in range(start, seq_len, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < seq_len
        if window > 0:
            valid = valid & (pos > q_pos - window)
        page = tl.load(table_ptr + b * max_pages + pos // PAGE, mask=valid, other=0)
        slot = pos % PAGE
        k = tl.load(k_ptr + page[:, None] * stride_kp + slot[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :],
                    mask=valid[:, None] & (offs_d[None, :] < D), other=0.0).to(tl.float32)  # fmt: skip
        s = tl.sum(k * q[None, :], axis=1) * scale
        s = tl.where(valid, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)
        p = tl.where(valid, p, 0.0)
        v = tl.load(v_ptr + page[:, None] * stride_vp + slot[:, None] * stride_vs + kvh * stride_vh + offs_dv[None, :],
                    mask=valid[:, None] & (offs_dv[None, :] < DV), other=0.0).to(tl.float32)  # fmt: skip
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    out = acc / l_i
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_dv, out, mask=offs_dv < DV)
