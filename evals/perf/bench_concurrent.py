"""Concurrent agent sessions against ``freetoken serve`` and llama.cpp's ``llama-server``, on the same weights.

N = 1, 2, 4, 8 recorded agent sessions (``concurrent_load``) replay turn by turn at once over ``/v1/completions``
(streaming, greedy, ``--max-tokens`` per request, the scaled tool pauses in between). Each server runs alone, as a
subprocess on 127.0.0.1, restarted for every N (so no run inherits another's prefix cache): ours as
``freetoken serve --model DIR --quant q4 --threads T``, the peer as ``llama-server --parallel N -c N*ctx -t T``.
Per N and server: aggregate generated tok/s over the wall time, p50/p99 time to first token, p50/p99 inter-token
latency; then ours/llama.cpp and each N's throughput over N=1.

Identical prompts: ours gets the prompt text and tokenizes it with the model's tokenizer; llama-server gets the
token ids that same tokenizer produced (its GGUF vocabulary is a filler list of the same size, see
``concurrent_model``) with ``ignore_eos``. Every reported ``usage.prompt_tokens`` is checked against the ids sent.
Ours stops at its end-of-sequence token; tok/s counts the tokens each server reports.

    python -m freetoken_agent.evals.perf.bench_concurrent build-peer          # llama-server, 15-40 min
    python -m freetoken_agent.evals.perf.bench_concurrent build-peer --python # + tools, llama-cpp-python on it
    python -m freetoken_agent.evals.perf.bench_concurrent prepare             # the 7.5B model + GGUF, once
    python -m freetoken_agent.evals.perf.bench_concurrent show REPORT.json      # the table of a --json run
    python -m freetoken_agent.evals.perf.bench_concurrent run [--n 1,2,4,8] [--servers ours,llama.cpp]
        [--turns 3] [--ctx 2048] [--max-tokens 32] [--max-message-chars 800] [--threads 2] [--speculate on] [--json]

Decode throughput alone (the sessions' first turns cut to a ~57-token prompt, 48 tokens each, no speculation on
either side, so N sessions differ from one only by batching):
``run --turns 1 --max-tokens 48 --max-message-chars 40 --speculate off``. The engine table's "decode tok/s" column
is then the aggregate decode throughput (decode-only steps' tokens over their time).

The defaults size one full run (both servers, N = 1, 2, 4, 8) to about half an hour on two Zen 4 cores. The
``load 1m`` column is the machine's load average before/after each measurement: other work on the same cores
skews a row (llama.cpp's spinning threads suffer more from it than ours).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from freetoken_agent.evals.perf import llama_server
from freetoken_agent.evals.perf.harness import row, run_json_main
from freetoken_agent.evals.perf.concurrent_load import Session, Turn, Workload, build_sessions, run_sessions, summarize

DEFAULT_DIR = Path("/tmp/freetoken-bench-concurrent")
_SHARED = Path("/work/shared/data/agent-trajectories")
_REPO_SHARED = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "agent-trajectories"
DEFAULT_TRAJECTORIES = _SHARED if _SHARED.is_dir() else _REPO_SHARED


@dataclass(frozen=True)
class Server:
    """One server under test: its command line for N sessions on a port, and a request body for a turn."""

    name: str
    command: Callable[[int, int], list[str]]
    """``(port, n) -> argv``."""
    body: Callable[[Turn, int], dict[str, Any]]
    """``(turn, max_tokens) -> JSON body`` of a streaming ``/v1/completions`` request."""
    stats_path: str | None = None
    """A route answering the engine's counters (ours: ``/stats``), read before and after the replay."""


def ours(model: str | None, threads: int, quant: str, quant_dense: str, speculate: str = "on") -> Server:
    def command(port: int, n: int) -> list[str]:
        argv = [sys.executable, "-m", "freetoken_agent.cli", "serve", "--port", str(port), "--threads", str(threads),
                "--quant", quant, "--quant-dense", quant_dense, "--speculate", speculate, "--name", "bench"]
        return argv + (["--model", model] if model else [])

    def body(turn: Turn, max_tokens: int) -> dict[str, Any]:
        return {"model": "bench", "prompt": turn.text, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}

    return Server("ours", command, body, "/stats")


