"""Decode tok/s at q4: our engine vs llama.cpp (``llama-cpp-python``) on the same weights, written as GGUF.

A random-weight ``qwen3_moe`` of >= 1B parameters (64 experts, top-8, hidden 2048, expert intermediate 768) is written
as a bf16 safetensors folder. Our engine loads it with ``quant="q4"``; the GGUF file gets the engine's own Q4_0 expert
blocks byte for byte (our block layout is GGUF's) and the same dense weights: F32, or with ``--dense q8`` the Q8_0
blocks our ``dense_quant="q8"`` computes with, so both sides compute with identical weights. Decode tok/s = N / the time of N single-token steps after the prompt (prefill untimed), rounds
alternate A/B, medians.

    python -m freetoken_agent.evals.perf.bench_gguf_decode [--threads 1,2] [--dense none,q8] [--prompt-len 32,4096]
        [--tokens 16] [--rounds 3] [--model DIR] [--json]

``--model``: an existing ``qwen3_moe`` folder instead of the 1B one (e.g. the 7.5B of ``bench_concurrent prepare``);
its GGUF is written beside it once. ``--prompt-len``: several context lengths, one row each. Speculative decoding is
off on our side (llama.cpp runs none here): the rows compare one decode step with another.

Needs ``pip install llama-cpp-python gguf``; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from freetoken_agent.evals.perf import machine
from freetoken_agent.evals.perf.timing import DecodeTiming

CONFIG: dict[str, Any] = dict(
    vocab_size=8192, hidden_size=2048, intermediate_size=6144, num_hidden_layers=4, num_attention_heads=16,
    num_key_value_heads=4, head_dim=128, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=768,
    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=4096, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=False, hidden_act="silu",
    model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
)  # fmt: skip


def write_checkpoint(folder: Path, seed: int = 0, config: dict[str, Any] | None = None,
                     shard_bytes: int = 4 * 2**30) -> Path:
    """The random bf16 checkpoint (HF names), written once per folder: ``model.safetensors``, or shards of about
    ``shard_bytes`` (``model-0000i-of-0000n.safetensors``) when it is bigger, so a 7B model never sits in memory
    whole. ``config.json`` is written last: it marks a complete folder."""
    config = config or CONFIG
    from freetoken_agent.runtime.model.adapters import spec_from_config
    from freetoken_agent.runtime.model.weights import expected_tensors
    from safetensors.torch import save_file

    if (folder / "config.json").is_file() and checkpoint_files(folder):
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    shard: dict[str, torch.Tensor] = {}
    n = size = 0
    for name, shape in expected_tensors(spec_from_config(config)).items():
        if size >= shard_bytes:  # only the current shard is held in memory
            n += 1
            save_file(shard, str(folder / f"shard-{n}.tmp"), metadata={"format": "pt"})
            shard, size = {}, 0
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            std = (1.0 / shape[-1]) ** 0.5
            t = (torch.randn(shape, generator=gen) * std).to(torch.bfloat16)
        shard[name] = t
        size += t.numel() * 2
    n += 1
    save_file(shard, str(folder / f"shard-{n}.tmp"), metadata={"format": "pt"})
    del shard
    names = ["model.safetensors"] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    for i, name in enumerate(names, 1):
        (folder / f"shard-{i}.tmp").replace(folder / name)
    if n > 1:
        weight_map = {}
        for name in names:
            weight_map.update({k: name for k in _keys(folder / name)})
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def checkpoint_files(folder: Path) -> list[Path]:
    """The folder's safetensors files (one, or the shards ``write_checkpoint`` wrote)."""
    return sorted(folder.glob("model*.safetensors"))


def _keys(file: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(file), "pt") as f:
        return list(f.keys())


