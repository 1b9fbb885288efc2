"""C kernels against the plain-torch reference (dequantize, fp32 matmul), for every ISA path this CPU has."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from freetoken_agent.runtime.errors import FreeTokenError
from freetoken_agent.runtime.kernels import build, ops
from freetoken_agent.runtime.kernels.layout import pack_blocks, unpack_blocks
from freetoken_agent.runtime.quant import quantize

SHAPES = [(64, 256), (37, 100), (5, 31), (200, 96)]


@pytest.fixture(scope="module")
def isas() -> list[str]:
    if build.load() is None:
        pytest.skip(f"C kernels unavailable here: {build.status().reason}")
    yield ops.available_isas()
    ops.set_isa("best")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("fmt", ["q8", "q4"])
@pytest.mark.parametrize("shape", SHAPES)
def test_pack_round_trips_and_dequant_is_exact(fmt: str, shape: tuple[int, int], isas: list[str]) -> None:
    n, k = shape
    q = quantize(torch.randn(n, k), fmt)
    pw = ops.PackedWeight.from_blocks(q)
    assert pw.nbytes == ops.packed_bytes(fmt, n, k) == ops._lib().ft_packed_bytes(ops.FMT_CODE[q.fmt], n, k)
    assert torch.equal(unpack_blocks(pw.data, n, *q.blocks.shape[1:]), q.blocks)
    for isa in isas:
        ops.set_isa(isa)
        assert torch.equal(ops.dequantize(pw), q.dequantize()), isa


@pytest.mark.parametrize("fmt", ["q8", "q4"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("m", [1, 3, 9, 70])  # 9: 4-token kernel + remainder; 70: more than one 64-row chunk
def test_linear_matches_fp32_matmul_of_dequantized_weights(fmt: str, shape: tuple[int, int], m: int,
                                                          isas: list[str]) -> None:  # fmt: skip
    n, k = shape
    q = quantize(torch.randn(n, k), fmt)
    pw = ops.PackedWeight.from_blocks(q)
    x = torch.randn(m, k)
    ref = x @ q.dequantize().T
    outs = {}
    for isa in isas:
        ops.set_isa(isa)
        outs[isa] = ops.linear(pw, x)
        # int8 activations (absmax/127 per 32 values) cost ~0.5% relative error on random data (more on the
        # 5-output, 1-block shapes); a wrong layout or scale gives O(1)
        assert _rel(outs[isa], ref) < 0.03, isa
    for isa in isas:  # every ISA path computes the same integer sums: agreement to fp32 rounding
        torch.testing.assert_close(outs[isa], outs["portable"], rtol=1e-4, atol=1e-4)


def test_linear_exact_on_integer_friendly_inputs(isas: list[str]) -> None:
    # activations that int8 represents exactly (absmax 127 per block), weights exact in q8: error-free sums
    k, n = 64, 16
    x = torch.randint(-127, 128, (2, k)).float()
    x[:, 0], x[:, 32] = 127.0, -127.0
    w = torch.randint(-127, 128, (n, k)).float() / 64
    w[:, 0], w[:, 32] = 127 / 64, 127 / 64
    pw = ops.PackedWeight.from_blocks(quantize(w, "q8"))
    for isa in isas:
        ops.set_isa(isa)
        torch.testing.assert_close(ops.linear(pw, x), x @ w.T, rtol=0, atol=1e-3)


def test_threads_and_isa_controls(isas: list[str]) -> None:
    q = quantize(torch.randn(300, 128), "q4")
    pw = ops.PackedWeight.from_blocks(q)
    x = torch.randn(4, 128)
    before = ops.get_threads()
    try:
        assert ops.set_threads(1) == 1
        one = ops.linear(pw, x)
        assert ops.set_threads(3) == 3
        for _ in range(20):  # repeated multi-threaded calls give identical results
            assert torch.equal(ops.linear(pw, x), one)
        assert torch.equal(ops.dequantize(pw), q.dequantize())
    finally:
        ops.set_threads(before)
    with pytest.raises(FreeTokenError, match="unknown ISA"):
        ops.set_isa("sse9")
    with pytest.raises(FreeTokenError, match="x must be"):
        ops.linear(pw, torch.randn(2, 127))


def test_pack_layout_is_eight_rows_interleaved() -> None:
    # row r's first 4 values sit at bytes 16 + 4r .. 16 + 4r + 3 of the first q8 tile-block
    w = torch.arange(8 * 32, dtype=torch.float32).reshape(8, 32) % 100 - 50
    q = quantize(w, "q8")
    packed = pack_blocks(q.blocks)
    assert packed.numel() == 8 * 34
    codes = q.blocks[..., 2:]
    for r in range(8):
        assert torch.equal(packed[16 + 4 * r : 20 + 4 * r], codes[r, 0, :4])
        assert torch.equal(packed[2 * r : 2 * r + 2], q.blocks[r, 0, :2])


def test_read_bandwidth_is_measured(isas: list[str]) -> None:
    gbps = ops.read_bandwidth_gbps(32 << 20, reps=2)
    assert 0.1 < gbps < 10_000


@pytest.mark.parametrize("fmt", ["q8", "q4"])
@pytest.mark.parametrize("refine", [False, True])
def test_c_quantizer_matches_the_torch_reference(fmt: str, refine: bool, isas: list[str]) -> None:
    from freetoken_agent.runtime.quant import quantize as reference

    for isa in isas:
        ops.set_isa(isa)
        for shape in [(300, 256), (7, 100)]:
            w = torch.randn(*shape) * 3
            ours, ref = ops.quantize(w, fmt, refine), reference(w, fmt, refine)
            # sums run in another order than torch's: an exact tie between two candidate scales may flip
            assert float((ours.blocks == ref.blocks).all(-1).float().mean()) >= 0.999
            assert abs(_rel(ours.dequantize(), w) - _rel(ref.dequantize(), w)) < 1e-4
    ops.set_isa("best")


def _awkward_weight(n: int, k: int) -> torch.Tensor:
    """Random rows at many scales, plus blocks that stress the q4 rule's comparisons: a zero block, integers (ties
    between candidate scales), +x and -x as the largest magnitude, values near fp16's subnormal scales."""
    w = torch.randn(n, k) * 10.0 ** torch.randint(-5, 4, (n, 1)).float()
    w[0] = 0.0
    w[1] = torch.randint(-8, 8, (k,)).float()
    w[2, 0], w[2, 1] = 3.0, -3.0
    w[3] = torch.randn(k) * 1e-6
    w[4] = torch.randn(k).round() * 0.5
    return w