def llama_cpp(binary: Path, gguf: Path, threads: int, ctx: int) -> Server:
    def command(port: int, n: int) -> list[str]:
        return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--parallel", str(n),
                "-c", str(n * ctx), "-t", str(threads), "-tb", str(threads), "--no-webui"]

    def body(turn: Turn, max_tokens: int) -> dict[str, Any]:
        return {"prompt": turn.ids, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                "ignore_eos": True, "cache_prompt": True, "stream_options": {"include_usage": True}}

    return Server("llama.cpp", command, body)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (it was started in its own session), SIGKILL after 15 s."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=15)


@contextlib.contextmanager
def running(argv: list[str], port: int, log: Path, startup_timeout_s: float) -> Iterator[str]:
    """Start ``argv`` and wait for ``GET /health`` to answer 200; yields the base URL; stops the server after."""
    import httpx

    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{argv[0]} exited with {proc.returncode} while starting; see {log}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{argv[0]} not healthy after {startup_timeout_s:.0f} s; see {log}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                    break
            time.sleep(1.0)
        yield base
    finally:
        _stop(proc)


@dataclass(frozen=True)
class RunConfig:
    """One measurement: which sessions, how long it may take."""

    workload: Workload
    request_timeout_s: float = 600.0
    deadline_s: float = 900.0
    """No session starts a turn later than this (seconds after the first request)."""
    startup_timeout_s: float = 900.0
    log_dir: Path = DEFAULT_DIR / "logs"


def measure(server: Server, n: int, sessions: list[Session], warmup: Turn, cfg: RunConfig) -> dict[str, Any]:
    """Start ``server`` for ``n`` sessions, warm it up with one short request, replay, summarize, stop it."""
    from freetoken_agent.evals.perf.concurrent_load import RequestResult, stream_request

    port = _free_port()
    load_before = os.getloadavg()[0]
    log = cfg.log_dir / f"{server.name}-n{n}.log"
    t0 = time.perf_counter()
    with running(server.command(port, n), port, log, cfg.startup_timeout_s) as base:
        startup_s = time.perf_counter() - t0
        url = f"{base}/v1/completions"

        async def go() -> tuple[Any, list[Any], float]:
            import httpx

            async with httpx.AsyncClient(timeout=cfg.request_timeout_s) as client:
                warm = await stream_request(client, url, server.body(warmup, 4), RequestResult(-1, 0, len(warmup.ids)))
                before = (await client.get(base + server.stats_path)).json() if server.stats_path else None
            results, wall = await run_sessions(url, sessions[:n], lambda t: server.body(t, cfg.workload.max_tokens),
                                               cfg.request_timeout_s, cfg.deadline_s)
            async with httpx.AsyncClient(timeout=cfg.request_timeout_s) as client:
                after = (await client.get(base + server.stats_path)).json() if server.stats_path else None
            return warm, results, wall, before, after

        warm, results, wall, before, after = asyncio.run(go())
    if warm.error:
        raise RuntimeError(f"{server.name}: the warm-up request failed: {warm.error}; see {log}")
    return {"server": server.name, "n": n, "startup_s": round(startup_s, 1), "load1_before": round(load_before, 2),
            "load1_after": round(os.getloadavg()[0], 2), **summarize(results, wall),
            "engine": engine_split(before, after, wall) if before is not None and after is not None else None}