@contextlib.contextmanager
def open_checkpoint(folder: Path) -> Iterator[Callable[[str], torch.Tensor]]:
    """``get(name) -> tensor`` over every safetensors file of ``folder`` (memory-mapped, read on demand)."""
    from safetensors import safe_open

    with contextlib.ExitStack() as stack:
        where: dict[str, Any] = {}
        for file in checkpoint_files(folder):
            f = stack.enter_context(safe_open(str(file), "pt"))
            where.update({k: f for k in f.keys()})
        yield lambda name: where[name].get_tensor(name)


def gguf_name(dense: str = "none") -> str:
    """The GGUF file name for dense weights ``none`` (F32), ``q8`` or ``q4`` (experts are always Q4_0)."""
    return "model-q4_0.gguf" if dense == "none" else f"model-q4_0-dense-{dense}.gguf"


def _dense_tensor(w: Any, name: str, t: torch.Tensor, dense: str) -> None:
    """One dense weight: F32, or the Q8_0/Q4_0 blocks of our own quantizer (what ``dense_quant=`` computes with)."""
    import gguf

    if dense == "none":
        w.add_tensor(name, t.float().numpy())
        return
    from freetoken_agent.runtime.kernels import ops

    fmt = {"q8": "q8_0", "q4": "q4_0"}[dense]
    kind = gguf.GGMLQuantizationType.Q8_0 if fmt == "q8_0" else gguf.GGMLQuantizationType.Q4_0
    w.add_tensor(name, ops.quantize(t.float(), fmt).blocks.reshape(t.shape[0], -1).numpy(), raw_dtype=kind)


