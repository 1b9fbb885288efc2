"""Row ``prefill`` (suite rows ``cpu_prefill_q4``, ``cpu_prefill_fp32``): prefill tok/s and TTFT of one prompt.

- ``cpu_prefill_q4``: ours (``quant="q4"``) vs llama.cpp on the same GGUF Q4_0 weights, llama.cpp as it runs by
  default (experts repacked for its kernels, ``n_batch = n_ubatch = 512``);
- ``cpu_prefill_fp32``: ours vs ``transformers`` on the same fp32 checkpoint.

TTFT = wall time from the prompt's token ids to the first greedy token, nothing cached. Prefill tok/s = prompt
tokens / the prompt's forward time (ours: the engine's prefill clock inside the same call; llama.cpp: ``eval`` inside
the same call; transformers: a separate ``model(ids, use_cache=True)``, because ``generate`` exposes no clock).
Rounds alternate ours / peer (``timing.alternate``); medians. Ratios are speed ratios, > 1 when ours is faster:
prefill ours / peer, TTFT peer / ours.

    freetoken bench prefill [--peer llama.cpp|transformers] [--model M] [--prompt-len 512] [--rounds 3] [--threads 1]
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from freetoken_agent.evals.perf.harness import BenchError, row
from freetoken_agent.evals.perf.timing import alternate, timed

# (TTFT seconds, prefill seconds, first token)
Timing = tuple[float, float, int]


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
        out, ttft = timed(lambda: ours.generate(prompt, max_new_tokens=1, stop_token_ids=[]))
        return ttft, out.prefill_s, out.token_ids[0]

    def run_llama() -> Timing:
        llm.reset()
        t0 = time.perf_counter()
        _, prefill = timed(lambda: llm.eval(prompt))
        token = llm.sample(top_k=1, temp=0.0)
        return time.perf_counter() - t0, prefill, int(token)

    runs = alternate({"ours": run_ours, "llama.cpp": run_llama}, rounds)
    return _row(params, "llama.cpp Q4_0", len(prompt), runs)


def prefill_fp32(folder: Path, prompt_len: int, rounds: int, threads: int) -> dict[str, Any]:
    """Ours vs ``transformers`` (fp32) on ``folder``; TTFT through each side's ``generate``."""
    import transformers
    from freetoken_agent.runtime.engine import Engine

    engine = Engine.from_pretrained(folder, threads=threads)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = torch.randint(0, engine.spec.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(2))

    def run_ours() -> Timing:
        out, ttft = timed(lambda: engine.generate(prompt, max_new_tokens=1, stop_token_ids=[]))
        return ttft, out.prefill_s, out.token_ids[0]

    def run_theirs() -> Timing:
        with torch.no_grad():
            out, ttft = timed(lambda: ref.generate(prompt[None], do_sample=False, max_new_tokens=1, min_new_tokens=1))
            _, prefill = timed(lambda: ref(prompt[None], use_cache=True))
            return ttft, prefill, int(out[0, -1])

    runs = alternate({"ours": run_ours, "transformers": run_theirs}, rounds)
    return _row(sum(p.numel() for p in ref.parameters()), "transformers fp32", prompt_len, runs)


def options(p: Any) -> None:
    p.add_argument("--peer", default="llama.cpp", choices=("llama.cpp", "transformers"),
                   help="llama.cpp: q4 on the same GGUF weights; transformers: fp32 on the same checkpoint")
    p.add_argument("--model", default=None, help="llama.cpp: a qwen3_moe folder (default: the 1.3B synthetic one); "
                                                 "transformers: a bench_decode preset (default tiny)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)


@row("prefill", "prefill tok/s and time to first token of one prompt: ours vs llama.cpp (q4) or transformers (fp32)",
     options)
def prefill_row(args: Any) -> dict[str, Any]:
    from freetoken_agent.evals.perf import bench_decode, bench_gguf_decode
    from freetoken_agent.runtime.engine import Engine

    if args.prompt_len < 1 or args.rounds < 1 or args.threads < 1:
        raise BenchError("--prompt-len, --rounds and --threads must be at least 1")
    torch.set_num_threads(args.threads)
    if args.peer == "transformers":
        name = args.model or "tiny"
        if name not in bench_decode.MODELS:
            raise BenchError(f"--model with --peer transformers takes one of {', '.join(bench_decode.MODELS)}")
        return prefill_fp32(bench_decode.build(name, bench_decode.CACHE / "decode"), args.prompt_len, args.rounds,
                            args.threads)
    from freetoken_agent.evals.perf.suite_llama import open_llama

    folder = Path(args.model) if args.model else bench_gguf_decode.write_checkpoint(
        bench_decode.CACHE / "gguf" / "qwen3_moe-1b")
    if not (folder / "config.json").is_file():
        raise BenchError(f"--model {folder}: no config.json there")
    config = json.loads((folder / "config.json").read_text())
    ours = Engine.from_pretrained(folder, quant="q4", threads=args.threads)
    llm = open_llama(bench_gguf_decode.ensure_gguf(folder, args.threads), args.threads, n_ctx=args.prompt_len + 64)
    return prefill_q4(ours, llm, prompt_ids(args.prompt_len, config["vocab_size"]), args.rounds,
                      bench_gguf_decode.param_count(folder))