def engine_split(before: dict[str, Any], after: dict[str, Any], wall_s: float) -> dict[str, Any]:
    """Where the engine's time went during a replay, from its counters before and after (``/stats``).

    ``decode_tok_s`` is the aggregate decode throughput proper: tokens of decode-only steps (every running sequence
    adds one token, or more with speculative decoding) over those steps' seconds, with ``rows`` the mean tokens per
    such step. Steps that prefill
    (a chunk of a new prompt, maybe with decode rows beside it) count as ``prefill_s``; ``idle_s`` is the wall time
    the engine had nothing to run (every session in a tool pause or between requests).
    """
    d = {k: after[k] - before[k] for k in ("prompt_tokens", "prefill_s", "decode_s", "decode_steps",
                                           "decode_step_tokens", "generated_tokens")}
    busy = d["prefill_s"] + d["decode_s"]
    return {"decode_tok_s": d["decode_step_tokens"] / d["decode_s"] if d["decode_s"] else None,
            "rows": d["decode_step_tokens"] / d["decode_steps"] if d["decode_steps"] else None,
            "prefill_tok_s": d["prompt_tokens"] / d["prefill_s"] if d["prefill_s"] else None,
            "prompt_tokens": d["prompt_tokens"], "prefill_s": round(d["prefill_s"], 2),
            "decode_s": round(d["decode_s"], 2), "idle_s": round(max(wall_s - busy, 0.0), 2),
            "prefill_share": d["prefill_s"] / busy if busy else None}


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """``vs_n1`` (tok/s over the same server's N=1) and ``ours_vs_llama`` (tok/s, ours over llama.cpp at that N)."""
    by = {(r["server"], r["n"]): r for r in rows}
    for r in rows:
        base = by.get((r["server"], 1))
        r["vs_n1"] = r["tok_s"] / base["tok_s"] if base and base["tok_s"] else None
        eng, base_eng = r.get("engine"), (base or {}).get("engine")
        if eng and base_eng and eng["decode_tok_s"] and base_eng["decode_tok_s"]:
            eng["decode_vs_n1"] = eng["decode_tok_s"] / base_eng["decode_tok_s"]
        if eng and base and base["tok_s"] and eng["prefill_s"]:
            # the wall can be no shorter than the prefill work alone: the most ``vs_n1`` could be at this N if
            # decode steps and pauses cost nothing (prefill on these cores is compute-bound: N sessions, N x work)
            eng["prefill_bound_vs_n1"] = r["tokens"] / eng["prefill_s"] / base["tok_s"]
        if r["server"] == "ours":
            peer = by.get(("llama.cpp", r["n"]))
            r["ours_vs_llama"] = r["tok_s"] / peer["tok_s"] if peer and peer["tok_s"] else None


def table(rows: list[dict[str, Any]], title: str) -> Any:
    from rich.table import Table

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.0f}"

    def x(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}x"

    t = Table(title=title)
    for col in ("N", "server", "tok/s", "vs N=1", "ours/llama", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
                "ITL p99 ms", "requests", "errors", "tokens", "wall s", "load 1m"):
        t.add_column(col, justify="right")
    for r in sorted(rows, key=lambda r: (r["n"], r["server"] != "ours")):
        t.add_row(str(r["n"]), r["server"], f"{r['tok_s']:.2f}", x(r.get("vs_n1")), x(r.get("ours_vs_llama")),
                  ms(r["ttft_p50_s"]), ms(r["ttft_p99_s"]), ms(r["itl_p50_s"]), ms(r["itl_p99_s"]),
                  str(r["requests"]), str(r["errors"]), str(r["tokens"]), f"{r['wall_s']:.0f}",
                  f"{r['load1_before']:.1f}/{r['load1_after']:.1f}")
    return t


def engine_table(rows: list[dict[str, Any]]) -> Any:
    """Ours only: the engine's own split of each replay (``engine_split``)."""
    from rich.table import Table

    def num(v: float | None, fmt: str = ".2f") -> str:
        return "-" if v is None else format(v, fmt)

    t = Table(title="engine time during the replay (ours, from /stats): decode-only steps vs steps that prefill")
    for col in ("N", "decode tok/s", "vs N=1", "tokens/decode step", "prefill tok/s", "prompt tokens", "prefill s",
                "decode s", "idle s", "prefill share of busy", "tok/s vs N=1 bound"):
        t.add_column(col, justify="right")
    for r in sorted((r for r in rows if r.get("engine")), key=lambda r: r["n"]):
        e = r["engine"]
        t.add_row(str(r["n"]), num(e["decode_tok_s"]), num(e.get("decode_vs_n1")) + ("x" if e.get("decode_vs_n1")
                  else ""), num(e["rows"]), num(e["prefill_tok_s"], ".1f"), str(e["prompt_tokens"]),
                  num(e["prefill_s"], ".1f"), num(e["decode_s"], ".1f"), num(e["idle_s"], ".1f"),
                  num(e["prefill_share"] and 100 * e["prefill_share"], ".0f") + "%",
                  num(e.get("prefill_bound_vs_n1")) + ("x" if e.get("prefill_bound_vs_n1") else ""))
    return t