def write_gguf(engine: Any, folder: Path, out: Path, dense: str = "none") -> Path:
    """GGUF (arch ``qwen3moe``) with the engine's Q4_0 expert blocks and the dense weights as F32 (``dense="none"``)
    or as the Q8_0/Q4_0 blocks our ``dense_quant`` computes with (attention projections and output)."""
    import gguf

    c = json.loads((folder / "config.json").read_text())
    w = gguf.GGUFWriter(str(out), "qwen3moe")
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_rope_freq_base(c["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_expert_count(c["num_experts"])
    w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    # a plain SentencePiece-style vocabulary: unk/bos/eos, 256 byte tokens, then filler pieces
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"t{i}" for i in range(c["vocab_size"] - len(tokens))]
    types = [2, 3, 3] + [6] * 256 + [1] * (c["vocab_size"] - 259)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    i_dim = c["moe_intermediate_size"]
    with open_checkpoint(folder) as get:
        def f32(name: str) -> Any:
            return get(name).float().numpy()

        w.add_tensor("token_embd.weight", f32("model.embed_tokens.weight"))
        w.add_tensor("output_norm.weight", f32("model.norm.weight"))
        _dense_tensor(w, "output.weight", get("lm_head.weight"), dense)
        for layer in range(c["num_hidden_layers"]):
            p, b = f"model.layers.{layer}", f"blk.{layer}"
            w.add_tensor(f"{b}.attn_norm.weight", f32(f"{p}.input_layernorm.weight"))
            w.add_tensor(f"{b}.ffn_norm.weight", f32(f"{p}.post_attention_layernorm.weight"))
            pairs = (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output"))
            for ours, theirs in pairs:
                _dense_tensor(w, f"{b}.{theirs}.weight", get(f"{p}.self_attn.{ours}.weight"), dense)
            w.add_tensor(f"{b}.attn_q_norm.weight", f32(f"{p}.self_attn.q_norm.weight"))
            w.add_tensor(f"{b}.attn_k_norm.weight", f32(f"{p}.self_attn.k_norm.weight"))
            w.add_tensor(f"{b}.ffn_gate_inp.weight", f32(f"{p}.mlp.gate.weight"))
            b13, b2 = engine.decoder.experts[layer].blocks()  # [E, 2I, nb, 18], [E, D, nbI, 18]
            e = b13.shape[0]
            q4 = gguf.GGMLQuantizationType.Q4_0
            w.add_tensor(f"{b}.ffn_gate_exps.weight", b13[:, :i_dim].reshape(e, i_dim, -1).numpy(), raw_dtype=q4)
            w.add_tensor(f"{b}.ffn_up_exps.weight", b13[:, i_dim:].reshape(e, i_dim, -1).numpy(), raw_dtype=q4)
            w.add_tensor(f"{b}.ffn_down_exps.weight", b2.reshape(e, b2.shape[1], -1).numpy(), raw_dtype=q4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def ensure_gguf(folder: Path, threads: int = 1, dense: str = "none") -> Path:
    """``folder/gguf_name(dense)``, written once from a q4 engine's own expert blocks (the file ``measure`` uses)."""
    from freetoken_agent.runtime.engine import Engine

    out = folder / gguf_name(dense)
    if not out.is_file():
        engine = Engine.from_pretrained(folder, quant="q4", threads=threads)
        tmp = out.with_suffix(".tmp")
        write_gguf(engine, folder, tmp, dense)
        tmp.replace(out)
    return out


def measure(
    folder: Path, threads: int, tokens: int, rounds: int, prompt_len: int = 32, dense: str = "none",
    prefill_len: int = 0,
) -> dict[str, Any]:
    """Load both engines, then alternate decode timings; also compare their first greedy tokens. ``dense``: both
    sides' dense weights (``none`` = fp32 / F32, ``q8`` / ``q4`` = the same Q8_0 / Q4_0 blocks)."""
    from freetoken_agent.runtime.engine import Engine
    from freetoken_agent.runtime.kernels import ops

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    ours = Engine.from_pretrained(folder, quant="q4", threads=threads, dense_quant=dense, speculate=False)
    try:
        ops.set_threads(threads)
        load_s = time.perf_counter() - t0
        gguf_path = ensure_gguf(folder, threads, dense)
        vocab = int(json.loads((folder / "config.json").read_text())["vocab_size"])
        r = compare(ours, gguf_path, vocab, threads, tokens, rounds, prompt_len, prefill_len)
    finally:  # a row per prompt length: engines left open held a model each (a 7.5B's three rows filled 24 GiB)
        ours.close()
    return {
        "dense_float_bytes": ours.dense_quant.float_bytes if ours.dense_quant else 0,
        "dense_quant_bytes": ours.dense_quant.quant_bytes if ours.dense_quant else 0,
        "params": param_count(folder), "dense": dense, "load_s": round(load_s, 1), **r,
    }  # fmt: skip


def measure_file(gguf_path: Path, threads: int, tokens: int, rounds: int, prompt_len: int = 32,
                 prefill_len: int = 0) -> dict[str, Any]:  # fmt: skip
    """Both sides load the same GGUF file (e.g. one ``llama-quantize`` wrote as Q4_K_M): ours runs its block
    types as stored (or converted where no kernel exists: ``freetoken inspect`` reports it), llama.cpp as always."""
    from freetoken_agent.runtime.engine import Engine
    from freetoken_agent.runtime.kernels import ops

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    ours = Engine.from_pretrained(gguf_path, threads=threads, speculate=False, require_tokenizer=False)
    try:
        ops.set_threads(threads)
        load_s = time.perf_counter() - t0
        r = compare(ours, gguf_path, ours.spec.vocab_size, threads, tokens, rounds, prompt_len, prefill_len)
    finally:
        ours.close()
    return {"params": gguf_param_count(gguf_path), "dense": "as stored", "load_s": round(load_s, 1),
            "formats": gguf_formats(gguf_path), **r}


def gguf_param_count(path: Path) -> int:
    """Parameters in a GGUF file (all its parts), from the tensor headers."""
    from freetoken_agent.runtime.gguf.file import GGUFFile

    return sum(math.prod(t.shape) for t in GGUFFile(path).tensors.values())


def gguf_formats(path: Path) -> dict[str, int]:
    """Stored ggml type → tensors of that type in a GGUF file."""
    from freetoken_agent.runtime.gguf.file import GGUFFile

    out: dict[str, int] = {}
    for t in GGUFFile(path).tensors.values():
        out[t.type_name] = out.get(t.type_name, 0) + 1
    return out


def gguf_step_weight_bytes(path: Path) -> int:
    """Weight bytes one single-token decode step reads from a GGUF file: every tensor but the token embedding (one
    row of it), and the routed experts' tensors (``*_exps``) times experts used / experts stored. Both sides read
    these: the rows compare the same weights."""
    from freetoken_agent.runtime.gguf.file import GGUFFile

    f = GGUFFile(path)
    used, count = int(f.arch_get("expert_used_count", 0) or 0), int(f.arch_get("expert_count", 0) or 0)
    total = 0
    for t in f.tensors.values():
        if t.name == "token_embd.weight":
            total += t.nbytes // max(t.shape[0], 1)
        elif "_exps." in t.name and count:
            total += t.nbytes * used // count
        else:
            total += t.nbytes
    return total


BANDWIDTH_BYTES = 256 << 20
"""Bytes of each round's bandwidth reading (``machine.best_read_gbps``, 3 tries per thread count): taken just before
our side's decode in every round, so a row's share of the bandwidth compares one minute with the same minute (this
VM's reads moved between 35 and 55 GB/s within an hour)."""


SHORT_PROMPT = 32
"""The short prompt a long row's rounds are paired with (``compare``): our decode after this many tokens, timed right
after each of our long rounds, so the share a long context keeps is measured within one minute of this VM."""


def stream_share(step_bytes: float, rates: list[float], read_gbps: list[float]) -> dict[str, Any]:
    """What our decode streamed per round (tok/s x bytes a step reads) against the bandwidth read beside it."""
    ours = [r * step_bytes / 1e9 for r in rates]
    share = [o / b for o, b in zip(ours, read_gbps)]
    return {"step_bytes": int(step_bytes), "read_gbps": [round(b, 2) for b in read_gbps],
            "ours_gbps": [round(o, 2) for o in ours], "share": [round(x, 3) for x in share],
            "share_median": round(statistics.median(share), 3)}


def _inputs(vocab: int, prompt_len: int, tokens: int, prefill_len: int) -> tuple[list[int], list[int], list[int]]:
    """The prompt, the tokens fed one by one after it, and the long prompt of the prefill timing (seeded)."""
    gen = torch.Generator().manual_seed(0)
    low = min(259, vocab // 2)  # past the special and byte tokens of the vocabularies written here
    prompt = torch.randint(low, vocab, (prompt_len,), generator=gen).tolist()
    follow = torch.randint(low, vocab, (tokens + 1,), generator=gen).tolist()
    return prompt, follow, torch.randint(low, vocab, (prefill_len,), generator=gen).tolist()


Side = tuple[Callable[[int], float], Callable[[], float], Callable[[], list[int]], Callable[[], None]]
"""One side's (seconds of n decode steps after the prompt, seconds of the long prompt's prefill, 8 greedy ids,
release what the side holds)."""


def _our_side(ours: Any, prompt: list[int], long_prompt: list[int]) -> Side:
    def decode(n: int) -> float:
        """Seconds of ``n`` decode steps after the prompt, on the scheduler's clock from the first token to the
        last (``DecodeTiming``): a clock started when this thread saw the first token would start late, after the
        scheduler had begun the next step, and credit ``n`` tokens to less than ``n`` steps."""
        timing = DecodeTiming.from_generation(ours.generate(prompt, max_new_tokens=n + 1, stop_token_ids=[]))
        if timing.tokens != n:
            raise RuntimeError(f"asked for {n} decode tokens after the first, got {timing.tokens}")
        return timing.seconds

    def prefill() -> float:
        return ours.generate(long_prompt, max_new_tokens=1, stop_token_ids=[]).prefill_s

    def greedy() -> list[int]:
        return list(ours.generate(prompt, max_new_tokens=8, stop_token_ids=[]).token_ids)

    return decode, prefill, greedy, lambda: None  # the engine is the caller's to close


LLAMA_Q8_0 = 8
"""ggml's GGML_TYPE_Q8_0: llama.cpp's 8-bit KV cache type (blocks of 32 int8 values and an fp16 scale)."""


LLAMA_BF16 = 30
"""ggml's GGML_TYPE_BF16."""


def llama_kv_kwargs() -> dict[str, Any]:
    """llama.cpp's KV cache settings that match ours (``$FREETOKEN_KV_DTYPE``, as our engine resolves it): an 8-bit
    cache (our fp8) → its q8_0 keys and values, which need its flash attention; bf16 → its bf16 keys and values (its
    CPU attention then rounds Q to bf16 and uses AVX512-BF16 dot products where the CPU has them, as ours does);
    anything else → its default (f16)."""
    from freetoken_agent.runtime.kv.pool import resolve_kv_dtype

    dtype = resolve_kv_dtype("auto", "cpu", torch.float32)
    if dtype == torch.float8_e4m3fn:
        return {"type_k": LLAMA_Q8_0, "type_v": LLAMA_Q8_0, "flash_attn": True}
    if dtype == torch.bfloat16:
        return {"type_k": LLAMA_BF16, "type_v": LLAMA_BF16}
    return {}


def _llama_side(gguf_path: Path, threads: int, prompt: list[int], follow: list[int], long_prompt: list[int]) -> Side:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=max(256, len(prompt) + len(follow) + 64,
                                                                len(long_prompt) + 16),
                          n_batch=512, n_ubatch=512, n_threads=threads, n_threads_batch=threads,
                          verbose=False, **llama_kv_kwargs())  # fmt: skip

    def decode(n: int) -> float:
        llm.reset()
        llm.eval(prompt)
        t0 = time.perf_counter()
        for tok in follow[:n]:
            llm.eval([tok])
        return time.perf_counter() - t0

    def prefill() -> float:
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(long_prompt)
        return time.perf_counter() - t0

    def greedy() -> list[int]:
        llm.reset()
        ids: list[int] = []
        for tok in llm.generate(prompt, temp=0.0, top_k=1):
            ids.append(tok)
            if len(ids) == 8:
                break
        return ids

    return decode, prefill, greedy, llm.close


def _summary(rates: dict[str, list[float]], prefill: dict[str, list[float]], ids: dict[str, list[int]],
             prompt_len: int, threads: int, tokens: int, rounds: int, prefill_len: int) -> dict[str, Any]:
    agree = next((i for i, (a, b) in enumerate(zip(ids["ours"], ids["llama.cpp"])) if a != b), 8)
    med = {k: statistics.median(v) for k, v in rates.items()}
    out = {
        "prompt_len": prompt_len, "threads": threads, "tokens": tokens, "rounds": rounds,
        "ours_tok_s": round(med["ours"], 2), "llama_cpp_tok_s": round(med["llama.cpp"], 2),
        "ratio": round(med["ours"] / med["llama.cpp"], 3), "rates": rates,
        "greedy_prefix_agreement": agree, "ours_ids": ids["ours"], "llama_ids": ids["llama.cpp"],
    }  # fmt: skip
    if prefill_len:
        out.update(prefill_len=prefill_len, ours_prefill_tok_s=round(prefill["ours"][0], 1),
                   llama_cpp_prefill_tok_s=round(prefill["llama.cpp"][0], 1),
                   prefill_ratio=round(prefill["ours"][0] / prefill["llama.cpp"][0], 3))
    return out


def compare(ours: Any, gguf_path: Path, vocab: int, threads: int, tokens: int, rounds: int, prompt_len: int,
            prefill_len: int = 0) -> dict[str, Any]:  # fmt: skip
    """Decode tok/s of our loaded engine and llama.cpp on ``gguf_path`` in alternating rounds (medians), the greedy
    tokens both produce, and with ``prefill_len`` the prefill tok/s of a prompt that long (one call each side).
    ``stream``: the bandwidth read just before each of our rounds and what our decode streamed in it;
    ``paired_short`` (a prompt longer than ``SHORT_PROMPT``): our rate after the short prompt (the long one's first
    tokens) timed right after each of our rounds, and the share the long context keeps, round by round."""
    prompt, follow, long_prompt = _inputs(vocab, prompt_len, tokens, prefill_len)
    short = _our_side(ours, _inputs(vocab, SHORT_PROMPT, tokens, 0)[0], [])[0] if prompt_len > SHORT_PROMPT else None
    sides = {"ours": _our_side(ours, prompt, long_prompt),
             "llama.cpp": _llama_side(gguf_path, threads, prompt, follow, long_prompt)}
    try:
        for decode, _, _, _ in sides.values():
            decode(2)
        if short:
            short(2)
        rates: dict[str, list[float]] = {"ours": [], "llama.cpp": []}
        prefill: dict[str, list[float]] = {"ours": [], "llama.cpp": []}
        read_gbps: list[float] = []
        short_rates: list[float] = []
        for i in range(rounds):
            order = list(sides.items())
            for label, (decode, pre, _, _) in order if i % 2 == 0 else order[::-1]:
                if label == "ours":
                    read_gbps.append(machine.best_read_gbps(BANDWIDTH_BYTES, rounds=3)[0])
                rates[label].append(tokens / decode(tokens))
                if label == "ours" and short:  # the same minute's short-prompt rate
                    short_rates.append(tokens / short(tokens))
                if prefill_len and i == 0:
                    prefill[label].append(prefill_len / pre())
        # same weights: both greedy-decode from the prompt; count agreeing tokens before the first difference
        ids = {label: greedy() for label, (_, _, greedy, _) in sides.items()}
    finally:
        for _, _, _, release in sides.values():
            release()
    out = _summary(rates, prefill, ids, prompt_len, threads, tokens, rounds, prefill_len)
    # a step after the prompt reads the weights and the KV of its context: on average prompt + (tokens + 1) / 2
    step = gguf_step_weight_bytes(gguf_path) + ours.kv_bytes_per_token() * (prompt_len + (tokens + 1) / 2)
    out["stream"] = stream_share(step, rates["ours"], read_gbps)
    if short_rates:
        kept = [a / b for a, b in zip(rates["ours"], short_rates)]
        out["paired_short"] = {"prompt_len": SHORT_PROMPT, "rates": [round(x, 2) for x in short_rates],
                               "kept": [round(x, 3) for x in kept], "kept_median": round(statistics.median(kept), 3)}
    return out


def measure_side(side: str, gguf_path: Path, threads: int, tokens: int, rounds: int, prompt_len: int,
                 prefill_len: int = 0) -> dict[str, Any]:
    """One side alone in this process (``--side``): its decode rates, prefill rate and greedy ids on ``gguf_path``."""
    from freetoken_agent.runtime.engine import Engine
    from freetoken_agent.runtime.kernels import ops

    torch.set_num_threads(threads)
    if side == "ours":
        ours = Engine.from_pretrained(gguf_path, threads=threads, speculate=False, require_tokenizer=False)
        ops.set_threads(threads)
        vocab = ours.spec.vocab_size
    else:
        from freetoken_agent.runtime.gguf.file import GGUFFile

        vocab = GGUFFile(gguf_path).tensors["token_embd.weight"].shape[0]  # as the GGUF loader reads it
    prompt, follow, long_prompt = _inputs(vocab, prompt_len, tokens, prefill_len)
    decode, pre, greedy, _ = _our_side(ours, prompt, long_prompt) if side == "ours" else \
        _llama_side(gguf_path, threads, prompt, follow, long_prompt)
    decode(2)
    rates = [tokens / decode(tokens) for _ in range(rounds)]
    return {"rates": rates, "prefill": [prefill_len / pre()] if prefill_len else [], "ids": greedy()}


def measure_file_isolated(gguf_path: Path, threads: int, tokens: int, rounds: int, prompt_len: int = 32,
                          prefill_len: int = 0) -> dict[str, Any]:
    """``measure_file`` with each side in its own process, one after the other (ours, then llama.cpp): neither
    side's memory (weights, a long context's KV and buffers) or idle threads sit beside the other's rounds. Rounds
    no longer alternate, so drift between the two processes' minutes is not cancelled: the ratio is less robust to
    a machine whose speed moves, more robust to one whose memory is short."""
    parts = {}
    for side in ("ours", "llama.cpp"):
        cmd = [sys.executable, "-m", "freetoken_agent.evals.perf.bench_gguf_decode", "--side", side,
               "--model", str(gguf_path), "--threads", str(threads), "--tokens", str(tokens), "--rounds",
               str(rounds), "--prompt-len", str(prompt_len), "--prefill-len", str(prefill_len)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise RuntimeError(f"the {side} process failed: {tail}")
        parts[side] = json.loads(proc.stdout.strip().splitlines()[-1])
    r = _summary({k: v["rates"] for k, v in parts.items()}, {k: v["prefill"] for k, v in parts.items()},
                 {k: v["ids"] for k, v in parts.items()}, prompt_len, threads, tokens, rounds, prefill_len)
    return {"params": gguf_param_count(gguf_path), "dense": "as stored", "formats": gguf_formats(gguf_path),
            "isolated": True, **r}


def _params(folder: Path) -> list[torch.Tensor]:
    from safetensors import safe_open

    out = []
    for file in checkpoint_files(folder):
        with safe_open(str(file), "pt") as f:
            out += [torch.empty(f.get_slice(k).get_shape(), device="meta") for k in f.keys()]
    return out


def param_count(folder: Path) -> int:
    """Parameters in the folder's checkpoint (from the safetensors headers; nothing is read)."""
    return sum(p.numel() for p in _params(folder))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/freetoken-bench-gguf", help="where the checkpoint and GGUF are cached")
    ap.add_argument("--threads", default="1", help="comma-separated thread counts")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dense", default="none", help="comma-separated dense-weight formats: none (fp32), q8, q4")
    ap.add_argument("--prompt-len", default="32", help="comma-separated tokens in the context before the timed decode")
    ap.add_argument("--model", type=Path, default=None, help="an existing qwen3_moe folder (default: the 1B one)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--side", choices=("ours", "llama.cpp"), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--prefill-len", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.side is not None:  # one side of measure_file_isolated: --model is the GGUF file
        print(json.dumps(measure_side(args.side, args.model, int(args.threads), args.tokens, args.rounds,
                                      int(args.prompt_len), args.prefill_len)))
        return 0
    if args.model is not None and not (args.model / "config.json").is_file():
        ap.error(f"--model {args.model}: no config.json there")
    folder = args.model or write_checkpoint(Path(args.dir) / "qwen3_moe-1b")
    results = [measure(folder, int(t), args.tokens, args.rounds, int(n), dense=d)
               for d in args.dense.split(",") for t in args.threads.split(",") for n in args.prompt_len.split(",")]
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        for r in results:
            print(f"{r['params'] / 1e9:.2f}B params, dense {r['dense']}, {r['threads']} thread(s), "
                  f"{r['prompt_len']}-token prompt: ours {r['ours_tok_s']} tok/s, "
                  f"llama.cpp {r['llama_cpp_tok_s']} tok/s, ratio {r['ratio']}, "
                  f"greedy agreement {r['greedy_prefix_agreement']}/8")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