@pytest.mark.parametrize("fmt", ["q8", "q4"])
@pytest.mark.parametrize("refine", [False, True])
def test_every_isa_and_input_dtype_give_the_portable_bytes(fmt: str, refine: bool, isas: list[str]) -> None:
    # the expert cache files and the GGUF checks depend on these bytes: the AVX2 quantizer (eight q4 blocks per
    # vector, one per lane) must equal the portable C loop bit for bit, and bf16/fp16 read in place must equal
    # quantizing their fp32 widening; shapes with partial blocks and with a last group of fewer than 8 blocks
    for n, k in [(300, 256), (37, 100), (9, 31), (64, 1000)]:
        w = _awkward_weight(n, k)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = w.to(dtype)
            ops.set_isa("portable")
            expected = ops.quantize(x.float(), fmt, refine).blocks
            with every_path(isas, threads=(1, 2)) as paths:
                for isa, threads in paths:
                    got = ops.quantize(x, fmt, refine).blocks
                    assert torch.equal(got, expected), (n, k, dtype, isa, threads)


@pytest.mark.parametrize("fmt", ["q8", "q4"])
def test_quantize_packed_writes_pack_blocks_bytes(fmt: str, isas: list[str]) -> None:
    # the expert cache writer takes the tile layout straight from the quantizer: it must be pack_blocks's bytes
    # (rows not a multiple of 8: zero padding rows; items of 32 rows ending mid-tile; partial last blocks)
    for n, k in [(300, 256), (37, 100), (5, 31), (64, 1000), (8, 32)]:
        w = _awkward_weight(n, k).to(torch.bfloat16)
        ops.set_isa("portable")
        expected = pack_blocks(ops.quantize(w, fmt).blocks)
        with every_path(isas, threads=(1, 2)) as paths:
            for isa, threads in paths:
                got = ops.quantize_packed(w, fmt)
                assert got.numel() == ops.packed_bytes(fmt, n, k)
                assert torch.equal(got, expected), (n, k, isa, threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantizer_rejects_inf_and_nan_on_every_path(dtype: torch.dtype, isas: list[str]) -> None:
    # the C quantizer checks every value it reads (the caller no longer scans the weight first)
    with every_path(isas, threads=(1, 2)) as paths:
        for isa, _ in paths:
            for fmt in ("q8", "q4"):
                for bad in (float("inf"), float("-inf"), float("nan")):
                    for r, c in [(0, 0), (150, 77), (299, 99)]:  # a full block, mid-tensor, the partial tail block
                        w = torch.randn(300, 100, dtype=dtype)
                        w[r, c] = bad
                        with pytest.raises(FreeTokenError, match="inf or nan"):
                            ops.quantize(w, fmt)
                        with pytest.raises(FreeTokenError, match="inf or nan"):
                            ops.quantize_packed(w, fmt)
                ok = ops.quantize(torch.randn(300, 100, dtype=dtype), fmt)  # finite: quantizes
                assert ok.blocks.shape == (300, 4, 18 if fmt == "q4" else 34), isa


def test_concurrent_calls_from_python_threads(isas: list[str]) -> None:
    # ctypes releases the GIL: calls from several threads must not share the pool's job state
    from concurrent.futures import ThreadPoolExecutor

    # calls long enough (~1 ms) that the four threads' calls overlap inside C
    weights = [ops.PackedWeight.from_blocks(quantize(torch.randn(1024, 1024), fmt)) for fmt in ("q4", "q8", "q4", "q8")]
    xs = [torch.randn(16, 1024) for _ in weights]
    expected = [ops.linear(w, x) for w, x in zip(weights, xs)]
    before = ops.get_threads()
    try:
        ops.set_threads(2)
        def work(i: int) -> int:
            return sum(not torch.equal(ops.linear(weights[i], xs[i]), expected[i]) for _ in range(30))

        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(work, range(4))) == [0, 0, 0, 0]
    finally:
        ops.set_threads(before)


