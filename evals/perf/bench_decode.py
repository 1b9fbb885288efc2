"""Rows ``decode`` and ``long-context``: decode tok/s of our engine against a peer on the same weights.

- ``--peer llama.cpp`` (default): q4 experts, the same Q4_0 blocks in a GGUF for llama.cpp (``bench_gguf_decode``),
  or ``--model file.gguf``: that file on both sides as it is (e.g. Q4_K_M from ``llama-quantize``);
  decode tok/s = N / the time of N single-token steps after the prompt (ours: the scheduler's clock from the first
  token to the last), ``--prompt-len`` tokens of context before them (``long-context``: 4,096 by default).
- ``--peer transformers``: fp32 checkpoints built with transformers (random weights, cached); each run times
  ``generate`` of 1 and of N+1 greedy tokens after the same prompt, decode tok/s is N / (t(N+1) - t(1)).

Rounds alternate ours / peer (``timing.alternate``); medians; the ratio is ours / peer.

    freetoken bench decode [--peer llama.cpp|transformers] [--model M] [--threads 1,2] [--tokens 16] [--json]
    freetoken bench decode --model file.gguf --prefill-len 512  # both sides load the same GGUF as it is
    freetoken bench long-context [--prompt-len 4096,8192]
    freetoken bench long-context --model file.gguf --prompt-len 8192 --isolate  # each side in its own process
"""

from __future__ import annotations

import argparse
import os
import statistics
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from freetoken_agent.evals.perf.harness import BenchError, module_main, row
from freetoken_agent.evals.perf.timing import alternate, timed

# name -> (architecture, transformers config overrides)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny": ("qwen3_moe", dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                               num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)),
    # ~0.7B parameters: Qwen3-MoE shape scaled down (32 experts, top-4)
    "mid": ("qwen3_moe", dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                              num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=32,
                              num_experts_per_tok=4, moe_intermediate_size=512, norm_topk_prob=True)),
}


