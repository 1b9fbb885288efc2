"""Suite rows ``cpu_prefill_q4`` and ``cpu_prefill_fp32``: prefill tok/s and TTFT for a prompt of a few hundred tokens.

- ``cpu_prefill_q4``: ours (``quant="q4"``) vs llama.cpp on the same GGUF Q4_0 weights, llama.cpp as it runs by
  default (experts repacked for its kernels, ``n_batch = n_ubatch = 512``);
- ``cpu_prefill_fp32``: ours vs ``transformers`` on the same fp32 checkpoint.

TTFT = wall time from the prompt's token ids to the first greedy token, nothing cached. Prefill tok/s = prompt
tokens / the prompt's forward time (ours: the engine's prefill clock inside the same call; llama.cpp: ``eval`` inside
the same call; transformers: a separate ``model(ids, use_cache=True)``, because ``generate`` exposes no clock).
Rounds alternate ours / peer; medians. Ratios are speed ratios, > 1 when ours is faster: prefill ours / peer, TTFT
peer / ours.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# (TTFT seconds, prefill seconds, first token)
Timing = tuple[float, float, int]


def _alternate(sides: dict[str, Callable[[], Timing]], rounds: int) -> dict[str, list[Timing]]:
    for fn in sides.values():  # warm-up: first-call allocations and lazy initialisation
        fn()
    runs: dict[str, list[Timing]] = {k: [] for k in sides}
    for _ in range(rounds):
        for label, fn in sides.items():
            runs[label].append(fn())
    return runs


def _row(params: int, peer: str, prompt_len: int, runs: dict[str, list[Timing]]) -> dict[str, Any]:
    ours_runs, peer_runs = runs.values()  # ours first
    ttft = [statistics.median(r[0] for r in v) for v in (ours_runs, peer_runs)]
    pre = [prompt_len / statistics.median(r[1] for r in v) for v in (ours_runs, peer_runs)]
    return {
        "params": params, "peer": peer, "prompt_tokens": prompt_len,
        "ours_ttft_s": round(ttft[0], 6), "peer_ttft_s": round(ttft[1], 6), "ttft_ratio": round(ttft[1] / ttft[0], 3),
        "ours_prefill_tok_s": round(pre[0], 1), "peer_prefill_tok_s": round(pre[1], 1),
        "prefill_ratio": round(pre[0] / pre[1], 3),
        "first_token_agrees": ours_runs[0][2] == peer_runs[0][2],
        "runs": {k: {"ttft_s": [round(r[0], 6) for r in v], "prefill_s": [round(r[1], 6) for r in v]}
                 for k, v in runs.items()},
    }  # fmt: skip


def prompt_ids(prompt_len: int, vocab: int, seed: int = 2) -> list[int]:
    """Random token ids above the GGUF vocabulary's 259 special and byte tokens."""
    return torch.randint(259, vocab, (prompt_len,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefill_q4(ours: Any, llm: Any, prompt: list[int], rounds: int, params: int) -> dict[str, Any]:
    """Ours (a q4 ``Engine``) vs llama.cpp (a ``Llama`` over the same weights), cold prompt each run."""

    def run_ours() -> Timing:
        t0 = time.perf_counter()
        out = ours.generate(prompt, max_new_tokens=1, stop_token_ids=[])
        return time.perf_counter() - t0, out.prefill_s, out.token_ids[0]

    def run_llama() -> Timing:
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        t1 = time.perf_counter()
        token = llm.sample(top_k=1, temp=0.0)
        return time.perf_counter() - t0, t1 - t0, int(token)

    runs = _alternate({"ours": run_ours, "llama.cpp": run_llama}, rounds)
    return _row(params, "llama.cpp Q4_0", len(prompt), runs)


def prefill_fp32(folder: Path, prompt_len: int, rounds: int, threads: int) -> dict[str, Any]:
    """Ours vs ``transformers`` (fp32) on ``folder``; TTFT through each side's ``generate``."""
    import transformers
    from freetoken_agent.runtime.engine import Engine

    engine = Engine.from_pretrained(folder, threads=threads)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = torch.randint(0, engine.spec.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(2))

    def run_ours() -> Timing:
        t0 = time.perf_counter()
        out = engine.generate(prompt, max_new_tokens=1, stop_token_ids=[])
        return time.perf_counter() - t0, out.prefill_s, out.token_ids[0]

    def run_theirs() -> Timing:
        with torch.no_grad():
            t0 = time.perf_counter()
            out = ref.generate(prompt[None], do_sample=False, max_new_tokens=1, min_new_tokens=1)
            ttft = time.perf_counter() - t0
            t1 = time.perf_counter()
            ref(prompt[None], use_cache=True)
            return ttft, time.perf_counter() - t1, int(out[0, -1])

    runs = _alternate({"ours": run_ours, "transformers": run_theirs}, rounds)
    return _row(sum(p.numel() for p in ref.parameters()), "transformers fp32", prompt_len, runs)
