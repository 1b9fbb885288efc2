"""The fused attention half of a decode step (``model/fused.py``, ``ft_attn_step``) against the op-by-op path it
replaces: bitwise the same logits and greedy tokens on tiny random checkpoints of several families (per-head q/k
norms, biases, sinks, sliding windows, partial rotary, a dense first layer), with fp32 and 16-bit KV caches, in
default and deterministic mode; layers it cannot fuse run op by op in the same step; and the ``ft_attn_step``
cache write narrows exactly as torch's casts do."""

from __future__ import annotations

import ctypes
import warnings
from pathlib import Path

import pytest
import torch

from freetoken_agent.runtime.engine import Engine
from freetoken_agent.runtime.kernels import build, ops
from freetoken_agent.runtime.kv import KVConfig
from freetoken_agent.runtime.model.fused import AttnLayer

pytest.importorskip("transformers")
warnings.filterwarnings("ignore")
from tests.runtime.checkpoints import save_checkpoint  # noqa: E402

pytestmark = pytest.mark.skipif(build.load() is None, reason="C kernels unavailable (no compiler)")

WIDE = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=4, head_dim=64)
"""Projections of >= 256 rows (q/k/v and o), as in real models."""
FUSED_ARCHS = {
    "qwen3_moe": WIDE,                 # per-head q/k RMSNorm
    "mixtral": WIDE,                   # sliding window 16 (the decode passes it)
    "qwen2_moe": WIDE,                 # q/k/v biases, shared experts, a dense first layer
    "gpt_oss": WIDE,                   # sinks, sliding window 8 on alternate layers, biases everywhere
    "glm4_moe": dict(WIDE, partial_rotary_factor=0.5),  # half the channels rotate, biases, a dense first layer
}


FFN_IN_CALL = {"qwen3_moe", "mixtral"}
"""At q4, the routing and experts join the call too (softmax routers, nothing else in the MoE block); Qwen2-MoE has
shared experts, GPT-OSS expert biases, GLM-4.5 a correction bias and groups: their FFN runs op by op."""


def _logits(engine: Engine, ids: list[int], fused: bool) -> tuple[torch.Tensor, int, int]:
    """Logits of every position after a 12-token prefill, each later one a decode step of one token; how many layer
    steps ran fused, and how many of those ran the FFN in the call too."""
    engine.decoder.fused.enabled = fused
    engine.kv_manager(KVConfig(page_size=4, device_pages=256))
    before, ffn = engine.decoder.fused.layers_run, engine.decoder.fused.ffn_run
    session = engine.session()
    outs = [session.prefill_logits(ids[:12])[1]] + [session.prefill_logits(ids[:i])[1] for i in range(13, len(ids) + 1)]
    session.close()
    return torch.cat(outs), engine.decoder.fused.layers_run - before, engine.decoder.fused.ffn_run - ffn


@pytest.mark.parametrize("quant", ["none", "q4"])
@pytest.mark.parametrize("kv", ["fp32", "fp16", "bf16", "fp8"])
@pytest.mark.parametrize("arch", sorted(FUSED_ARCHS))
def test_fused_decode_is_bitwise_the_op_by_op_path(arch: str, kv: str, quant: str, tmp_path: Path) -> None:
    save_checkpoint(arch, tmp_path, **FUSED_ARCHS[arch])
    engine = Engine.from_pretrained(tmp_path, kv_dtype=kv, speculate=False, quant=quant)
    try:
        ids = torch.randint(0, 512, (30,), generator=torch.Generator().manual_seed(3)).tolist()
        observed: list[torch.Tensor] = []
        engine.decoder.routing_observers.append(lambda layer, topk: observed.append(topk.clone()))
        grouped = engine.decoder.fused.grouped_run
        fused, ran, ffn = _logits(engine, ids, True)
        grouped = engine.decoder.fused.grouped_run - grouped
        seen = torch.cat(observed)
        observed.clear()
        plain, none, _ = _logits(engine, ids, False)
        layers = engine.spec.num_layers
        assert ran == 18 * layers and none == 0  # every decode step of every layer fused (off: none)
        moe_layers = sum(layer.moe is not None for layer in engine.spec.layers)
        assert ffn == (18 * moe_layers if quant == "q4" and arch in FFN_IN_CALL else 0)
        assert grouped == (ffn if ffn == 18 * layers else 0)  # all layers whole in the call: one call per step
        assert torch.equal(fused, plain)
        assert torch.equal(seen, torch.cat(observed))  # routing observers told the same choices, in the same order
        prompt = ids[:16]
        engine.decoder.fused.enabled = True
        a = engine.generate(prompt, max_new_tokens=24, temperature=0.0, stop_token_ids=[]).token_ids
        engine.decoder.fused.enabled = False
        b = engine.generate(prompt, max_new_tokens=24, temperature=0.0, stop_token_ids=[]).token_ids
        assert a == b
    finally:
        engine.close()


