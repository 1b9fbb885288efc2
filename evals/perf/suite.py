"""``freetoken bench suite [--quick] [--json]``: our engine against its peers on the same weights, in one run.

Rows (each a pairwise comparison, runs alternating A/B in one process, medians; every ratio is a speed ratio,
> 1 when ours is faster: tok/s ours / peer, times peer / ours):

- ``cpu_decode_q4_dense_q8`` / ``cpu_decode_q4``: a ~1.3B-parameter random ``qwen3_moe`` (64 experts, top-8,
  Qwen3-30B-A3B expert shape), ours with Q4_0 experts vs llama.cpp (``llama-cpp-python``) on the same weights
  written as GGUF (``bench_gguf_decode``): the attention projections and lm_head as Q8_0 on both sides (ours:
  ``dense_quant="q8"``; what a user runs) — ``cpu_decode_ratio_vs_llamacpp`` — and as F32 on both sides —
  ``cpu_decode_f32_dense_ratio_vs_llamacpp``.
- ``cpu_decode_fp32``: ours vs ``transformers.generate`` on the same fp32 checkpoint (``bench_decode``).
- ``cpu_prefill_q4`` / ``cpu_prefill_fp32``: prefill tok/s and TTFT of a prompt of a few hundred tokens, the same
  two pairs (``suite_prefill``): ``prefill_ratio_vs_llamacpp``, ``ttft_ratio_vs_llamacpp`` (and ``_vs_transformers``).
- ``agent_replay``: a multi-turn agent session (recorded trajectories or a built-in synthetic one) on the q4
  weights, ours with session prefix reuse vs llama.cpp with its own prefix reuse, TTFT per turn
  (``suite_replay``): ``agent_replay_ttft_ratio_vs_llamacpp``.
- ``over_budget_decode``: a model whose experts are 2.5x the host budget's expert share, ours streaming experts
  from the disk tier vs llama.cpp's mmap held to the same budget (``suite_budget``; the method is in the row):
  ``over_budget_decode_ratio_vs_llamacpp``.
- ``bandwidth_fraction``: bytes one decode step of the q4 model with Q8_0 dense weights reads (dense weights but
  the embedding, 8 experts x 4 layers at Q4_0, KV; the F32-dense figure is in the row too) x our tok/s, over the machine's streaming-read limit measured here (``machine.best_read_gbps``: a ``torch``
  sum over 512 MiB, best of 7, on one thread and on all cores: the faster). On compute-bound CPUs the kernels top out near 55%
  (``../shared/CPU-KERNELS.md``).
- peak host memory of the process (``ru_maxrss``); this CPU machine has no device tier.

Sizes: ``QUICK`` and ``FULL`` (``Sizes``). The JSON (``--out``, default ``$FREETOKEN_CACHE/bench/suite.json``) holds
every run.
"""

from __future__ import annotations

import json
import os
import resource
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from freetoken_agent.evals.perf.harness import BenchError, row


@dataclass(frozen=True)
class Sizes:
    """How much each row runs."""

    tokens: int
    """Decode tokens per run (decode rows)."""
    rounds: int
    """Alternating rounds per comparison (medians)."""
    fp32_model: str
    """``bench_decode.MODELS`` entry for the fp32 rows."""
    prompt_tokens: int
    """Prompt length of the prefill / TTFT rows."""
    replay_sessions: int
    """Conversations replayed (the ones with most turns within ``replay_context``)."""
    replay_turns: int
    """Assistant turns per conversation, at most."""
    replay_context: int
    """Longest prompt replayed, in tokens."""
    budget_tokens: int
    """Decode tokens per run of the over-budget row."""
    budget_ratio: float = 2.5
    """Quantized experts / the host budget's expert share."""


QUICK = Sizes(tokens=16, rounds=3, fp32_model="tiny", prompt_tokens=256, replay_sessions=1, replay_turns=8,
              replay_context=3072, budget_tokens=16)
FULL = Sizes(tokens=32, rounds=5, fp32_model="mid", prompt_tokens=512, replay_sessions=3, replay_turns=12,
             replay_context=6144, budget_tokens=32)


def decode_bytes_per_token(config: dict[str, Any], context: int) -> int:
    """Bytes one decode step reads for ``config`` with Q4_0 experts and fp32 dense weights (``capacity``)."""
    from freetoken_agent.runtime.execution.capacity import model_size

    size = model_size(config, "q4")
    return size.dense_read_bytes + size.active_expert_bytes + size.kv_bytes(context)