def _tokenizer(folder: Path) -> tuple[Callable[[list[dict[str, str]]], str], Callable[[str], list[int]]]:
    """(render, encode) of the model folder's chat template and tokenizer."""
    from freetoken_agent.runtime.tokenizer.chat import ChatTemplate
    from freetoken_agent.runtime.tokenizer.tokenizer import Tokenizer

    tok, template = Tokenizer.from_pretrained(folder), ChatTemplate.from_pretrained(folder)
    if template is None:
        raise SystemExit(f"the model in {folder} has no chat template")
    return (lambda messages: template.render(messages, None, True)), tok.encode


def run(args: argparse.Namespace) -> int:
    from freetoken_agent.evals.perf.concurrent_model import prepare_model

    counts = sorted({int(n) for n in args.n.split(",")})
    names = args.servers.split(",")
    if args.model:
        from freetoken_agent.runtime.models import resolve_model

        folder, gguf = resolve_model(args.model), None
    else:
        folder, gguf = prepare_model(Path(args.dir) / "qwen3_moe-7b", dense=args.quant_dense, threads=args.threads)
    render, encode = _tokenizer(folder)
    w = Workload(turns=args.turns, ctx=args.ctx, max_tokens=args.max_tokens, max_message_chars=args.max_message_chars,
                 pause_scale=args.pause_scale, max_pause_s=args.max_pause)
    sessions = build_sessions(Path(args.trajectories), max(counts), w, render, encode)
    warmup_text = "Hello"
    warmup = Turn(warmup_text, encode(warmup_text), 0.0)
    servers = []
    if "ours" in names:
        servers.append(ours(str(folder), args.threads, args.quant, args.quant_dense, args.speculate))
    if "llama.cpp" in names:
        binary = llama_server.find_peer(Path(args.peer_cache))
        if binary is None:
            print(f"skipping llama.cpp: {llama_server.why_missing(Path(args.peer_cache))}", file=sys.stderr)
        elif gguf is None:
            print("skipping llama.cpp: --model has no GGUF twin (only the default synthetic model has one)",
                  file=sys.stderr)
        else:
            servers.append(llama_cpp(binary, gguf, args.threads, args.ctx))
    cfg = RunConfig(w, args.request_timeout, args.deadline, args.startup_timeout, Path(args.dir) / "logs")
    from freetoken_agent.evals.perf.bench_gguf_decode import param_count

    meta = {"model": str(folder), "params": param_count(folder), "sessions": [s.name for s in sessions],
            "prompt_tokens_per_turn": [[len(t.ids) for t in s.turns] for s in sessions], "workload": vars(w),
            "threads": args.threads, "quant": args.quant, "quant_dense": args.quant_dense, "speculate": args.speculate}
    rows: list[dict[str, Any]] = []
    partial = Path(args.dir) / "last-run.json"  # rewritten after every measurement: a cut-short run keeps its rows
    for n in counts:  # servers alternate within each N, so load from elsewhere on the machine hits both alike
        for server in servers:
            print(f"{server.name}: N={n} ...", file=sys.stderr, flush=True)
            rows.append(measure(server, n, sessions, warmup, cfg))
            r = rows[-1]
            print(f"  {r['tok_s']:.2f} tok/s, {r['requests']} requests, {r['errors']} errors, {r['wall_s']} s",
                  file=sys.stderr, flush=True)
            add_ratios(rows)
            partial.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    if args.json:
        print(json.dumps({"meta": meta, "rows": rows}, indent=1))
        return 0
    show(meta, rows)
    return 0