@pytest.mark.parametrize("quant", ["none", "q4"])
@pytest.mark.parametrize("kv", ["fp32", "fp16", "fp8"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_rows_of_several_tokens_are_bitwise_their_decode_steps(arch: str, kv: str, quant: str,
                                                               tmp_path: Path) -> None:
    """A row of 2-8 consecutive tokens (a speculative verify row) runs fused in one call per layer, bitwise the
    op-by-op row; with batch-invariant experts every position's logits are bitwise those of decoding its tokens one
    at a time (GPT-OSS's fp32 experts run in torch, batch invariant only in deterministic mode: close there);
    a row of 9 runs op by op. Greedy generation with speculation (its verify rows fused) is token-identical."""
    save_checkpoint(arch, tmp_path, **FUSED_ARCHS[arch])
    engine = Engine.from_pretrained(tmp_path, kv_dtype=kv, speculate=False, quant=quant)
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(11)).tolist()
    cuts = [12, 15, 16, 24, 26, 33, 42 - 2]  # rows of 3, 1, 8, 2, 7, 7 after a 12-token prefill

    def by_rows(fused: bool) -> tuple[torch.Tensor, int, int]:
        engine.decoder.fused.enabled = fused
        engine.kv_manager(KVConfig(page_size=4, device_pages=256))
        before, rows = engine.decoder.fused.layers_run, engine.decoder.fused.rows_run
        session = engine.session()
        outs = [session.prefill_logits(ids[:c])[1] for c in cuts]
        session.close()
        return torch.cat(outs), engine.decoder.fused.layers_run - before, engine.decoder.fused.rows_run - rows

    try:
        layers = engine.spec.num_layers
        rows_fused, ran, rows = by_rows(True)
        assert ran == 6 * layers and rows == 5 * layers  # every row of <= 8 tokens fused; 5 of them of several
        rows_plain, ran_plain, _ = by_rows(False)
        assert ran_plain == 0 and torch.equal(rows_fused, rows_plain)
        steps_fused = _logits(engine, ids, True)[0]  # position 12 on, one token at a time
        steps_plain = _logits(engine, ids, False)[0]
        assert torch.equal(steps_fused, steps_plain)
        # q4 experts (ft_moe) and fp32 SiLU experts (ft_moe_f32) are batch invariant; GPT-OSS's biased clamped-SwiGLU
        # fp32 experts run in torch, invariant only in deterministic mode
        if quant == "q4" or arch == "qwen3_moe":
            assert torch.equal(rows_fused, steps_fused)
        else:  # an fp16 cache rounds the keys: a last-bit difference can move a stored key by an fp16 ulp
            torch.testing.assert_close(rows_fused, steps_fused, rtol=0, atol=1e-4 if kv == "fp32" else 5e-3)
        engine.kv_manager(KVConfig(page_size=4, device_pages=256))
        engine.decoder.fused.enabled = True
        session = engine.session()
        before = engine.decoder.fused.layers_run
        session.prefill_logits(ids[:12])
        session.prefill_logits(ids[:21])  # a row of 9: op by op
        session.close()
        assert engine.decoder.fused.layers_run == before
        prompt = (ids[:10] * 3)[:24]  # repeats: prompt lookup drafts from it
        plain = engine.generate(prompt, max_new_tokens=24, temperature=0.0, stop_token_ids=[]).token_ids
        engine.speculation = True
        rows_before = engine.decoder.fused.rows_run
        spec = engine.generate(prompt, max_new_tokens=24, temperature=0.0, stop_token_ids=[]).token_ids
        assert spec == plain
        assert engine.stats()["speculation"]["verify_rows"] == 0 or engine.decoder.fused.rows_run > rows_before
    finally:
        engine.close()


@pytest.mark.parametrize(("arch", "dense"), [("qwen3_moe", "q8"), ("qwen3_moe", "q4"), ("qwen2_moe", "q8"),
                                             ("gpt_oss", "q4"), ("qwen3_moe", "Q6_K"), ("qwen3_moe", "Q4_K")])
def test_quantized_projections_fuse_bitwise_the_op_by_op_path(arch: str, dense: str, tmp_path: Path) -> None:
    """Dense weights in the kernels' tiles (``dense_quant``, or a GGUF file's K-quant blocks as stored): the
    projections run in the call (one product over q|k|v where their tiles lie back to back and carry no biases, else
    one each with its bias added after), bitwise the op-by-op path, steps and rows of several tokens alike; a weight
    switched to exact mode takes its layer back op by op, and back into the call after."""
    from freetoken_agent.runtime.kernels.dense import set_dense_mode

    from tests.runtime.gguf.writer import write_gguf

    save_checkpoint(arch, tmp_path / "hf", **FUSED_ARCHS[arch])
    if dense.isupper():  # a GGUF file's dense blocks, loaded as stored
        file = write_gguf(tmp_path / "hf", tmp_path / "m.gguf", experts="Q4_0", dense=dense)
        engine = Engine.from_pretrained(file, kv_dtype="fp16", speculate=False, require_tokenizer=False)
    else:
        engine = Engine.from_pretrained(tmp_path / "hf", kv_dtype="fp16", speculate=False, quant="q4",
                                        dense_quant=dense)
    try:
        plans = [engine.decoder.fused.plan(i) for i in range(engine.spec.num_layers)]
        assert all(p is not None and p.struct.fmt_q >= 0 and p.struct.fmt_o >= 0 for p in plans)
        joined = {bool(p.struct.qkv_joined) for p in plans}
        assert joined == {arch == "qwen3_moe"}  # Qwen2-MoE and GPT-OSS: q/k/v biases, a product each
        ids = torch.randint(0, 512, (30,), generator=torch.Generator().manual_seed(5)).tolist()
        fused, ran, _ = _logits(engine, ids, True)
        plain, none, _ = _logits(engine, ids, False)
        assert ran == 18 * engine.spec.num_layers and none == 0
        assert torch.equal(fused, plain)
        engine.decoder.fused.enabled = True
        engine.kv_manager(KVConfig(page_size=4, device_pages=256))
        session = engine.session()
        rows = torch.cat([session.prefill_logits(ids[:c])[1] for c in (12, 15, 23, 30)])  # rows of 3, 8, 7
        session.close()
        assert torch.equal(rows, fused[: rows.shape[0]])  # ft_linear is batch invariant: rows are their steps
        assert set_dense_mode(engine.decoder.weights, "exact") > 0
        exact, ran, _ = _logits(engine, ids, True)
        assert ran == 0 and not torch.equal(exact, fused)
        set_dense_mode(engine.decoder.weights, "int8")
        again, ran, _ = _logits(engine, ids, True)
        assert ran == 18 * engine.spec.num_layers and torch.equal(again, fused)
    finally:
        engine.close()


@pytest.mark.parametrize("kv", ["fp32", "fp16"])
def test_small_projections_fuse_and_deterministic_mode_over_an_fp32_cache_only(kv: str, tmp_path: Path) -> None:
    """The default tiny checkpoint's projections have 64 rows: they run on the kernels op by op as well, so its
    layers fuse, bitwise the op-by-op path; in deterministic mode over an fp32 cache only (a 16-bit one is attended
    in torch there)."""
    save_checkpoint("qwen3_moe", tmp_path)
    engine = Engine.from_pretrained(tmp_path, kv_dtype=kv, speculate=False)
    ids = torch.randint(0, 512, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    try:
        fused, ran, _ = _logits(engine, ids, True)
        assert ran == 8 * engine.spec.num_layers
        assert torch.equal(fused, _logits(engine, ids, False)[0])
        ops.set_deterministic(True)
        try:
            fused, ran, _ = _logits(engine, ids, True)
            plain, _, _ = _logits(engine, ids, False)
        finally:
            ops.set_deterministic(False)
        assert ran == (8 * engine.spec.num_layers if kv == "fp32" else 0)
        assert torch.equal(fused, plain)
    finally:
        engine.close()


def test_layers_it_cannot_fuse_run_op_by_op_in_the_same_step(tmp_path: Path) -> None:
    """OLMoE normalizes q and k over the whole projection and clips them: no layer fuses, and the step is unchanged;
    a layer whose weights were swapped after the first step is planned again from the new ones."""
    save_checkpoint("olmoe", tmp_path, hidden_size=256, num_attention_heads=8, num_key_value_heads=8)
    engine = Engine.from_pretrained(tmp_path, speculate=False)
    ids = torch.randint(0, 512, (16,), generator=torch.Generator().manual_seed(7)).tolist()
    try:
        assert _logits(engine, ids, True)[1] == 0
    finally:
        engine.close()
    save_checkpoint("qwen3_moe", tmp_path, **WIDE)
    engine = Engine.from_pretrained(tmp_path, speculate=False)
    try:
        plain = _logits(engine, ids, False)[0]
        attn = engine.decoder.weights.layers[1].attn
        _logits(engine, ids, True)
        attn["o_proj.weight"] = attn["o_proj.weight"] * 2  # a new tensor: the old plan must not be used
        swapped_fused, ran, _ = _logits(engine, ids, True)
        swapped_plain = _logits(engine, ids, False)[0]
        assert ran == 4 * engine.spec.num_layers
        assert torch.equal(swapped_fused, swapped_plain) and not torch.equal(swapped_fused, plain)
    finally:
        engine.close()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float8_e4m3fn])