def _tag(config: dict[str, Any], default: dict[str, Any], name: str) -> str:
    return name if config is default else f"qwen3_moe-d{config['hidden_size']}-l{config['num_hidden_layers']}" \
        f"-e{config['num_experts']}"


def run(quick: bool = True, threads: int = 1, root: Path | None = None,
        progress: Callable[[str], None] | None = None, q4_config: dict[str, Any] | None = None,
        budget_config: dict[str, Any] | None = None, trajectories: Path | None = None,
        sizes: Sizes | None = None) -> dict[str, Any]:
    """Run every comparison; returns the JSON report. ``q4_config``: another ``qwen3_moe`` shape for the llama.cpp
    rows (vocab >= 8192; tests use a small one), default ``bench_gguf_decode.CONFIG``; ``budget_config``: the
    over-budget model (default: ``suite_budget.QUICK_CONFIG`` with ``quick``, else the q4 model);
    ``trajectories``: a folder of ``*.traj.json`` for the replay row (None: the built-in synthetic session)."""
    import torch
    from freetoken_agent.evals.perf import (
        bench_decode,
        bench_gguf_decode,
        suite_budget,
        suite_prefill,
        suite_replay,
    )
    from freetoken_agent.evals.perf.suite_llama import open_llama, supported
    from freetoken_agent.evals.perf import machine
    from freetoken_agent.runtime.engine import Engine
    from freetoken_agent.runtime.hardware import describe

    say = progress or (lambda s: None)
    root = root or Path(os.environ.get("FREETOKEN_CACHE", Path.home() / ".cache" / "freetoken")) / "bench"
    sz = sizes or (QUICK if quick else FULL)
    t_start = time.perf_counter()
    report: dict[str, Any] = {
        "command": "freetoken bench suite" + (" --quick" if quick else ""),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {"cpu": describe()[1]["model"], "cores": os.cpu_count(),
                    "load_avg_1m": round(os.getloadavg()[0], 2)},
        "threads": threads, "tokens": sz.tokens, "rounds": sz.rounds, "sizes": asdict(sz), "rows": {},
        "ratios": "speed ratios ours / peer: > 1 means ours is faster (tok/s: ours / peer; times: peer / ours)",
    }  # fmt: skip
    rows = report["rows"]
    q4_config = q4_config or bench_gguf_decode.CONFIG
    folder = bench_gguf_decode.write_checkpoint(root / "gguf" / _tag(q4_config, bench_gguf_decode.CONFIG,
                                                                     "qwen3_moe-1b"), config=q4_config)
    say("q4 decode: ours vs llama.cpp on the same GGUF Q4_0 weights (the checkpoint and GGUF are written once)")
    g = bench_gguf_decode.measure(folder, threads, sz.tokens, sz.rounds)
    rows["cpu_decode_q4"] = {"ours_tok_s": g["ours_tok_s"], "peer": "llama.cpp Q4_0", "peer_tok_s": g["llama_cpp_tok_s"],
                             "ratio": g["ratio"], "runs": g["rates"], "params": g["params"], "dense": "fp32 / F32",
                             "greedy_prefix_agreement": g["greedy_prefix_agreement"],
                             "stream": g["stream"]}  # fmt: skip
    say("q4 decode with Q8_0 dense weights on both sides (ours: dense_quant='q8'; the GGUF gets the same blocks)")
    gq = bench_gguf_decode.measure(folder, threads, sz.tokens, sz.rounds, dense="q8")
    rows["cpu_decode_q4_dense_q8"] = {
        "ours_tok_s": gq["ours_tok_s"], "peer": "llama.cpp Q4_0 + Q8_0 dense", "peer_tok_s": gq["llama_cpp_tok_s"],
        "ratio": gq["ratio"], "runs": gq["rates"], "params": gq["params"], "dense": "Q8_0 (both)",
        "greedy_prefix_agreement": gq["greedy_prefix_agreement"], "stream": gq["stream"]}  # fmt: skip
    say(f"q4 prefill + TTFT ({sz.prompt_tokens}-token prompt) and agent-session replay: ours vs llama.cpp")
    ours = Engine.from_pretrained(folder, quant="q4", threads=threads)
    llm = open_llama(folder / "model-q4_0.gguf", threads, n_ctx=max(sz.prompt_tokens, sz.replay_context) + 64)
    prompt = suite_prefill.prompt_ids(sz.prompt_tokens, q4_config["vocab_size"])
    rows["cpu_prefill_q4"] = suite_prefill.prefill_q4(ours, llm, prompt, sz.rounds, g["params"])
    rows["agent_replay"] = suite_replay.measure(ours, llm, trajectories, sz.replay_sessions, sz.replay_turns,
                                                sz.replay_context, q4_config["vocab_size"])
    rows["agent_replay"]["params"] = g["params"]
    del ours, llm
    say("fp32 decode, prefill + TTFT: ours vs transformers")
    torch.set_num_threads(threads)
    fp32_folder = bench_decode.build(sz.fp32_model, root / "decode")
    d = bench_decode.measure(fp32_folder, sz.rounds, sz.tokens, 32)
    rows["cpu_decode_fp32"] = {"ours_tok_s": round(d["ours_tok_s"], 2), "peer": "transformers fp32",
                               "peer_tok_s": round(d["transformers_tok_s"], 2), "ratio": round(d["ratio"], 3),
                               "runs": d["runs"], "params": d["params"], "greedy_identical": d["greedy_identical"]}
    rows["cpu_prefill_fp32"] = suite_prefill.prefill_fp32(fp32_folder, sz.prompt_tokens, sz.rounds, threads)
    budget_config = budget_config or (suite_budget.QUICK_CONFIG if quick else q4_config)
    say(f"decode with experts {sz.budget_ratio}x the host budget: ours (disk tier) vs llama.cpp (mmap, same budget)")
    budget_folder = bench_gguf_decode.write_checkpoint(root / "gguf" / _tag(budget_config, q4_config, folder.name),
                                                       config=budget_config)
    why_not = supported()
    rows["over_budget_decode"] = {"skipped": why_not} if why_not else suite_budget.measure(
        budget_folder, threads, sz.budget_tokens, sz.rounds, sz.budget_ratio)
    say("streaming-read bandwidth (all cores: the machine's limit)")
    gbps, read_threads = machine.best_read_gbps()
    per_token = decode_bytes_per_token(q4_config, 32 + sz.tokens)
    per_token_q8 = per_token - gq["dense_float_bytes"] + gq["dense_quant_bytes"]  # the same step with Q8_0 dense
    ours_frac = per_token_q8 * gq["ours_tok_s"] / (gbps * 1e9)
    peer_frac = per_token_q8 * gq["llama_cpp_tok_s"] / (gbps * 1e9)
    rows["bandwidth"] = {"read_gbps": round(gbps, 2), "read_threads": read_threads, "bytes_per_token": per_token_q8,
                         "ours_fraction": round(ours_frac, 3), "llama_cpp_fraction": round(peer_frac, 3),
                         "row": "cpu_decode_q4_dense_q8",
                         "f32_dense": {"bytes_per_token": per_token,
                                       "ours_fraction": round(per_token * g["ours_tok_s"] / (gbps * 1e9), 3),
                                       "llama_cpp_fraction": round(per_token * g["llama_cpp_tok_s"] / (gbps * 1e9),
                                                                   3)}}  # fmt: skip
    report["peak_host_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    report.update({
        "cpu_decode_ratio_vs_llamacpp": gq["ratio"], "cpu_decode_f32_dense_ratio_vs_llamacpp": g["ratio"],
        "bandwidth_fraction": round(ours_frac, 3),
        "prefill_ratio_vs_llamacpp": rows["cpu_prefill_q4"]["prefill_ratio"],
        "ttft_ratio_vs_llamacpp": rows["cpu_prefill_q4"]["ttft_ratio"],
        "cpu_decode_fp32_ratio_vs_transformers": rows["cpu_decode_fp32"]["ratio"],
        "prefill_ratio_vs_transformers": rows["cpu_prefill_fp32"]["prefill_ratio"],
        "ttft_ratio_vs_transformers": rows["cpu_prefill_fp32"]["ttft_ratio"],
        "agent_replay_ttft_ratio_vs_llamacpp": rows["agent_replay"]["ratio"],
        "over_budget_decode_ratio_vs_llamacpp": rows["over_budget_decode"].get("ratio"),
    })  # fmt: skip
    report["wall_s"] = round(time.perf_counter() - t_start, 1)
    return report


