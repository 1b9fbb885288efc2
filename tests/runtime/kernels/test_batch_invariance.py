"""Batch invariance (``ops.set_deterministic``): a row's bits never depend on the other rows of the call.

For fresh random inputs and random row counts M in 1..40: row i of the batched call is bitwise (``torch.equal``)
the call with that row alone, and a shuffled batch gives the shuffled rows — for every op that mixes rows, on every
ISA path and pool size the kernels have. Attention: a chunk of T queries after S cached keys equals the queries
decoded one by one. End to end (``Decoder.forward``, tiny random qwen3_moe in fp32, bf16, q4 experts + q8 dense,
residency-managed experts; deepseek_v3 for MLA, gpt_oss for sinks and a sliding window): a prompt fed as one chunk,
as two (a cached prefix, then a chunk), or token by token gives bit-identical final logits.
Ops that are invariant without the switch (quantized linears, the fused MoE step, fp32 RMSNorm, fp32 linears from
weights of any size, rotary) are checked with it off.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from freetoken_agent.runtime.kernels import build, invariant, ops
from freetoken_agent.runtime.kernels.dense import QuantLinear
from freetoken_agent.runtime.kernels.experts import QuantizedExperts
from freetoken_agent.runtime.memory import Budget
from freetoken_agent.runtime.model import layers
from freetoken_agent.runtime.model.moe import TorchExperts, activate, route
from freetoken_agent.runtime.model.rope import Rotary
from freetoken_agent.runtime.model.spec import AttentionSpec, MoESpec, RopeSpec, RouterSpec

from tests.runtime.checkpoints import save_checkpoint
from tests.runtime.kernels.test_ops import every_path

Rows = Callable[[torch.Tensor], torch.Tensor]


@pytest.fixture(scope="module")
def isas() -> Iterator[list[str]]:
    if build.load() is None:
        pytest.skip(f"C kernels unavailable here: {build.status().reason}")
    yield ops.available_isas()
    ops.set_isa("best")


@pytest.fixture
def deterministic() -> Iterator[None]:
    ops.set_deterministic(True)
    yield
    ops.set_deterministic(False)


def row_counts(n: int = 3) -> list[int]:
    """Fresh row counts each run: always one of 4..8 (the GEMV / 4-row tile sizes), the rest anywhere in 1..40."""
    return [random.randint(4, 8)] + [random.randint(1, 40) for _ in range(n - 1)]


def assert_rows_invariant(fn: Rows, x: torch.Tensor, *extra: torch.Tensor) -> None:
    """``fn(x, *extra)`` row by row equals the batched call, and a shuffled batch gives the shuffled rows.
    ``extra`` are per-row arguments (first dim M) that travel with the rows."""
    y = fn(x, *extra)
    for i in range(x.shape[0]):
        alone = fn(x[i : i + 1], *(e[i : i + 1] for e in extra))
        assert torch.equal(alone[0], y[i]), f"row {i} of {x.shape[0]}"
    perm = torch.randperm(x.shape[0])
    assert torch.equal(fn(x[perm], *(e[perm] for e in extra)), y[perm])


def test_the_switch_is_process_wide_and_off_by_default() -> None:
    assert ops.deterministic() is False
    ops.set_deterministic(True)
    try:
        assert ops.deterministic() is True
    finally:
        ops.set_deterministic(False)
    assert ops.deterministic() is False


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(300, 100), (37, 256), (8, 33)])  # (N, K): K % 16 tails, N % 4 and % 16 edges
@pytest.mark.parametrize("bias", [False, True])
def test_dense_linear(dtype: torch.dtype, shape: tuple[int, int], bias: bool, isas: list[str],
                      deterministic: None) -> None:  # fmt: skip
    n, k = shape
    w = torch.randn(n, k).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    with every_path(isas) as paths:
        for _ in paths:
            for m in row_counts():
                x = torch.randn(m, k).to(dtype)
                assert_rows_invariant(lambda z: layers.dense_linear(z, w, b), x)
    x = torch.randn(5, k).to(dtype)  # and it is a linear: rounding away from the fp64 product only
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert torch.allclose(layers.dense_linear(x, w, b).double(), want, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                          atol=1e-2 if dtype == torch.bfloat16 else 1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_verify_row_length_gives_each_row_its_own_bits(dtype: torch.dtype, isas: list[str]) -> None:
    """Every row count a speculative verify row has (1 to 9: the one-row kernel below 4 rows, 4-row weight tiles
    against up to 8 rows at once with a last block of 1-3, blocks of 4 past 8), with and without a K tail and a
    weight-row remainder past the last 4-row tile: each row bitwise what it gets alone, and the same bits on the
    AVX2 and AVX-512 paths."""
    for n, k in ((8192 // 64 + 3, 256), (21, 70)):
        w = torch.randn(n, k).to(dtype)
        xs = [torch.randn(m, k) for m in range(1, 10)]
        vector: dict[int, torch.Tensor] = {}
        with every_path(isas) as paths:
            for isa, _threads in paths:
                for x in xs:
                    assert_rows_invariant(lambda z: ops.linear_f32(w, z), x)
                    if isa != "portable":
                        y = ops.linear_f32(w, x)
                        assert torch.equal(vector.setdefault(x.shape[0], y), y), (isa, x.shape[0])


def test_fp32_dense_linear_is_invariant_by_default(isas: list[str]) -> None:
    w, b = torch.randn(259, 130), torch.randn(259)
    small = torch.randn(6, 130)  # a router's logits, a tiny model's projection
    with every_path(isas, threads=(1, 2)) as paths:
        for _ in paths:
            for m in row_counts():
                x = torch.randn(m, 130)
                assert_rows_invariant(lambda z: layers.dense_linear(z, w, b), x)
                assert_rows_invariant(lambda z: layers.dense_linear(z, small), x)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid", "topk_first"])
def test_router(scoring: str, isas: list[str], deterministic: None) -> None:
    first = scoring == "topk_first"
    spec = RouterSpec(scoring="softmax" if first else scoring,  # type: ignore[arg-type]
                      topk_before_scoring=first, norm_topk=True)
    weight = torch.randn(24, 96)

    def ids_and_weights(x: torch.Tensor) -> torch.Tensor:
        ids, wts = route(x, spec, 4, weight)
        return torch.cat([ids.float(), wts], dim=-1)

    with every_path(isas, threads=(1, 2)) as paths:
        for _ in paths:
            for m in row_counts():
                assert_rows_invariant(ids_and_weights, torch.randn(m, 96))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms(dtype: torch.dtype, isas: list[str], deterministic: None) -> None:
    d = 2048  # 40 rows of 2048: the batched call runs on the pool, a row alone on the calling thread
    w, b = torch.randn(d).to(dtype), torch.randn(d).to(dtype)
    norms: list[Rows] = [lambda z: layers.rms_norm(z, w, 1e-6), lambda z: layers.layer_norm(z, w, 1e-5, b),
                         lambda z: layers.layer_norm(z, w, 1e-5), lambda z: layers.unit_rms_norm(z, 1e-6)]
    with every_path(isas, threads=(1, 2)) as paths:
        for _ in paths:
            for m in [*row_counts(2), 40]:
                x = (torch.randn(m, d) * 3 + 0.5).to(dtype)
                for norm in norms:
                    assert_rows_invariant(norm, x)
    x = torch.randn(3, d).to(dtype)  # and they still normalize
    want = F.layer_norm(x.double(), (d,), w.double(), b.double(), 1e-5)
    assert torch.allclose(layers.layer_norm(x, w, 1e-5, b).double(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("act", [F.silu, F.gelu, torch.sigmoid, F.softplus])
def test_pointwise_never_takes_the_scalar_tail(act: Callable[[torch.Tensor], torch.Tensor]) -> None:
    width = 33  # an odd row: without the padding, where a call ends decides which values take the scalar formula
    for m in row_counts():
        x = torch.randn(m, width) * 4
        assert_rows_invariant(lambda z: invariant.pointwise(act, z), x)
        assert torch.allclose(invariant.pointwise(act, x), act(x), rtol=1e-6, atol=1e-6)
    big = torch.randn(3 * invariant.PIECE + 7) * 4  # several pieces
    assert torch.equal(invariant.pointwise(act, big)[-7:], invariant.pointwise(act, big[-7:]))


def _moe_spec(activation: str = "silu") -> MoESpec:
    return MoESpec(num_experts=8, top_k=2, intermediate=40, router=RouterSpec(),
                   activation=activation)  # type: ignore[arg-type]


def _routing(m: int, e: int = 8, k: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(m)])  # [M, K] distinct experts per token
    return ids, torch.rand(m, k) + 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_reference_experts(dtype: torch.dtype, activation: str, isas: list[str], deterministic: None) -> None:
    d, i = 72, 40
    experts = TorchExperts(_moe_spec(activation), torch.randn(8, 2 * i, d).to(dtype) * 0.2,
                           torch.randn(8, d, i).to(dtype) * 0.2)
    with every_path(isas, threads=(1, 2)) as paths:
        for _ in paths:
            for m in row_counts():
                ids, wts = _routing(m)
                assert_rows_invariant(experts.forward, torch.randn(m, d).to(dtype), ids, wts)


@pytest.mark.parametrize("fmt", ["q8", "q4"])
@pytest.mark.parametrize("variant", ["fused", "per_expert", "exact"])
def test_quantized_experts(fmt: str, variant: str, isas: list[str], deterministic: None) -> None:
    d, i = 96, 64
    qe = QuantizedExperts.from_float(torch.randn(8, 2 * i, d) * 0.2, torch.randn(8, d, i) * 0.2, fmt)
    qe.dequant_threshold = 1  # what the switch overrides: every expert would otherwise dequantize + torch.mm
    if variant == "per_expert":  # a non-SiLU activation: one C call per expert instead of the fused step
        qe.activation = lambda h: activate(h, _moe_spec("gelu"))
    qe.exact = variant == "exact"
    with every_path(isas) as paths:
        for _ in paths:
            for m in row_counts():
                ids, wts = _routing(m)
                assert_rows_invariant(qe.forward, torch.randn(m, d), ids, wts)


@pytest.mark.parametrize("fmt", ["q8", "q4"])
@pytest.mark.parametrize("switch", [False, True])
def test_quantized_dense_and_fused_moe_are_invariant_by_default(fmt: str, switch: bool, isas: list[str]) -> None:
    ops.set_deterministic(switch)
    try:
        ql = QuantLinear(torch.randn(200, 160), fmt)
        bias = torch.randn(200)
        qe = QuantizedExperts.from_float(torch.randn(8, 128, 96) * 0.2, torch.randn(8, 96, 64) * 0.2, fmt)
        with every_path(isas) as paths:
            for _ in paths:
                for m in [*row_counts(), 70]:  # 70: more than one 64-row chunk of ft_linear
                    assert_rows_invariant(lambda z: ql(z, bias), torch.randn(m, 160))
                    ids, wts = _routing(m)
                    fused: Rows = lambda z, a, b: ops.moe(qe.fmt, qe.w13, qe.w2, (96, 64), z, a, b)  # noqa: E731
                    assert_rows_invariant(fused, torch.randn(m, 96), ids, wts)
    finally:
        ops.set_deterministic(False)


def test_fp32_rms_norm_is_invariant_by_default(isas: list[str]) -> None:
    w = torch.randn(2048)
    with every_path(isas, threads=(1, 2)) as paths:
        for _ in paths:
            for m in [*row_counts(), 40]:  # 40 rows of 2048: on the pool; a row alone: on the calling thread
                assert_rows_invariant(lambda z: layers.rms_norm(z, w, 1e-6), torch.randn(m, 2048) * 3)


def test_rotary_is_invariant_by_default() -> None:
    rotary = Rotary(RopeSpec(dim=96, theta=10000.0, style="half"))
    for m in [*row_counts(), 40]:  # 40 x 4 x 128 values: past SMALL_ROPE, the torch formula; a row alone: C
        x = torch.randn(m, 4, 128)
        pos = torch.randint(0, 3000, (m,))

        def rotate(z: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
            cos, sin = rotary.cos_sin(p.clone())
            return rotary.apply(z.contiguous(), cos, sin)

        assert_rows_invariant(rotate, x, pos)


def _spec(**kw: object) -> AttentionSpec:
    base: dict[str, object] = dict(kind="gqa", num_heads=8, num_kv_heads=2, head_dim=32, v_head_dim=32, scale=32**-0.5,
                                   rope=None)
    return AttentionSpec(**{**base, **kw})  # type: ignore[arg-type]


ATTENTION_CASES = {
    "causal": (_spec(), False, None),
    "sinks": (_spec(sinks=True), True, None),
    "window": (_spec(sliding_window=37), False, None),
    "chunked": (_spec(chunk_size=64), False, None),
    "mla_values": (_spec(num_kv_heads=8, v_head_dim=24), False, None),  # values sliced from wider rows
    "sparse_keep": (_spec(), False, "keep"),
    "bf16": (_spec(), False, "bf16"),
}


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_attention_chunk_equals_queries_decoded_one_by_one(case: str, isas: list[str], deterministic: None) -> None:
    spec, with_sinks, kind = ATTENTION_CASES[case]
    sinks = torch.randn(spec.num_heads) if with_sinks else None
    with every_path(isas, threads=(1, 3)) as paths:
        for _ in paths:
            _check_chunk_against_one_by_one(spec, sinks, kind, case == "mla_values")


def _check_chunk_against_one_by_one(spec: AttentionSpec, sinks: torch.Tensor | None, kind: str | None,
                                    wide_values: bool) -> None:  # fmt: skip
    h, hkv, dh, dv = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.v_head_dim
    dtype = torch.bfloat16 if kind == "bf16" else torch.float32
    for cached, t in ((random.randint(0, 300), random.randint(1, 40)), (random.randint(1, 9), random.randint(2, 6))):
        s = cached + t
        q = torch.randn(t, h, dh).to(dtype)
        k = torch.randn(s, hkv, dh).to(dtype)
        v = (torch.randn(s, hkv, dv + 8)[..., 8:] if wide_values else torch.randn(s, hkv, dv)).to(dtype)
        pos = torch.arange(cached, s)
        keep = torch.rand(t, s) < 0.7 if kind == "keep" else None
        if keep is not None:
            keep[:, 0] = True  # every query sees at least one key
        chunk = layers.attention_scores(q, k, v, pos, spec, sinks, keep)
        for i in range(t):
            p = cached + i
            alone = layers.attention_scores(q[i : i + 1], k[: p + 1], v[: p + 1], pos[i : i + 1], spec, sinks,
                                            None if keep is None else keep[i : i + 1, : p + 1])
            assert torch.equal(alone[0], chunk[i]), (cached, t, i)


def test_chunked_attention_kernel_equals_the_decode_kernel(isas: list[str]) -> None:
    """``ops.attn_queries`` (deterministic prefill) reproduces ``ops.attn_decode`` (every decode step) bitwise."""
    cached, t = random.randint(0, 400), random.randint(1, 40)
    s = cached + t
    q, k, v = torch.randn(t, 8, 64), torch.randn(s, 2, 64), torch.randn(s, 2, 48)
    sinks = torch.randn(8)
    hi = torch.arange(cached, s) + 1
    with every_path(isas) as paths:
        for _ in paths:
            out = ops.attn_queries(q, k, v, torch.zeros_like(hi), hi, 0.125, sinks)
            for i in range(t):
                assert torch.equal(out[i], ops.attn_decode(q[i], k[: hi[i]], v[: hi[i]], 0.125, sinks))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """A tiny random checkpoint per architecture, written once per module."""
    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in made:
            made[arch] = tmp_path_factory.mktemp(f"{arch}_invariance")
            save_checkpoint(arch, made[arch], seed=5)
        return made[arch]

    return get


ENGINES: dict[str, tuple[str, dict[str, object]]] = {
    "fp32": ("qwen3_moe", {}),
    "bf16": ("qwen3_moe", {"dtype": "bfloat16"}),
    "q4_dense_q8": ("qwen3_moe", {"quant": "q4", "dense_quant": "q8"}),
    "managed_fp32": ("qwen3_moe", {"budget": Budget()}),  # residency-managed experts (ManagedExperts)
    "managed_q4": ("qwen3_moe", {"quant": "q4", "budget": Budget()}),
    "mla": ("deepseek_v3", {}),  # MLA, grouped sigmoid router, shared experts, YaRN
    "sinks_window": ("gpt_oss", {}),  # attention sinks, sliding window, router and expert biases
}


@pytest.mark.parametrize("mode", list(ENGINES))
def test_prompt_as_one_chunk_equals_token_by_token(checkpoint: Callable[[str], Path], mode: str, isas: list[str],
                                                   deterministic: None) -> None:  # fmt: skip
    from freetoken_agent.runtime.engine import Engine
    from freetoken_agent.runtime.experts.capabilities import capabilities_of

    arch, kwargs = ENGINES[mode]
    decoder = Engine.from_pretrained(checkpoint(arch), **kwargs).decoder  # type: ignore[arg-type]
    managed = any(capabilities_of(b).placement == "managed" for b in decoder.experts)
    assert managed == mode.startswith("managed")
    prompt = torch.randint(0, 512, (random.randint(12, 40),))
    cut = random.randint(1, prompt.shape[0] - 1)

    def final_logits(chunks: list[torch.Tensor]) -> torch.Tensor:
        cache = decoder.new_cache()
        for chunk in chunks:
            hidden = decoder.forward(chunk, cache)
        return decoder.logits(hidden[-1:])

    whole = final_logits([prompt])
    assert torch.equal(whole, final_logits(list(prompt.split(1))))  # decoded token by token
    assert torch.equal(whole, final_logits([prompt[:cut], prompt[cut:]]))  # a cached prefix, then a chunk