def test_the_cache_write_narrows_as_torch_casts(dtype: torch.dtype) -> None:
    """Keys and values through ``ft_attn_step``'s narrowing (fp16 / fp8: clamped to +-65504 / +-448 first, as the pool
    does) equal torch's casts on every kind of value: normals, ties, subnormals, overflow, zeros, infinities."""
    lib = build.load()
    assert lib is not None
    d, h, dh = 256, 2, 128
    g = torch.Generator().manual_seed(0)
    special = torch.tensor([0.0, 1.0, 65504.0, 65519.0, 65520.0, 1e6, -1e6, 6e-8, 3e-8, 2.98e-8, 6.1e-5,
                            6.0e-5, 1.0 + 2**-11, 1.0 + 3 * 2**-11, 1.0 + 2**-8, 1.0 + 3 * 2**-8, float("inf"),
                            -float("inf"), 3.0e38, 1e-40, -1e-45])
    values = torch.cat([special, torch.randn(2 * h * dh - special.numel(), generator=g) * 10.0 ** torch.randint(
        -9, 6, (2 * h * dh - special.numel(),), generator=g).float()])
    # a layer whose k and v are exactly `values`: zero weights, the values as biases (+0.0 + b is b; no -0.0 above)
    zeros, x, norm = torch.zeros(h * dh, d), torch.randn(1, d, generator=g), torch.ones(d)
    bk, bv = values[: h * dh].clone(), values[h * dh:].clone()
    s = AttnLayer(d=d, h=h, hkv=h, dh=dh, dv=dh, rot=0, window=0, chunk=0, rope_half=1, qk_norm=0, eps=1e-6,
                  scale=0.1, norm_in=norm.data_ptr(), wq=zeros.data_ptr(), wk=zeros.data_ptr(), wv=zeros.data_ptr(),
                  bq=None, bk=bk.data_ptr(), bv=bv.data_ptr(), q_norm=None, k_norm=None, wo=zeros.data_ptr(),
                  bo=None, norm_out=None, sinks=None)
    work = torch.empty(int(lib.ft_attn_step_work(ctypes.byref(s))))
    k_cache = torch.zeros(4, h, dh, dtype=dtype)
    v_cache = torch.zeros(4, h, dh, dtype=dtype)
    out = torch.empty(1, d)
    code = ops.KV_TYPE_CODE[dtype]
    assert lib.ft_attn_step(ctypes.byref(s), 1, x.data_ptr(), out.data_ptr(), None, None, k_cache.data_ptr(),
                            v_cache.data_ptr(), code, h * dh, h * dh, 2, work.data_ptr(), None, None, None) == 0

    def cast(t: torch.Tensor) -> torch.Tensor:
        top = {torch.float16: 65504.0, torch.float8_e4m3fn: 448.0}.get(dtype)
        return (t.clamp(-top, top) if top else t).to(dtype)

    bits = torch.int8 if dtype == torch.float8_e4m3fn else torch.int16
    torch.testing.assert_close(k_cache[2].view(bits), cast(bk).view(h, dh).view(bits), rtol=0, atol=0)
    torch.testing.assert_close(v_cache[2].view(bits), cast(bv).view(h, dh).view(bits), rtol=0, atol=0)


def test_an_expert_mode_change_moves_the_ffn_back_op_by_op(tmp_path: Path) -> None:
    """After ``set_mode("exact")`` a one-token step no longer runs as one kernel call: the fused step leaves the FFN
    to the backend (which dequantizes), and the logits are still the op-by-op path's."""
    save_checkpoint("qwen3_moe", tmp_path, **WIDE)
    engine = Engine.from_pretrained(tmp_path, speculate=False, quant="q4")
    ids = torch.randint(0, 512, (16,), generator=torch.Generator().manual_seed(9)).tolist()
    try:
        assert _logits(engine, ids, True)[2] > 0
        for backend in engine.decoder.experts:
            if backend is not None:
                backend.set_mode("exact")
        fused, ran, ffn = _logits(engine, ids, True)
        assert ran > 0 and ffn == 0
        assert torch.equal(fused, _logits(engine, ids, False)[0])
    finally:
        engine.close()
