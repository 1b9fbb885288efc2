"""The @triton.jit kernels (this module imports triton; the launchers import it only when they run a kernel).

Shapes and layouts are documented in the launchers: ``dequant_gemm.py`` and ``moe_gemm.py``.
"""

import triton
import triton.language as tl

SPLIT, BLOCKS, TILES = 0, 1, 2  # weight layouts (LAYOUT): see dequant_gemm.py and moe_gemm.py


@triton.jit
def load_dequant(codes_ptr, scales_ptr, offs_n, offs_k, N, K, IS_Q4: tl.constexpr, LAYOUT: tl.constexpr):
    """[BN, BK] fp32 weight values for rows offs_n, columns offs_k (masked to N, K).

    LAYOUT 0 (split): int8/uint8 ``codes`` and fp16 ``scales`` in two arrays. 1 (blocks): GGUF Q8_0 / Q4_0 blocks
    ``[N, K/32, P]`` at ``codes_ptr`` (uint8; P = 34 / 18: fp16 scale, then the codes). 2 (tiles): the C kernels'
    tiles of 8 rows (``runtime/kernels/layout.py``): per tile-block the 8 rows' scales, then 32-byte chunks holding
    4 bytes of each row. ``scales_ptr`` is unused by the block layouts.
    """
    mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    group = offs_k // 32
    j = offs_k % 32
    if LAYOUT == 0:
        scale = tl.load(scales_ptr + offs_n[:, None] * (K // 32) + group[None, :], mask=mask, other=0.0)
        if IS_Q4:
            byte_idx = group * 16 + (j % 16)
            byte = tl.load(codes_ptr + offs_n[:, None] * (K // 2) + byte_idx[None, :], mask=mask, other=0)
            shift = (j // 16) * 4
            code = ((byte.to(tl.int32) >> shift[None, :]) & 0xF) - 8
        else:
            code = tl.load(codes_ptr + offs_n[:, None] * K + offs_k[None, :], mask=mask, other=0).to(tl.int32)
        return code.to(tl.float32) * scale.to(tl.float32)
    if IS_Q4:
        P = 18
    else:
        P = 34
    nb = K // 32
    if LAYOUT == 1:
        start = (offs_n[:, None] * nb + group[None, :]) * P  # the block's first byte
        at_scale = start
        if IS_Q4:
            at_code = start + 2 + (j % 16)[None, :]
            shift = (j // 16) * 4
        else:
            at_code = start + 2 + j[None, :]
    else:
        start = ((offs_n // 8)[:, None] * nb + group[None, :]) * (8 * P)  # the tile-block's first byte
        row = (offs_n % 8)[:, None]
        at_scale = start + 2 * row
        if IS_Q4:  # chunk c, byte p of a row: value 8c + p (low nibble), 8c + 4 + p (high)
            at_code = start + 16 + (j // 8)[None, :] * 32 + row * 4 + (j % 4)[None, :]
            shift = ((j % 8) // 4) * 4
        else:  # chunk c, byte p of a row: value 4c + p
            at_code = start + 16 + (j // 4)[None, :] * 32 + row * 4 + (j % 4)[None, :]
    lo = tl.load(codes_ptr + at_scale, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(codes_ptr + at_scale + 1, mask=mask, other=0).to(tl.uint16)
    scale = (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)
    byte = tl.load(codes_ptr + at_code, mask=mask, other=0)
    if IS_Q4:
        code = ((byte.to(tl.int32) >> shift[None, :]) & 0xF) - 8
    else:
        code = byte.to(tl.int8, bitcast=True).to(tl.int32)
    return code.to(tl.float32) * scale


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
        w = load_dequant(codes_ptr, scales_ptr, offs_n, offs_k, N, K, IS_Q4, 0)
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
        w = load_dequant(codes_ptr, scales_ptr, offs_n, offs_k, N, K, IS_Q4, 0)
        acc += tl.dot(x.to(tl.float16), tl.trans(w.to(tl.float16)), out_dtype=tl.float32)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc, mask=mask)


@triton.jit
def grouped_gemm(x_ptr, codes_ptr, scales_ptr, y_ptr, sorted_pair_ptr, block_slot_ptr, num_pairs, token_div,
                 N, K, stride_xm, stride_ym, stride_codes_s, stride_scales_s,
                 IS_Q4: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 LAYOUT: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    """IEEE: fp32 operands at fp32 precision; else fp16 operands for the tensor cores (fp32 accumulation)."""
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
            w = load_dequant(codes, scales, offs_n, offs_k, N, K, IS_Q4, LAYOUT)
            if IEEE:
                acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee", out_dtype=tl.float32)
            else:
                acc += tl.dot(x.to(tl.float16), tl.trans(w.to(tl.float16)), out_dtype=tl.float32)
        out = y_ptr + pairs[:, None] * stride_ym + offs_n[None, :]
        tl.store(out, acc, mask=valid[:, None] & (offs_n[None, :] < N))


@triton.jit
def pairs_gemv(x_ptr, codes_ptr, y_ptr, pair_row_ptr, pair_slot_ptr, N, K, stride_xm, stride_ym, stride_codes_s,
               IS_Q4: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LAYOUT: tl.constexpr):  # fmt: skip
    """y[p, n] = x[pair_row[p]] . w_slot(pair_slot[p])[n] in fp32: one program per (pair, block of rows), no
    sorting and no host read (decode: a handful of pairs, each slot's rows read by its own programs)."""
    p, pid_n = tl.program_id(0), tl.program_id(1)
    row = tl.load(pair_row_ptr + p).to(tl.int64)
    slot = tl.load(pair_slot_ptr + p).to(tl.int64)
    codes = codes_ptr + slot * stride_codes_s
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_xm + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
        w = load_dequant(codes, codes, offs_n, offs_k, N, K, IS_Q4, LAYOUT)
        acc += tl.sum(w * x[None, :], axis=1)
    tl.store(y_ptr + p * stride_ym + offs_n, acc, mask=offs_n < N)