def _params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.1f}M"


def _budget_note(o: dict[str, Any]) -> str:
    return (f"over budget: host budget {o['host_budget_bytes'] / 1e6:.0f} MB = dense {o['dense_bytes'] / 1e6:.0f} MB"
            f" + experts {o['expert_bytes'] / 1e6:.0f} MB / {o['experts_over_share']}; llama.cpp as it runs "
            f"{o['peer_default_tok_s']:.2f} tok/s ({o['ratio_vs_default']:.2f}x; evicts "
            f"{o['peer_evicted_mb_per_token']} MB/token: the kernel reads around every fault), with MADV_RANDOM "
            f"{o['peer_random_access_tok_s']:.2f} tok/s ({o['ratio_vs_random_access']:.2f}x), unbounded "
            f"{o['peer_unbounded_tok_s']:.2f} tok/s; ours reads {o['ours_disk_mb_per_token']} MB/token from disk, "
            f"peak {o['ours_peak_host_bytes'] / 1e6:.0f} MB, llama.cpp's file peak "
            f"{o['peer_peak_file_bytes'] / 1e6:.0f} MB; same greedy tokens for "
            f"{o['greedy_prefix_agreement']}/{o['tokens']}. Method: {o['method']}.")


def format_table(r: dict[str, Any]) -> str:
    """One markdown table of the report, then a note per row that needs one."""
    rows = r["rows"]
    head = (f"`{r['command']}` — {r['date']}, {r['machine']['cpu']} ({r['machine']['cores']} cores, load "
            f"{r['machine']['load_avg_1m']}), {r['threads']} thread(s), median of {r['rounds']} alternating rounds, "
            f"{r['wall_s']} s; ratios: > 1 = ours faster")
    lines = [head, "", "| comparison | model | ours | peer | peer | ours / peer (speed) |", "|---|---|---|---|---|---|"]

    def add(name: str, x: dict[str, Any], ours: str, peer: str, theirs: str, ratio: float) -> None:
        lines.append(f"| {name} | {_params(x['params'])} | {ours} | {peer} | {theirs} | {ratio:.2f}x |")

    for key in ("cpu_decode_q4_dense_q8", "cpu_decode_q4", "cpu_decode_fp32"):
        x = rows[key]
        dense = f", dense {x['dense']}" if "dense" in x else ""
        add(f"{key} ({r['tokens']} tokens{dense})", x, f"{x['ours_tok_s']:.2f} tok/s", x["peer"],
            f"{x['peer_tok_s']:.2f} tok/s", x["ratio"])
    for key in ("cpu_prefill_q4", "cpu_prefill_fp32"):
        x, n = rows[key], rows[key]["prompt_tokens"]
        add(f"{key} ({n}-token prompt)", x, f"{x['ours_prefill_tok_s']:.0f} tok/s", x["peer"],
            f"{x['peer_prefill_tok_s']:.0f} tok/s", x["prefill_ratio"])
        add(f"TTFT {key.removeprefix('cpu_prefill_')} ({n}-token prompt)", x, f"{x['ours_ttft_s'] * 1e3:.0f} ms",
            x["peer"], f"{x['peer_ttft_s'] * 1e3:.0f} ms", x["ttft_ratio"])
    a = rows["agent_replay"]
    add(f"agent replay TTFT, median of turns >= 1 ({a['turns']} turns, {a['sessions']} session(s))", a,
        f"{a['ours_ttft_s'] * 1e3:.0f} ms", a["peer"], f"{a['peer_ttft_s'] * 1e3:.0f} ms", a["ratio"])
    o = rows["over_budget_decode"]
    if "skipped" in o:
        lines.append(f"| decode over the host budget | | skipped: {o['skipped']} | | | |")
    else:
        add(f"decode, experts {o['experts_over_share']}x the host budget ({o['tokens']} tokens)", o,
            f"{o['ours_tok_s']:.2f} tok/s", "llama.cpp mmap (best of 2 runs)", f"{o['peer_tok_s']:.2f} tok/s",
            o["ratio"])
    b = rows["bandwidth"]
    lines.append(f"| bandwidth fraction (q4 decode, Q8_0 dense) | | {b['ours_fraction']:.0%} | llama.cpp | "
                 f"{b['llama_cpp_fraction']:.0%} | of {b['read_gbps']:.1f} GB/s read ({b['read_threads']} threads), "
                 f"{b['bytes_per_token'] / 2**20:.0f} MiB/token |")
    lines.append(f"| peak host memory | | {r['peak_host_bytes'] / 2**30:.2f} GiB | | | |")
    lines += ["", (f"agent replay: turns from {a['source']}, median prompt {a['median_prompt_tokens']:.0f} tokens "
                   f"of which {a['median_new_tokens']:.0f} new per turn; turn 0 (cold) ours "
                   f"{a['turn0_ours_ttft_s'] * 1e3:.0f} ms, llama.cpp {a['turn0_peer_ttft_s'] * 1e3:.0f} ms.")]
    if "skipped" not in o:
        lines.append(_budget_note(o))
    return "\n".join(lines)