def build(name: str, root: Path) -> Path:
    import transformers

    arch, overrides = MODELS[name]
    folder = root / f"{name}-{arch}"
    if (folder / "config.json").is_file():
        return folder
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(arch, max_position_embeddings=4096, bos_token_id=None,
                                               eos_token_id=None, pad_token_id=None, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    return folder


def measure(folder: Path, rounds: int, tokens: int, prompt_len: int) -> dict[str, Any]:
    import transformers

    from freetoken_agent.runtime.engine import Engine

    engine = Engine.from_pretrained(folder, threads=torch.get_num_threads())
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    params = sum(p.numel() for p in ref.parameters())
    prompt = torch.randint(0, engine.spec.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(0))

    def ours(n: int) -> None:
        engine.generate(prompt, max_new_tokens=n, stop_token_ids=[])

    def theirs(n: int) -> None:
        with torch.no_grad():
            ref.generate(prompt[None], do_sample=False, max_new_tokens=n, min_new_tokens=n)

    def rate(fn: Callable[[int], None]) -> Callable[[], float]:
        return lambda: tokens / max(timed(lambda: fn(tokens + 1))[1] - timed(lambda: fn(1))[1], 1e-9)

    rates = alternate({"ours": rate(ours), "transformers": rate(theirs)}, rounds)
    same = engine.generate(prompt, max_new_tokens=8, stop_token_ids=[]).token_ids == \
        ref.generate(prompt[None], do_sample=False, max_new_tokens=8)[0, prompt_len:].tolist()
    med = {k: statistics.median(v) for k, v in rates.items()}
    return {"params": params, "ours_tok_s": med["ours"], "transformers_tok_s": med["transformers"],
            "ratio": med["ours"] / med["transformers"], "greedy_identical": same,
            "runs": rates, "threads": torch.get_num_threads()}


def options(p: argparse.ArgumentParser, prompt_len: str = "32") -> None:
    p.add_argument("--peer", default="llama.cpp", choices=("llama.cpp", "transformers"),
                   help="llama.cpp: q4 on the same GGUF weights (bench_gguf_decode); transformers: fp32 generate")
    p.add_argument("--model", default=None,
                   help="llama.cpp: an existing qwen3_moe folder (default: the 1.3B synthetic one), or a .gguf file "
                        "both sides load as it is (e.g. written by llama-quantize); transformers: comma-separated "
                        f"presets of {', '.join(MODELS)} (default tiny,mid)")
    p.add_argument("--prefill-len", type=int, default=0,
                   help="llama.cpp: also time the prefill of a prompt this long, one call per side (0: skip)")
    p.add_argument("--threads", default="1", help="comma-separated thread counts")
    p.add_argument("--tokens", type=int, default=16, help="decode tokens per run")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (medians)")
    p.add_argument("--prompt-len", default=prompt_len, help="comma-separated context lengths before the timed decode")
    p.add_argument("--dense", default="none", help="llama.cpp: comma-separated dense formats both sides use: none, q8, q4")
    p.add_argument("--dir", default=str(CACHE), help="where the synthetic checkpoints are cached")
    p.add_argument("--isolate", action="store_true",
                   help="with --model file.gguf: each side in its own process, one after the other (a long context on "
                        "a machine short of memory), instead of alternating rounds in one process")


CACHE = Path(os.environ.get("FREETOKEN_CACHE", Path.home() / ".cache" / "freetoken")) / "bench"


def _ints(text: str, flag: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        vals = []
    if not vals or min(vals) < 1:
        raise BenchError(f"{flag} takes comma-separated positive integers, got {text!r}")
    return vals


def decode_report(args: argparse.Namespace) -> dict[str, Any]:
    """Ours vs the chosen peer, one entry per (model or dense format, threads, prompt length)."""
    from freetoken_agent.evals.perf import bench_gguf_decode
    from freetoken_agent.runtime.threads import configure_threads

    if args.tokens < 1 or args.rounds < 1:
        raise BenchError(f"--tokens and --rounds must be at least 1, got {args.tokens}, {args.rounds}")
    threads, prompts = _ints(args.threads, "--threads"), _ints(args.prompt_len, "--prompt-len")
    runs = []
    if args.peer == "transformers":
        warnings.filterwarnings("ignore")
        names = (args.model or "tiny,mid").split(",")
        if unknown := [n for n in names if n not in MODELS]:
            raise BenchError(f"--model with --peer transformers takes presets {', '.join(MODELS)}, got {unknown}")
        for name in names:
            for t in threads:
                for n in prompts:
                    configure_threads(t)
                    r = measure(build(name, Path(args.dir) / "decode"), args.rounds, args.tokens, n)
                    runs.append({"model": name, "prompt_len": n, "peer_tok_s": r.pop("transformers_tok_s"), **r})
    elif args.model is not None and Path(args.model).suffix == ".gguf":
        if not Path(args.model).is_file():
            raise BenchError(f"--model {args.model}: no such file")
        for t in threads:
            for n in prompts:
                measure = bench_gguf_decode.measure_file_isolated if args.isolate else bench_gguf_decode.measure_file
                r = measure(Path(args.model), t, args.tokens, args.rounds, n, prefill_len=args.prefill_len)
                runs.append({"model": str(args.model), "peer_tok_s": r.pop("llama_cpp_tok_s"), **r})
    else:
        if args.model is not None and not (Path(args.model) / "config.json").is_file():
            raise BenchError(f"--model {args.model}: no config.json there")
        folder = Path(args.model) if args.model else bench_gguf_decode.write_checkpoint(
            Path(args.dir) / "gguf" / "qwen3_moe-1b")
        for d in args.dense.split(","):
            for t in threads:
                for n in prompts:
                    r = bench_gguf_decode.measure(folder, t, args.tokens, args.rounds, n, dense=d,
                                                  prefill_len=args.prefill_len)
                    runs.append({"model": str(folder), "peer_tok_s": r.pop("llama_cpp_tok_s"), **r})
    for r in runs:
        r["ratio"] = round(r["ours_tok_s"] / r["peer_tok_s"], 3)
    keep_rates(runs)
    return {"peer": args.peer, "tokens": args.tokens, "rounds": args.rounds, "runs": runs,
            "ours_tok_s": runs[0]["ours_tok_s"], "peer_tok_s": runs[0]["peer_tok_s"], "ratio": runs[0]["ratio"]}


def keep_rates(runs: list[dict[str, Any]]) -> None:
    """Each run after a longer prompt gets ``of_short``: our rate over ours after the shortest prompt of the same
    model, dense format and thread count (``short_prompt``) — how much of its speed a long context keeps."""
    for r in runs:
        same = [x for x in runs if (x["model"], x.get("dense"), x["threads"]) == (r["model"], r.get("dense"),
                                                                                   r["threads"])]
        short = min(same, key=lambda x: x["prompt_len"])
        if short["prompt_len"] < r["prompt_len"]:
            r["of_short"], r["short_prompt"] = round(r["ours_tok_s"] / short["ours_tok_s"], 3), short["prompt_len"]


def _rounds(values: list[float], digits: int = 1) -> str:
    return ", ".join(f"{v:.{digits}f}" for v in values)


def format_report(r: dict[str, Any], args: argparse.Namespace | None = None) -> str:
    kept = any("of_short" in x for x in r["runs"])
    lines = [f"decode tok/s, ours vs {r['peer']}, {r['tokens']} tokens, median of {r['rounds']} alternating rounds",
             "| model | params | dense | threads | prompt | ours | peer | ours / peer |"
             + (" ours / ours after the shortest prompt |" if kept else ""), "|---|---|---|---|---|---|---|---|"
             + ("---|" if kept else "")]
    for x in r["runs"]:
        lines.append(f"| {Path(str(x['model'])).name} | {x['params'] / 1e9:.2f}B | {x.get('dense', 'fp32')} | "
                     f"{x['threads']} | {x['prompt_len']} | {x['ours_tok_s']:.2f} | {x['peer_tok_s']:.2f} | "
                     f"{x['ratio']:.2f}x |" + ((f" {x['of_short']:.2f} |" if "of_short" in x else " 1.00 |")
                                               if kept else ""))
    streams = [x for x in r["runs"] if x.get("stream")]
    if streams:
        lines += ["", "our decode's stream against the read bandwidth measured just before each of our rounds",
                  "| threads | prompt | bytes a step reads | ours GB/s (rounds) | read GB/s (rounds) | "
                  "share (rounds) | median share |", "|---|---|---|---|---|---|---|"]
        for x in streams:
            st = x["stream"]
            lines.append(f"| {x['threads']} | {x['prompt_len']} | {st['step_bytes'] / 1e9:.3f} GB | "
                         f"{_rounds(st['ours_gbps'])} | {_rounds(st['read_gbps'])} | {_rounds(st['share'], 2)} | "
                         f"{st['share_median']:.2f} |")
    paired = [x for x in r["runs"] if x.get("paired_short")]
    if paired:
        lines += ["", "what a long context keeps of our short-prompt rate, measured in the same round (our decode after "
                  f"{paired[0]['paired_short']['prompt_len']} tokens timed right after each long round)",
                  "| threads | prompt | ours (rounds) | ours after the short prompt (rounds) | kept (rounds) | "
                  "median kept |", "|---|---|---|---|---|---|"]
        for x in paired:
            ps = x["paired_short"]
            lines.append(f"| {x['threads']} | {x['prompt_len']} | {_rounds(x['rates']['ours'])} | "
                         f"{_rounds(ps['rates'])} | {_rounds(ps['kept'], 2)} | {ps['kept_median']:.2f} |")
    pre = [x for x in r["runs"] if x.get("prefill_len")]
    if pre:
        lines += ["", "prefill tok/s (one call per side)", "| model | threads | prompt | ours | peer | ours / peer |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {Path(str(x['model'])).name} | {x['threads']} | {x['prefill_len']} | {x['ours_prefill_tok_s']} | "
                  f"{x['llama_cpp_prefill_tok_s']} | {x['prefill_ratio']:.2f}x |" for x in pre]
    return "\n".join(lines)


def _headline(r: dict[str, Any]) -> dict[str, Any]:
    return {f"{x.get('dense', 'fp32')}/t{x['threads']}/p{x['prompt_len']}": f"{x['ours_tok_s']:.2f} vs "
            f"{x['peer_tok_s']:.2f} ({x['ratio']:.2f}x)" for x in r["runs"][:6]} | {"peer": r["peer"]}


@row("decode", "decode tok/s after a short prompt: ours vs llama.cpp (q4, same GGUF weights) or transformers (fp32)",
     options, format=format_report, headline=_headline)
def decode_row(args: argparse.Namespace) -> dict[str, Any]:
    return decode_report(args)


@row("long-context", "decode tok/s after a long prompt (default 4,096 tokens): ours vs llama.cpp on the same weights",
     lambda p: options(p, prompt_len="4096"), format=format_report, headline=_headline)
def long_context_row(args: argparse.Namespace) -> dict[str, Any]:
    return decode_report(args)


def main(argv: list[str] | None = None) -> int:
    return module_main("decode", argv)


if __name__ == "__main__":
    raise SystemExit(main())
