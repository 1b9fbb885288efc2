"""Weights in 2 MiB pages: alignment, contents, the arena, and the engine's dense weights moved there."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from freetoken_agent.runtime.engine import Engine
from freetoken_agent.runtime.kernels import build, hugepages
from freetoken_agent.runtime.synthetic import write_synthetic


def _anon_huge_kb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return -1


@pytest.mark.skipif(not hugepages.enabled(), reason="Linux only")
def test_empty_is_aligned_and_backed_by_huge_pages_where_the_kernel_allows() -> None:
    t = hugepages.empty(5 << 20)
    assert t.dtype == torch.uint8 and t.numel() == 5 << 20 and t.data_ptr() % hugepages.HUGE == 0
    before = _anon_huge_kb()
    t.fill_(7)  # first touch: the kernel backs the region (2 MiB pages where it has them)
    assert int(t.sum()) == 7 * (5 << 20)
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if mode.is_file() and "[never]" not in mode.read_text() and before >= 0:
        assert _anon_huge_kb() >= before  # not asserted strictly: the kernel may be out of free 2 MiB pages


def test_arena_keeps_values_dtype_and_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    for setting in ("1", "0"):
        monkeypatch.setenv("FREETOKEN_HUGEPAGES", setting)
        a, b, c = torch.randn(3, 5), torch.arange(7, dtype=torch.int64), torch.randn(2, 2).to(torch.bfloat16)
        got = hugepages.arena([a, b, c])
        assert all(torch.equal(x, y) and x.dtype == y.dtype for x, y in zip(got, [a, b, c]))
        assert all(x.data_ptr() % 64 == 0 for x in got)


def test_engine_moves_big_dense_weights_and_keeps_tied_embeddings_tied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if build.load() is None:
        pytest.skip("the C kernels are unavailable")
    folder = write_synthetic("qwen3_moe", tmp_path / "m", seed=2, hidden_size=1024, num_hidden_layers=2,
                             moe_intermediate_size=64, num_experts=4, vocab_size=4096, tie_word_embeddings=True)
    engine = Engine.from_pretrained(folder)
    weights = engine.decoder.weights
    assert weights.lm_head is weights.embed  # tied, and still one tensor after the move
    assert weights.lm_head.numel() >= hugepages.BIG_WEIGHT  # the (tied) head moves; these small projections stay
    if hugepages.enabled():  # the arena's only weight starts on a 2 MiB boundary
        assert weights.lm_head.data_ptr() % hugepages.HUGE == 0
    ids = [5, 77, 300, 9]
    logits = engine.logits(ids)
    monkeypatch.setenv("FREETOKEN_HUGEPAGES", "0")
    assert torch.equal(Engine.from_pretrained(folder).logits(ids), logits)


def test_a_copy_that_would_not_fit_in_memory_is_not_made(monkeypatch: pytest.MonkeyPatch) -> None:
    assert hugepages.fits(1 << 20) or not Path("/proc/meminfo").is_file()
    assert not hugepages.fits(1 << 62)  # larger than any machine's MemAvailable
    monkeypatch.setattr(hugepages, "FIT_SHARE", 0.0)  # nothing fits: the dense weights stay where they are

    class Weights:
        layers: list = []
        lm_head = embed = torch.randn(1024, 1024)

    w = Weights()
    before = w.lm_head
    assert hugepages.adopt_dense(w) == 0 and w.lm_head is before


def test_doctor_line_says_whether_weights_get_huge_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FREETOKEN_HUGEPAGES", "0")
    assert hugepages.describe().startswith(("off", "not on"))
    monkeypatch.delenv("FREETOKEN_HUGEPAGES")
    assert hugepages.describe()  # the mode this kernel reports


@pytest.mark.parametrize("kv_dtype", [None, torch.float16, torch.float8_e4m3fn], ids=["as-written", "fp16", "fp8"])
def test_kv_pool_parts_of_2mib_or_more_lie_in_huge_pages(kv_dtype: torch.dtype | None,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU pool's part of >= 2 MiB starts on a 2 MiB boundary (decode attention streams it row by row: 4 KiB pages
    cost a TLB miss every few rows), a smaller one is ordinary memory; writes read back either way, and with
    ``FREETOKEN_HUGEPAGES=0`` every part is ordinary memory."""
    from freetoken_agent.runtime.kv.pool import PagePool

    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(32, 4, 128, generator=g), torch.randn(32, 4, 64, generator=g)
    for setting in ("1", "0"):
        monkeypatch.setenv("FREETOKEN_HUGEPAGES", setting)
        big, small = PagePool(1, 512, 16, kv_dtype=kv_dtype), PagePool(1, 2, 16, kv_dtype=kv_dtype)
        for pool in (big, small):
            pool.write(0, [1, 0], 0, (k, v))
            got_k, got_v = pool.gather(0, [1, 0], 32)
            want = kv_dtype or torch.float32
            assert got_k.dtype == want and torch.equal(got_k, k.to(want)) and torch.equal(got_v, v.to(want))
        key_part = big.data[0][0]
        assert key_part.shape == (512, 16, 4, 128) and key_part.is_contiguous()
        if setting == "1" and hugepages.enabled():
            assert key_part.data_ptr() % hugepages.HUGE == 0