def show(meta: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """The table of a run (``run``'s own, or ``show FILE`` of a ``--json`` report)."""
    from rich.console import Console

    w = meta["workload"]
    title = (f"{len(meta['sessions'])} agent sessions x {w['turns']} turns, {w['max_tokens']} tokens/request, "
             f"{meta['params'] / 1e9:.2f}B params, {meta['threads']} threads")
    console = Console(width=160)
    console.print(table(rows, title))
    if any(r.get("engine") for r in rows):
        console.print(engine_table(rows))
    for r in rows:
        if r["first_error"] or r["prompt_token_mismatches"]:
            print(f"{r['server']} N={r['n']}: first error {r['first_error']!r}, "
                  f"{r['prompt_token_mismatches']} prompt-token mismatches", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build-peer", help="build llama-server from the llama-cpp-python sdist (PyPI)")
    b.add_argument("--cache", default=str(llama_server.DEFAULT_CACHE))
    b.add_argument("--version", default=llama_server.DEFAULT_VERSION, help="llama-cpp-python sdist version")
    b.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    b.add_argument("--python", action="store_true",
                   help="also llama-quantize, llama-bench and llama-cpp-python bound to this build (see llama_server)")
    p = sub.add_parser("prepare", help="write the 7.5B checkpoint, its GGUF and our expert cache file")
    sh = sub.add_parser("show", help="print the table of a saved --json report (or DIR/last-run.json)")
    sh.add_argument("report", type=Path)
    r = sub.add_parser("run", help="the benchmark")
    for q in (p, r):
        q.add_argument("--dir", default=str(DEFAULT_DIR), help="where the model, GGUF and server logs live")
        q.add_argument("--threads", type=int, default=2)
        q.add_argument("--quant-dense", default="none", choices=("none", "q8", "q4"),
                       help="dense weights on both sides: none = fp32 / F32, else the same Q8_0 / Q4_0 blocks")
    r.add_argument("--model", default=None,
                   help="serve this folder ('builtin', 'synthetic:ARCH') instead of the 7.5B model; ours only")
    r.add_argument("--trajectories", default=str(DEFAULT_TRAJECTORIES))
    r.add_argument("--servers", default="ours,llama.cpp")
    r.add_argument("--n", default="1,2,4,8", help="comma-separated concurrent session counts")
    r.add_argument("--turns", type=int, default=3, help="turns per session")
    r.add_argument("--ctx", type=int, default=2048, help="context per session (tokens)")
    r.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request")
    r.add_argument("--max-message-chars", type=int, default=800, help="each message's content is cut to this")
    r.add_argument("--pause-scale", type=float, default=0.05, help="recorded tool pauses are scaled by this")
    r.add_argument("--max-pause", type=float, default=2.0, help="... and capped at this many seconds")
    r.add_argument("--quant", default="q4", choices=("none", "q8", "q4"), help="our expert format")
    r.add_argument("--speculate", default="on", help="our server's --speculate (on|off|K); llama-server runs none")
    r.add_argument("--peer-cache", default=str(llama_server.DEFAULT_CACHE))
    r.add_argument("--request-timeout", type=float, default=600.0)
    r.add_argument("--deadline", type=float, default=420.0, help="no turn starts later than this (s) into a run")
    r.add_argument("--startup-timeout", type=float, default=900.0)
    r.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.cmd == "build-peer":
        print(llama_server.build_peer(Path(args.cache), args.version, args.jobs))
        if args.python:
            print(llama_server.install_binding(Path(args.cache), args.version, args.jobs))
        return 0
    if args.cmd == "show":
        try:
            report = json.loads(args.report.read_text())
            meta, rows = report["meta"], report["rows"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SystemExit(f"{args.report}: not a bench_concurrent --json report ({exc.__class__.__name__}: {exc})")
        show(meta, rows)
        return 0
    if args.cmd == "prepare":
        from freetoken_agent.evals.perf.concurrent_model import prepare_model

        folder, gguf = prepare_model(Path(args.dir) / "qwen3_moe-7b", dense=args.quant_dense, threads=args.threads)
        print(folder, gguf)
        return 0
    return run(args)


def _serve_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--peer", default="llama.cpp", choices=("llama.cpp", "none"),
                   help="llama.cpp: llama-server on the same weights beside ours; none: ours alone")
    p.add_argument("--model", default=None, help="serve this folder instead of the 7.5B model (ours only)")


def _serve_table(report: dict[str, Any]) -> str:
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        show(report["meta"], report["rows"])
    return out.getvalue()


@row("serve", "N concurrent agent sessions over HTTP: freetoken serve vs llama-server on the same weights (tok/s, "
     "TTFT, inter-token latency); other flags are `bench_concurrent run`'s", _serve_options, passthrough=True,
     format=lambda r, a: _serve_table(r))
def serve_row(args: argparse.Namespace) -> dict[str, Any]:
    argv = ["run", *args.passthrough, "--servers", "ours,llama.cpp" if args.peer == "llama.cpp" else "ours"]
    return run_json_main(main, argv + (["--model", args.model] if args.model else []))


if __name__ == "__main__":
    raise SystemExit(main())