def write_json(report: dict[str, Any], out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    return out


def options(p: Any) -> None:
    """``freetoken bench suite`` flags."""
    p.add_argument("--quick", action="store_true", help="every row at small sizes: 16 tokens, 3 rounds, 256-token prompt, 1 replayed session, a 0.33B over-budget model (2-4 min here)")
    p.add_argument("--threads", type=int, default=1, help="threads for every engine (default 1)")
    p.add_argument("--out", default=None, help="where the JSON goes (default $FREETOKEN_CACHE/bench/suite.json)")
    add_trajectories_arg(p)


def add_trajectories_arg(p: Any) -> None:
    """``--trajectories``: the suite's and the ``agent-replay`` row's."""
    p.add_argument("--trajectories", default=None, metavar="DIR",
                   help="recorded agent trajectories (*.traj.json) for the replay row, or 'synthetic' for the "
                        "built-in session (default: ../shared/data/agent-trajectories when present, else synthetic)")


def trajectories_from(value: str | None) -> Path | None:
    """The replay row's trajectory folder from ``--trajectories`` (None: the built-in synthetic session)."""
    from freetoken_agent.evals.perf.agent_replay import DEFAULT_TRAJECTORIES

    if value is None:
        return DEFAULT_TRAJECTORIES.resolve() if DEFAULT_TRAJECTORIES.is_dir() else None
    if value == "synthetic":
        return None
    folder = Path(value).expanduser()
    if not folder.is_dir():
        raise BenchError(f"--trajectories: no such folder: {folder}")
    if not any(folder.glob("*.traj.json")):
        raise BenchError(f"--trajectories: no *.traj.json files in {folder}")
    return folder


def require_llama_cpp() -> None:
    """A clear error when the llama.cpp peer (``llama-cpp-python``, ``gguf``) is not installed."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("gguf") is None:
        raise BenchError("this row needs the llama.cpp peer: pip install llama-cpp-python gguf")


def _headline(r: dict[str, Any]) -> dict[str, Any]:
    keys = ("cpu_decode_ratio_vs_llamacpp", "prefill_ratio_vs_llamacpp", "ttft_ratio_vs_llamacpp",
            "agent_replay_ttft_ratio_vs_llamacpp", "over_budget_decode_ratio_vs_llamacpp", "bandwidth_fraction",
            "cpu_decode_fp32_ratio_vs_transformers")
    return {k: r[k] for k in keys if r.get(k) is not None}


@row("suite", "every pairwise comparison in one run: decode, prefill, agent replay, over-budget decode, bandwidth "
     "fraction (ours vs llama.cpp and transformers)", options, format=lambda r, a: format_table(r), headline=_headline)
def suite_row(args: Any) -> dict[str, Any]:
    """Run the suite from parsed flags; the JSON also goes to ``--out``."""
    import sys

    if args.threads < 1:
        raise BenchError(f"--threads must be at least 1, got {args.threads}")
    trajectories = trajectories_from(args.trajectories)
    require_llama_cpp()
    report = run(bool(args.quick), args.threads, progress=lambda s: print(s, file=sys.stderr),
                 trajectories=trajectories)
    root = Path(os.environ.get("FREETOKEN_CACHE", Path.home() / ".cache" / "freetoken")) / "bench"
    out = write_json(report, Path(args.out) if args.out else root / "suite.json")
    print(f"JSON: {out}", file=sys.stderr)
    return report