def test_pool_shares_and_stealing_cover_every_item_once(isas: list[str]) -> None:
    # the pool splits items into one contiguous share per thread and steals from the back when a share is done:
    # every item must run exactly once whatever the split (fewer items than threads, uneven shares, many items)
    weights = [quantize(torch.randn(n, 96), "q8") for n in (8, 40, 1000, 4104)]
    packed = [ops.PackedWeight.from_blocks(q) for q in weights]
    xs = [torch.randn(m, 96) for m in (1, 3)]
    before = ops.get_threads()
    try:
        ops.set_threads(1)
        expected = [[ops.linear(p, x) for x in xs] for p in packed]
        for threads in (2, 3, 5, 8):
            assert ops.set_threads(threads) == threads
            for _ in range(5):
                for p, q, exp in zip(packed, weights, expected):
                    assert all(torch.equal(ops.linear(p, x), e) for x, e in zip(xs, exp))
                    assert torch.equal(ops.dequantize(p), q.dequantize())
    finally:
        ops.set_threads(before)


def test_spin_setting_and_torch_heavy_nest_and_restore(isas: list[str]) -> None:
    before = ops.set_spin_us(4000)
    try:
        assert ops.set_spin_us(4000) == 4000
        with ops.torch_heavy():
            assert ops.set_spin_us(ops.HANDOFF_SPIN_US) == ops.HANDOFF_SPIN_US  # short poll inside
            with ops.torch_heavy():  # nested (and from another thread the same): the outer value comes back once
                pass
            assert ops.set_spin_us(ops.HANDOFF_SPIN_US) == ops.HANDOFF_SPIN_US
        assert ops.set_spin_us(20) == 4000
        with ops.torch_heavy():  # a user's shorter poll is kept
            assert ops.set_spin_us(20) == 20
        assert ops.set_spin_us(4000) == 20
    finally:
        ops.set_spin_us(before)


def test_pool_carries_runs_torch_on_one_thread_and_restores_it(isas: list[str]) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with ops.pool_carries():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with pytest.raises(FreeTokenError), ops.pool_carries():  # restored when the write fails too
            ops.quantize(torch.tensor([[float("nan")] * 32]), "q4")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def _task_ids() -> set[int]:
    import os

    return {int(t) for t in os.listdir("/proc/self/task")}


