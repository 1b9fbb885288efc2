"""The @triton.jit kernels (this module imports triton; the launchers import it only when they run a kernel).

Shapes and layouts are documented in the launchers: ``dequant_gemm.py`` and ``moe_gemm.py``.
"""

import triton
import triton.language as tl

@triton.jit
def load_dequant(codes_ptr, scales_ptr, offs_n, offs_k, N, K, IS_Q4: tl.constexpr):
    """[BN, BK] fp32 weight values for rows offs_n, columns offs_k (masked to N, K)."""
    mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    group = offs_k // 32
    scale = tl.load(scales_ptr + offs_n[:, None] * (K // 32) + group[None, :], mask=mask, other=0.0)
    if IS_Q4:
        j = offs_k % 32
        byte_idx = group * 16 + (j % 16)
        byte = tl.load(codes_ptr + offs_n[:, None] * (K // 2) + byte_idx[None, :], mask=mask, other=0)
        shift = (j // 16) * 4
        code = ((byte.to(tl.int32) >> shift[None, :]) & 0xF) - 8
    else:
        code = tl.load(codes_ptr + offs_n[:, None] * K + offs_k[None, :], mask=mask, other=0).to(tl.int32)
    return code.to(tl.float32) * scale.to(tl.float32)

@triton.jit
def gemv_splitk(x_ptr, codes_ptr, scales_ptr, y_ptr, M, N, K, stride_xm, stride_ym, K_PER_SPLIT,
                IS_Q4: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    pid_n, pid_k, m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    k_start = pid_k * K_PER_SPLIT
    for k0 in range(k_start, k_start + K_PER_SPLIT, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + m * stride_xm + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
        w = load_dequant(codes_ptr, scales_ptr, offs_n, offs_k, N, K, IS_Q4)
        acc += tl.sum(w * x[None, :], axis=1)
    tl.atomic_add(y_ptr + m * stride_ym + offs_n, acc, mask=offs_n < N)

@triton.jit
def gemm_tiled(x_ptr, codes_ptr, scales_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
               IS_Q4: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)  # fmt: skip
        w = load_dequant(codes_ptr, scales_ptr, offs_n, offs_k, N, K, IS_Q4)
        acc += tl.dot(x.to(tl.float16), tl.trans(w.to(tl.float16)), out_dtype=tl.float32)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc, mask=mask)


@triton.jit
def grouped_gemm(x_ptr, codes_ptr, scales_ptr, y_ptr, sorted_pair_ptr, block_slot_ptr, num_pairs, token_div,
                 N, K, stride_xm, stride_ym, stride_codes_s, stride_scales_s,
                 IS_Q4: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    slot = tl.load(block_slot_ptr + pid_m)
    if slot >= 0:
        pairs = tl.load(sorted_pair_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = pairs < num_pairs
        rows = tl.where(valid, pairs // token_div, 0)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        codes = codes_ptr + slot.to(tl.int64) * stride_codes_s
        scales = scales_ptr + slot.to(tl.int64) * stride_scales_s
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :],
                        mask=valid[:, None] & (offs_k[None, :] < K), other=0.0)  # fmt: skip
            w = load_dequant(codes, scales, offs_n, offs_k, N, K, IS_Q4)
            acc += tl.dot(x.to(tl.float16), tl.trans(w.to(tl.float16)), out_dtype=tl.float32)
        out = y_ptr + pairs[:, None] * stride_ym + offs_n[None, :]
        tl.store(out, acc, mask=valid[:, None] & (offs_n[None, :] < N))