@pytest.fixture()
def pool_worker(isas: list[str]) -> Iterator[int]:
    """A fresh 2-thread pool; yields its one worker's thread id, then restores the thread count."""
    before = ops.get_threads()
    ops.set_threads(1)
    old = _task_ids()
    ops.set_threads(2)
    (worker,) = _task_ids() - old
    yield worker
    ops.set_threads(1)
    ops.set_threads(before)


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_setaffinity"), reason="Linux only")
def test_a_worker_moves_off_the_callers_cpu(pool_worker: int) -> None:
    # after an idle gap the OS may wake the caller and a worker on one CPU and leave another idle: a worker that
    # finds itself on another participant's CPU narrows its affinity to the CPUs nobody in the pool is on
    import os
    import time

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs 2 CPUs")
    before_aff, worker = os.sched_getaffinity(0), pool_worker
    try:
        w = ops.PackedWeight.from_blocks(quantize(torch.randn(512, 256), "q8"))
        x = torch.randn(1, 256)
        for home in cpus[:2]:
            os.sched_setaffinity(0, {home})  # the calling thread only (pid 0 = this thread)
            os.sched_setaffinity(worker, {home})  # both on one CPU, as the OS sometimes leaves them
            deadline = time.monotonic() + 5
            while home in os.sched_getaffinity(worker) and time.monotonic() < deadline:
                ops.linear(w, x)
            assert os.sched_getaffinity(worker) == set(cpus) - {home}
    finally:
        os.sched_setaffinity(0, before_aff)


def _state(tid: int) -> str:
    with open(f"/proc/self/task/{tid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/task"), reason="needs /proc")
def test_workers_poll_after_a_linear_and_sleep_after_a_dequantize_or_quantize(pool_worker: int) -> None:
    # a dequantized weight goes to torch.mm next: the pool's workers must not poll into torch's threads
    import time

    before_spin, worker = ops.set_spin_us(10_000_000), pool_worker
    try:
        w = ops.PackedWeight.from_blocks(quantize(torch.randn(512, 256), "q8"))
        x = torch.randn(1, 256)

        def settle(want: str) -> str:
            deadline = time.monotonic() + 5
            while _state(worker) != want and time.monotonic() < deadline:
                time.sleep(0.01)
            return _state(worker)

        for _ in range(50):
            ops.linear(w, x)
        assert settle("R") == "R"  # polling for the next call (10 s)
        ops.dequantize(w)
        assert settle("S") == "S"  # asleep at once
        # the load-time quantizer too: torch packs and copies its blocks next (a polling worker tripled the CPU
        # time of a 2-thread expert cache write)
        for _ in range(50):
            ops.linear(w, x)
        assert settle("R") == "R"
        ops.quantize(torch.randn(512, 256, dtype=torch.bfloat16), "q4")
        assert settle("S") == "S"
    finally:
        ops.set_spin_us(before_spin)


@contextmanager
def every_path(isas: list[str], threads: tuple[int, ...] = (1, 2, 3)) -> Iterator[Iterator[tuple[str, int]]]:
    """Iterate over every ISA path x pool size (each set while its iteration runs); restores both afterwards."""
    before = ops.get_threads()

    def paths() -> Iterator[tuple[str, int]]:
        for isa in isas:
            ops.set_isa(isa)
            for n in threads:
                ops.set_threads(n)
                yield isa, n

    try:
        yield paths()
    finally:
        ops.set_isa("best")
        ops.set_threads(before)


@pytest.mark.parametrize("shape", [(1, 2048, 256), (3, 100, 37), (8, 64, 1000), (2, 33, 5), (13, 80, 70)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_f32_matches_torch_linear(shape: tuple[int, int, int], bias: bool, dtype: torch.dtype,
                                         isas: list[str]) -> None:  # fmt: skip
    m, k, n = shape
    w, x = torch.randn(n, k).to(dtype), torch.randn(m, k)
    b = torch.randn(n) if bias else None
    expected = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double()).float()
    with every_path(isas) as paths:
        for _ in paths:
            got = ops.linear_f32(w, x, b)
            assert got.shape == (m, n)
            assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5 * k**0.5)
    with pytest.raises(FreeTokenError):
        ops.linear_f32(w.t(), x[:, :n] if n <= k else x)  # not contiguous / wrong K
    with pytest.raises(FreeTokenError):
        ops.linear_f32(w.half(), x)


@pytest.mark.parametrize("m", [1, 3, 9])
def test_linear_f32_parts_is_bitwise_separate_calls(m: int, isas: list[str]) -> None:
    # q, k, v of a decode step in one call: each output the same bits as its own linear_f32, on every path
    k = 200
    ws = (torch.randn(256, k), torch.randn(40, k), torch.randn(17, k))  # 17, 40: rows that end mid-item
    bs = (torch.randn(256), None, torch.randn(17))
    x = torch.randn(m, k)
    with every_path(isas) as paths:
        for _ in paths:
            got = ops.linear_f32_parts(ws, x, bs)
            for g, w, b in zip(got, ws, bs):
                assert torch.equal(g, ops.linear_f32(w, x, b))
    assert [t.shape for t in ops.linear_f32_parts(ws, x[:0], bs)] == [(0, 256), (0, 40), (0, 17)]
    with pytest.raises(FreeTokenError):
        ops.linear_f32_parts((ws[0], ws[1].t().contiguous()), x, (None, None))  # wrong K
    with pytest.raises(FreeTokenError):
        ops.linear_f32_parts(ws * 2, x, bs * 2)  # more than 4


@pytest.mark.parametrize("shape", [(1, 2048), (16, 128), (2, 4, 128), (3, 100), (1, 7), (40, 2050)])  # last: pool
def test_rms_norm_matches_torch(shape: tuple[int, ...], isas: list[str]) -> None:
    x, w = torch.randn(*shape) * 3, torch.randn(shape[-1])
    ref = torch.nn.functional.rms_norm(x.double(), shape[-1:], w.double(), 1e-6).float()
    unit = torch.nn.functional.rms_norm(x.double(), shape[-1:], None, 1e-6).float()
    with every_path(isas, threads=(1,)) as paths:
        for _ in paths:
            assert torch.allclose(ops.rms_norm(x, w, 1e-6), ref, rtol=1e-5, atol=1e-6)
            assert torch.allclose(ops.rms_norm(x, None, 1e-6), unit, rtol=1e-5, atol=1e-6)
    with pytest.raises(FreeTokenError):
        ops.rms_norm(x.double(), w, 1e-6)


def _attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    g = q.shape[0] // k.shape[1]
    kk, vv = k.double().repeat_interleave(g, dim=1), v.double().repeat_interleave(g, dim=1)
    scores = torch.einsum("hd,shd->hs", q.double(), kk) * scale
    if sinks is not None:  # one more logit per head, carrying no value
        scores = torch.cat([scores, sinks.double()[:, None]], dim=-1)
    probs = torch.softmax(scores, dim=-1)[:, : k.shape[0]]
    return torch.einsum("hs,shd->hd", probs, vv).float()


@pytest.mark.parametrize("dims", [(1, 16, 4, 128, 128), (37, 8, 8, 64, 64), (300, 16, 4, 128, 128),
                                  (129, 4, 1, 72, 40), (513, 6, 2, 24, 136),
                                  (131, 3, 1, 36, 20)])  # fmt: skip  (last: head dims off the 8/16-lane steps)
def test_attn_decode_matches_softmax_attention(dims: tuple[int, ...], isas: list[str]) -> None:
    s, h, hkv, dh, dv = dims
    q = torch.randn(h, dh)
    pool_k, pool_v = torch.randn(s + 7, hkv + 1, dh) * 3, torch.randn(s + 7, hkv + 1, dv)
    k, v = pool_k[5 : 5 + s, :hkv], pool_v[2 : 2 + s, 1:]  # strided views, as a paged cache's run of pages
    expected = _attention_reference(q, k, v, dh**-0.5)
    with every_path(isas) as paths:
        for _ in paths:
            assert torch.allclose(ops.attn_decode(q, k, v, dh**-0.5), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(FreeTokenError):
        ops.attn_decode(q, k.transpose(1, 2), v, 1.0)  # heads not contiguous


@pytest.mark.parametrize("with_sinks", [False, True])
def test_decode_attention_in_the_engine_path_matches_torch(with_sinks: bool, isas: list[str]) -> None:
    from freetoken_agent.runtime.model import layers

    q, k, v = torch.randn(1, 8, 32), torch.randn(200, 2, 32), torch.randn(200, 2, 32)
    sinks = torch.randn(8) * 3 if with_sinks else None
    got = layers._one_query_attention(q, k, v, 0.2, sinks)
    expected = _attention_reference(q[0], k, v, 0.2, sinks).reshape(1, -1)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5)
    with every_path(isas, threads=(1,)) as paths:  # the kernel itself, sinks included, on every ISA path
        for _ in paths:
            assert torch.allclose(ops.attn_decode(q[0], k, v, 0.2, sinks), expected.view(8, 32), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("style", ["half", "interleaved"])
@pytest.mark.parametrize("dims", [(1, 16, 128, 128), (3, 4, 64, 32), (2, 5, 72, 72)])
def test_rope_kernel_matches_the_torch_rotation(style: str, dims: tuple[int, int, int, int], isas: list[str]) -> None:
    from freetoken_agent.runtime.model.rope import Rotary
    from freetoken_agent.runtime.model.spec import RopeSpec

    t, h, dh, r = dims
    rotary = Rotary(RopeSpec(dim=r, theta=10000.0, style=style))
    x = torch.randn(t, h, dh)
    cos, sin = rotary.cos_sin(torch.arange(5, 5 + t))
    got = ops.rope(x, cos, sin, r, style == "half")
    # the torch formula (what Rotary.apply computes without the kernels)
    rot, rest = x[..., :r], x[..., r:]
    c, s = cos[:, None, :], sin[:, None, :]
    if style == "half":
        a, b = rot[..., : r // 2], rot[..., r // 2 :]
        want = torch.cat((a * c - b * s, b * c + a * s), dim=-1)
    else:
        a, b = rot[..., 0::2], rot[..., 1::2]
        want = torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2)
    want = torch.cat((want, rest), dim=-1)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    assert torch.allclose(rotary.apply(x, cos, sin), want, rtol=1e-6, atol=1e-6)  # the engine's call goes to C
    with pytest.raises(FreeTokenError):
        ops.rope(x, cos[:, :-1], sin, r, True)


@pytest.mark.parametrize("dim", [5, 9, 7])
def test_odd_rotary_dim_matches_transformers_in_c_and_torch(dim: int, isas: list[str]) -> None:
    """An odd rotary dim R has ceil(R/2) frequencies (exponents 2i/R); transformers rotates 2·ceil(R/2) channels.
    The C kernel (a decode step) and the torch rotation (a long prompt) both match its ``apply_rotary_pos_emb``."""
    glm = pytest.importorskip("transformers.models.glm4_moe.modeling_glm4_moe")
    from freetoken_agent.runtime.model.rope import SMALL_ROPE, Rotary
    from freetoken_agent.runtime.model.spec import RopeSpec

    rotary = Rotary(RopeSpec(dim=dim, theta=10000.0))
    for t in (3, SMALL_ROPE // (4 * 16) + 1):  # under and over the C kernel's size limit
        x = torch.randn(t, 4, 16)
        cos, sin = rotary.cos_sin(torch.arange(7, 7 + t))
        assert cos.shape == (t, (dim + 1) // 2)
        got = rotary.apply(x, cos, sin)
        hf_cos, hf_sin = torch.cat((cos, cos), -1)[None], torch.cat((sin, sin), -1)[None]  # [1, T, 2·ceil(R/2)]
        want, _ = glm.apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], hf_cos, hf_sin)
        assert torch.allclose(got, want[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    with pytest.raises(FreeTokenError):  # the kernel itself takes only whole pairs
        ops.rope(torch.randn(2, 4, 16), cos[:2, :2], sin[:2, :2], 5, True)


def test_freetoken_isa_pins_a_path_at_load_and_a_bad_name_warns() -> None:
    import os
    import subprocess
    import sys

    if build.load() is None:
        pytest.skip(f"C kernels unavailable here: {build.status().reason}")
    code = ("import warnings; warnings.simplefilter('always');"
            "from freetoken_agent.runtime.kernels import ops; print(ops.current_isa(), ops.available_isas()[-1])")
    for env, want in (("portable", "portable"), ("avx512-typo", None)):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "FREETOKEN_ISA": env})
        assert proc.returncode == 0, proc.stderr
        now, best = proc.stdout.split()
        assert now == (want or best)
        assert ("FREETOKEN_ISA='avx512-typo' is unknown" in proc.stderr) == (want is None)
