"""Row ``agent-session``: recorded agent sessions end to end under a memory budget, ours vs ``llama-server``.

    freetoken bench agent-session [--model DIR|tiny] [--trajectories DIR|synthetic] [--sessions 1] [--turns 4]
        [--max-prompt 3072] [--max-reply 64] [--host-memory 2.5GB] [--peer llama.cpp|none] [--phase both|on|off]
        [--peer-cap ours|SIZE] [--json]                   (also python -m freetoken_agent.evals.perf.agent_session)

The workload: each recorded session (mini-swe-agent ``*.traj.json`` from ``--trajectories``, else a synthetic coding
session, so the row runs on any clone) becomes a conversation replayed turn by turn. A turn's prompt is the whole
history so far (system prompt, task, earlier replies and tool outputs); the model generates exactly as many tokens as
the recorded reply has under the model's tokenizer (at most ``--max-reply``; end-of-sequence banned), and the recorded
reply — not the random model's text — goes into the history, so every later prompt is the recorded conversation. The
tool then "runs" for the recorded gap to the next response (the frontier model's latency plus the tool's run) times
``--pause-scale``, at most ``--max-pause`` seconds, and returns the recorded output. Messages are cut to
``--max-message-chars``; a session ends before the turn whose prompt plus reply would pass ``--max-prompt`` tokens.

Ours: the SDK's ``Agent`` (``freetoken_agent.agent``), its real loop, over ``LocalEngine`` on an engine loaded with
``--host-memory`` as its host budget (q4 experts; those that do not fit stay in the expert cache file on disk, read
through the residency path with each read's pages dropped from the page cache, so "disk" is the disk). The loop
announces phases to the engine as in any agent run: ``plan`` before each model call, ``code`` when the reply opens a
code block, ``tool`` (with ``run_shell``'s declared duration) before the tool runs, and the start of the next prompt
for KV pre-staging. Between the loop and the engine sits ``ReplayBackend``: it passes each request to the engine with
the forced length and hands the loop the recorded reply's text as the tokens arrive (the code block opens at its
recorded token), then the recorded ``run_shell`` call. The replayed tool is ``run_shell``'s schema and duration with
the recorded pause and output. Phase on/off: the residency policy ``phase`` (``LocalEngine`` attaches the
``PhaseScheduler``; what ``freetoken run`` uses under a budget) against ``lru`` (phase-agnostic; same hints, KV
handling and budget). The phase profile starts empty in each invocation and learns over its sessions in order.
Context speculation is off by default (``--speculate``): greedy loops of random weights let drafts accept at rates
no real model gives.

Peer: llama.cpp's ``llama-server`` (``llama_server.find_peer``) on the same weights (the GGUF twin of
``concurrent_model``: our Q4_0 expert blocks byte for byte, the same dense weights; its vocabulary is a filler list,
so it is sent the token ids our engine prefilled, checked against its reported prompt tokens), one slot, prompt cache
on (``cache_prompt``), ``--load-mode mmap --no-repack`` (repacking copies the weights into anonymous memory the size
of the model, which no cap below the model survives), ``ignore_eos`` with the same token counts, the same pauses.
Its memory: a cgroup (it counts RSS and page cache, the mmap's pages included) capped at ``--peer-cap``, by default
the peak resident memory of our whole process in the same session (ours runs first; interpreter, torch, KV and
buffers included, measured after the load), so the peer never has less memory than we used; made where this machine
allows (v2 ``memory.max``, else v1 ``memory.limit_in_bytes``), else no cap and the report says so (the model's size
is then the only limit on what its mmap keeps). Our ``--host-memory`` holds our dense weights, expert slots and KV
cache (the KV pool takes its pages from the slots); our process's peak is reported beside it. The GGUF's pages are
dropped from the page cache before the server starts; the disk's ``read_ahead_kb`` (how much each mmap page fault
reads) is recorded.

Per session and side: wall time (first request to last token, pauses included), time to first token per turn,
decode tok/s (tokens after the first over the time from the first to the last), bytes read from disk (ours: the
expert store's disk counter and ``/proc/self/io``; the peer: ``/proc/<pid>/io`` ``read_bytes``) and peak memory (our
process's VmHWM, the peer's cgroup peak). Sessions run one after another; within a session ours goes first (it
records the prompt ids), the peer second, the other phase variant last, the variants' order flipping every session.
The defaults (one session of 4 turns, replies of at most 64 tokens, both variants and the peer on the 7.5B model of
``bench_concurrent prepare`` under 2.5 GB) take about ten minutes on two cores: under that budget each turn's
prefill costs ours ~25-30 s (a prefill chunk reads most experts from disk) and decode runs at 2-4 tok/s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import random
import re
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from freetoken_agent.evals.perf.harness import BenchError, module_main, row
from freetoken_agent.evals.perf.timing import DecodeTiming

DEFAULT_DIR = Path("/tmp/freetoken-bench-concurrent")
TINY_CONFIG_OVERRIDES: dict[str, Any] = dict(
    hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=64, num_experts=64, num_experts_per_tok=4, moe_intermediate_size=256, eos_token_id=2,
)  # fmt: skip
"""``--model tiny``: the 7.5B benchmark's architecture shrunk to 2 layers of 64 experts (18 MB of dense weights,
14 MB of q4 experts; seconds to write)."""
SIDES = ("ours_phase", "ours_lru", "llama.cpp")
LABELS = {"ours_phase": "ours, phase on", "ours_lru": "ours, phase off (lru)", "llama.cpp": "llama.cpp llama-server"}
BAN = -1e4
"""Logit bias that keeps end-of-sequence tokens from ever being picked (the forced length)."""


# ------------------------------------------------------------------------------------------------------ workload
@dataclass(frozen=True)
class Workload:
    """How recorded sessions become replayed ones."""

    sessions: int = 1
    turns: int = 4
    """Assistant turns per session, at most."""
    max_prompt: int = 3072
    """A session ends before the turn whose prompt plus reply would pass this many tokens."""
    max_reply: int = 64
    """Tokens generated per turn, at most (the recorded reply's length when shorter)."""
    max_message_chars: int = 2000
    """The task and each tool output are cut to this many characters."""
    pause_scale: float = 0.5
    max_pause_s: float = 5.0


@dataclass(frozen=True)
class Turn:
    """One model call of a recorded session and the tool run after it."""

    reply_ids: list[int]
    """The recorded reply's tokens (cut to ``max_reply``): how many tokens both sides generate."""
    cuts: list[int]
    """``cuts[n]``: characters of ``reply`` that the first ``n`` tokens decode to (whole characters only)."""
    reply: str
    """What goes into the history: the text of ``reply_ids``."""
    command: str | None
    """The recorded shell command (the tool call after the reply); None for the session's last reply."""
    output: str
    """The recorded tool output."""
    pause_s: float
    """How long the tool runs: the recorded gap to the next response, scaled and capped."""


@dataclass(frozen=True)
class Session:
    name: str
    system: str
    task: str
    turns: list[Turn]


_COMMAND = re.compile(r"```(?:bash|sh)?[ \t]*\n(.*?)\n?```", re.S)


def make_turn(reply: str, output: str, gap_s: float, last: bool, w: Workload, encode: Callable[[str], list[int]],
              decode: Callable[[list[int]], str]) -> Turn:
    found = _COMMAND.search(reply)  # the recorded call, also when the reply is cut before it
    ids = encode(reply)
    if len(ids) > w.max_reply:
        ids = ids[: w.max_reply]
        reply = decode(ids)
    cuts, base = [0], 0  # tokens ids[:base] decode to reply[:cuts[base]]; decode on from there (linear time)
    for n in range(1, len(ids) + 1):
        text = decode(ids[base:n])
        whole = reply.startswith(text, cuts[base]) and not text.endswith("\ufffd")  # not inside a character
        cuts.append(cuts[base] + len(text) if whole else cuts[-1])
        base = n if whole else base
    cuts[-1] = len(reply)
    command = None if last else (found.group(1).strip() if found else "")
    return Turn(ids, cuts, reply, command, output, round(min(max(gap_s, 0.0) * w.pause_scale, w.max_pause_s), 3))


def build_session(name: str, messages: list[dict[str, str]], gaps_s: list[float], w: Workload,
                  encode: Callable[[str], list[int]], decode: Callable[[list[int]], str]) -> Session | None:
    """``messages`` (system, task, then assistant / tool-output pairs) as a session of at most ``w.turns`` turns
    whose prompts (estimated from the contents; the backend checks the rendered ones) fit ``w.max_prompt``.
    ``gaps_s[k]``: seconds from the k-th recorded response to the next. None when fewer than 2 turns fit."""
    from freetoken_agent.evals.perf.concurrent_load import TRUNCATED

    cut = lambda text: text if len(text) <= w.max_message_chars else text[: w.max_message_chars] + TRUNCATED
    if len(messages) < 3 or messages[0]["role"] != "system" or messages[1]["role"] != "user":
        return None
    system, task = messages[0]["content"], cut(messages[1]["content"])
    pairs = []
    for i, m in enumerate(messages[2:], 2):
        if m["role"] == "assistant":
            after = messages[i + 1] if i + 1 < len(messages) and messages[i + 1]["role"] != "assistant" else None
            pairs.append((m["content"], cut(after["content"]) if after else ""))
    used = len(encode(system)) + len(encode(task)) + 256  # the chat framing and the tool's schema
    kept: list[tuple[str, str, int]] = []
    for reply, output in pairs[: w.turns]:
        n = min(len(encode(reply)), w.max_reply)
        if used + n > w.max_prompt:
            break
        kept.append((reply, output, n))
        used += n + len(encode(output)) + 32
    if len(kept) < 2:
        return None
    turns = [make_turn(reply, output, gaps_s[k] if k < len(gaps_s) else 0.0, k == len(kept) - 1, w, encode, decode)
             for k, (reply, output, _) in enumerate(kept)]
    return Session(name, system, task, turns)


def synthetic_gaps(turns: int, seed: int = 0) -> list[float]:
    """Recorded-looking gaps for the synthetic session: 2-12 s (the recorded sessions' median is 4 s)."""
    rng = random.Random(seed)
    return [round(rng.uniform(2.0, 12.0), 1) for _ in range(turns)]


def load_workload(folder: Path | None, w: Workload, encode: Callable[[str], list[int]],
                  decode: Callable[[list[int]], str]) -> tuple[str, list[Session]]:
    """(source, sessions): the first ``w.sessions`` trajectories of ``folder`` (file-name order) with at least two
    turns that fit, or the synthetic session when ``folder`` is None."""
    if folder is None:
        from freetoken_agent.evals.perf.suite_replay import synthetic_session

        s = build_session("synthetic", synthetic_session(w.turns), synthetic_gaps(w.turns), w, encode, decode)
        return "synthetic", [s] if s else []
    from freetoken_agent.evals.perf.agent_replay import load_sessions
    from freetoken_agent.evals.perf.concurrent_load import response_times

    out = []
    for name, messages in load_sessions(folder, 10_000):
        times = response_times(folder / f"{name}.traj.json")
        gaps = [b - a if a and b else 0.0 for a, b in zip(times, times[1:])]
        s = build_session(name, messages, gaps, w, encode, decode)
        if s is not None:
            out.append(s)
        if len(out) == w.sessions:
            break
    return str(folder), out


# ------------------------------------------------------------------------------------------------------ ours
@dataclass
class TurnRun:
    """One turn as one side ran it (``perf_counter`` seconds)."""

    prompt_tokens: int
    generated: int
    ttft_s: float
    decode: DecodeTiming
    start: float
    end: float


@dataclass
class ReplayBackend:
    """A backend for the agent loop over ``LocalEngine``: each model call runs on the engine for exactly the
    recorded reply's token count, and the loop is handed the recorded reply (as the tokens arrive) and its
    ``run_shell`` call. Phase hints, KV pre-staging and session ends go to the engine unchanged."""

    inner: Any
    session: Session
    max_prompt: int
    runs: list[TurnRun] = field(default_factory=list)
    prompts: list[list[int]] = field(default_factory=list)
    """The token ids of each turn's prompt (what the peer is sent)."""
    refused: str | None = None
    """Why the session ended before its last turn (a prompt past ``max_prompt``), or None."""
    probe: Callable[[], tuple[int, ...]] = lambda: ()
    """Counters read when the first turn starts and after every turn (``probes``: the first and the latest)."""
    probes: list[tuple[int, ...]] = field(default_factory=list)

    async def generate(self, request: Any) -> AsyncIterator[Any]:
        from freetoken_agent.backends.base import GenerationDone
        from freetoken_agent.chat import TextDelta, ToolCallFinished

        k = len(self.runs)
        engine = self.inner.engine
        ids = engine.tokenizer.encode(self.inner.render(request))
        if k >= len(self.session.turns) or len(ids) + len(self.session.turns[k].reply_ids) > self.max_prompt:
            if k < len(self.session.turns):
                self.refused = f"turn {k}: prompt {len(ids)} + reply {len(self.session.turns[k].reply_ids)} tokens"
            yield GenerationDone("stop")  # no text, no call: the agent's run ends
            return
        turn = self.session.turns[k]
        ban = {e: BAN for e in engine.eos_token_ids}
        forced = replace(request, max_tokens=len(turn.reply_ids), stop=(), logit_bias=ban)
        if k == 0:
            self.probes[:] = [self.probe()]
        stamps: list[float] = []
        emitted, done = 0, GenerationDone("length")
        start = time.perf_counter()
        async for item in self.inner.stream_text(forced):
            if isinstance(item, GenerationDone):
                done = item
                continue
            now = time.perf_counter()
            stamps += [now] * item.tokens
            upto = turn.cuts[min(len(stamps), len(turn.reply_ids))]
            if upto > emitted:
                yield TextDelta(turn.reply[emitted:upto])
                emitted = upto
        end = time.perf_counter()
        if emitted < len(turn.reply):
            yield TextDelta(turn.reply[emitted:])
        self.prompts.append(ids)
        self.runs.append(TurnRun(len(ids), done.usage.completion_tokens, (stamps[0] if stamps else end) - start,
                                 DecodeTiming.from_stamps(stamps), start, stamps[-1] if stamps else end))
        self.probes[1:] = [self.probe()]
        if turn.command is not None:
            yield ToolCallFinished(0, "run_shell", {"command": turn.command})
        yield GenerationDone("tool_calls" if turn.command is not None else "stop", done.usage)

    def tool(self) -> Any:
        """``run_shell`` as the replay runs it: its description and declared duration, the recorded pause and
        output of the turn whose call it is."""
        import anyio
        from freetoken_agent.tools import Tool
        from freetoken_agent.tools.shell import run_shell as real

        async def run_shell(command: str) -> str:
            turn = self.session.turns[len(self.runs) - 1]
            await anyio.sleep(turn.pause_s)
            return turn.output

        return Tool(run_shell, name="run_shell", description=real.description, kind="execute", writes=True,
                    expected_s=real.expected_s)

    def hint(self, phase: Any, expected_s: float | None = None, session: str | None = None) -> None:
        self.inner.hint(phase, expected_s, session=session)

    def expect_prompt(self, session: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> None:
        self.inner.expect_prompt(session, messages, tools)

    def end_session(self, session: str) -> None:
        self.inner.end_session(session)

    def stats(self) -> dict[str, Any] | None:
        return self.inner.stats()


@dataclass(frozen=True)
class OursConfig:
    folder: Path
    host_bytes: int
    threads: int
    quant_dense: str
    speculate: bool | int
    profile: Path
    """The phase profile file (phase on): loaded at the start of each run, saved at its end."""


def io_read_bytes(pid: int | str = "self") -> int | None:
    """``read_bytes`` of ``/proc/<pid>/io`` (bytes the process caused to be read from storage), None if unreadable."""
    try:
        for line in Path(f"/proc/{pid}/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def drop_page_cache(path: Path) -> None:
    """Tell the OS to drop ``path``'s cached pages, so the next reads of it come from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_ahead_kb(path: Path) -> int | None:
    """The read-ahead of the block device holding ``path`` (``queue/read_ahead_kb``; None where unknown)."""
    st = os.stat(path)
    base = Path("/sys/dev/block") / f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    for queue in (base / "queue", base / ".." / "queue"):  # a disk, or a partition of one
        with contextlib.suppress(OSError, ValueError):
            return int((queue / "read_ahead_kb").read_text())
    return None


def _status_bytes(key: str) -> int | None:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return None


def run_ours(cfg: OursConfig, session: Session, phase: bool, max_prompt: int) -> dict[str, Any]:
    """One session through a fresh budgeted engine and the SDK's ``Agent``; the side's report plus ``prompts``."""
    import anyio
    from freetoken_agent.agent import Agent, Limits
    from freetoken_agent.backends.local import LocalEngine
    from freetoken_agent.runtime.engine import Engine
    from freetoken_agent.runtime.experts.phase import PhaseScheduler
    from freetoken_agent.runtime.experts.phase_profiles import PhaseProfiles
    from freetoken_agent.runtime.experts.setup import ResidencyConfig
    from freetoken_agent.runtime.memory import Budget, bound_heap

    gc.collect()
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # peak RSS from here (VmHWM)
    t0 = time.perf_counter()
    engine = Engine.from_pretrained(cfg.folder, quant="q4", dense_quant=cfg.quant_dense, threads=cfg.threads,
                                    speculate=cfg.speculate, require_tokenizer=True, budget=Budget(host=cfg.host_bytes),
                                    residency=ResidencyConfig(policy="phase" if phase else "lru", drop_page_cache=True))
    load_s, load_peak = time.perf_counter() - t0, _status_bytes("VmHWM")
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # the session's own peak from here
    try:
        store = engine.residency
        if phase:
            moe = [i for i, layer in enumerate(engine.spec.layers) if layer.moe is not None]
            profiles = PhaseProfiles.load(cfg.profile, moe, engine.spec.layers[moe[0]].moe.num_experts)
            PhaseScheduler.attach(engine, profiles, save_path=cfg.profile)
        drop_page_cache(Path(store.disk.path))
        backend = ReplayBackend(LocalEngine(engine, phase_scheduling=phase), session, max_prompt)
        backend.probe = lambda: (store.counters["disk"].bytes_in, io_read_bytes() or 0)
        agent = Agent(backend=backend, tools=[backend.tool()], instructions=session.system,
                      limits=Limits(max_steps=len(session.turns) + 2, max_tokens_per_step=10**6))
        result = anyio.run(agent.run, session.task)
        if result.stop_reason != "done":
            raise BenchError(f"ours ({'phase' if phase else 'lru'}), session {session.name}: the agent run ended "
                             f"with {result.stop_reason}: {result.error}")
        stats = engine.stats()
        (disk0, io0), (disk1, io1) = backend.probes[0], backend.probes[-1]
        host = stats["residency"]["tiers"]["host"]
        out = summarize(backend.runs, {
            "load_s": round(load_s, 2), "disk_read_bytes": disk1 - disk0, "io_read_bytes": io1 - io0,
            "peak_memory_bytes": _status_bytes("VmHWM"), "load_peak_memory_bytes": load_peak,
            "policy": stats["residency"]["policy"],
            "host_slots": host["slots"], "experts": sum(layer.moe.num_experts for layer in engine.spec.layers
                                                        if layer.moe is not None),
            "host_hit_rate": host.get("hit_rate"), "host_peak_bytes": host["peak"],
            "phase_hints": stats["phase_hints"], "phase_scheduler": stats["phase"]["scheduler"],
            "stall_s": stats["residency"]["stall_s"], "refused": backend.refused,
        })
        out["prompts"] = backend.prompts
        return out
    finally:
        engine.close()
        if engine.residency is not None:
            engine.residency.close()
        del engine
        gc.collect()
        bound_heap()  # what the engine held goes back to the OS before the next side runs


def summarize(runs: list[TurnRun], extra: dict[str, Any]) -> dict[str, Any]:
    """A side's session: wall time, the pauses in it, TTFT per turn, decode tok/s, tokens."""
    if not runs:
        raise BenchError("a side ran no turn")
    decode = sum((r.decode for r in runs), DecodeTiming(0, 0.0))
    pauses = [b.start - a.end for a, b in zip(runs, runs[1:])]
    return {
        "wall_s": round(runs[-1].end - runs[0].start, 3), "pauses_s": round(sum(pauses), 3),
        "gaps_s": [round(p, 3) for p in pauses], "ttft_s": [round(r.ttft_s, 4) for r in runs],
        "ttft_median_s": round(statistics.median(r.ttft_s for r in runs), 4),
        "decode_tokens": decode.tokens, "decode_s": round(decode.seconds, 4),
        "decode_tok_s": round(decode.tok_s, 3) if decode.tok_s else None,
        "prompt_tokens": [r.prompt_tokens for r in runs], "generated": [r.generated for r in runs], **extra,
    }  # fmt: skip


# ------------------------------------------------------------------------------------------------------ peer
@dataclass(frozen=True)
class Cap:
    """A memory cgroup made for one process."""

    group: Path
    limit: int
    peak_file: str
    how: str

    def peak(self) -> int | None:
        with contextlib.suppress(OSError, ValueError):
            return int((self.group / self.peak_file).read_text())
        return None


@contextlib.contextmanager
def memory_cgroup(limit: int, name: str) -> Iterator[Cap | str]:
    """A fresh cgroup capped at ``limit`` bytes (RSS and page cache), removed afterwards; or, where none can be
    made, the reason why (a string)."""
    root = Path("/sys/fs/cgroup")
    kinds = []
    with contextlib.suppress(OSError):
        if "memory" in (root / "cgroup.controllers").read_text().split():
            kinds.append((root, "memory.max", "memory.peak", "cgroup v2 memory.max"))
    if (root / "memory" / "memory.limit_in_bytes").exists():
        kinds.append((root / "memory", "memory.limit_in_bytes", "memory.max_usage_in_bytes",
                      "cgroup v1 memory.limit_in_bytes"))
    why = "no memory controller under /sys/fs/cgroup"
    cap = None
    for base, limit_file, peak_file, how in kinds:
        group = base / f"{name}-{os.getpid()}"
        try:
            group.mkdir()
            (group / limit_file).write_text(str(limit))
            cap = Cap(group, limit, peak_file, how)
            break
        except OSError as exc:
            why = f"{how}: {exc.strerror or exc}"
            with contextlib.suppress(OSError):
                group.rmdir()
    if cap is None:
        yield why
        return
    try:
        yield cap
    finally:
        for _ in range(50):  # the process has been stopped; its exit may still be under way
            try:
                cap.group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class PeerConfig:
    binary: Path
    gguf: Path
    threads: int
    log_dir: Path
    request_timeout_s: float = 900.0
    startup_timeout_s: float = 900.0


def run_peer(cfg: PeerConfig, session: Session, prompts: list[list[int]], max_prompt: int,
             cap_bytes: int) -> dict[str, Any]:
    """The turns ours played, replayed against ``llama-server`` in a cgroup of ``cap_bytes``: the same prompt ids,
    token counts and pauses."""
    from freetoken_agent.evals.perf.bench_concurrent import running

    drop_page_cache(cfg.gguf)
    port = _free_port()
    cfg.log_dir.mkdir(parents=True, exist_ok=True)
    pidfile = cfg.log_dir / f"llama-server-{port}.pid"
    argv = [str(cfg.binary), "-m", str(cfg.gguf), "--host", "127.0.0.1", "--port", str(port), "--parallel", "1",
            "-c", str(max_prompt + 64), "-t", str(cfg.threads), "-tb", str(cfg.threads), "--no-webui",
            "--load-mode", "mmap", "--no-repack"]  # fmt: skip
    with memory_cgroup(cap_bytes, "freetoken-agent-session") as cap:
        procs = str(cap.group / "cgroup.procs") if isinstance(cap, Cap) else ""
        # the shell enters the cgroup and records its pid, then becomes the server (same pid)
        script = 'echo $$ > "$1" && { [ -z "$2" ] || echo $$ > "$2"; } && shift 2 && exec "$@"'
        wrapped = ["sh", "-c", script, "sh", str(pidfile), procs, *argv]
        with running(wrapped, port, cfg.log_dir / f"llama-server-{session.name}.log", cfg.startup_timeout_s) as base:
            pid = int(pidfile.read_text())
            io0 = io_read_bytes(pid)
            runs, mismatched = asyncio.run(_play(f"{base}/v1/completions", session, prompts, cfg.request_timeout_s))
            io1 = io_read_bytes(pid)
        pidfile.unlink(missing_ok=True)
        peak = cap.peak() if isinstance(cap, Cap) else None
    limit = ({"memory_limit_bytes": cap.limit, "memory_limit": cap.how} if isinstance(cap, Cap)
             else {"memory_limit_bytes": None, "memory_limit": f"none ({cap}); the model's size bounds its mmap"})
    return summarize(runs, {"disk_read_bytes": None if io0 is None or io1 is None else io1 - io0,
                            "io_read_bytes": None if io0 is None or io1 is None else io1 - io0,
                            "peak_memory_bytes": peak, "prompt_token_mismatches": mismatched, **limit})


async def _play(url: str, session: Session, prompts: list[list[int]], timeout_s: float) -> tuple[list[TurnRun], int]:
    import httpx

    from freetoken_agent.evals.perf.concurrent_load import RequestResult, stream_request

    runs, mismatched = [], 0
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s)) as client:
        for k, ids in enumerate(prompts):
            if k:
                await asyncio.sleep(session.turns[k - 1].pause_s)
            n = len(session.turns[k].reply_ids)
            body = {"prompt": ids, "max_tokens": n, "temperature": 0.0, "stream": True, "ignore_eos": True,
                    "cache_prompt": True, "stream_options": {"include_usage": True}}
            r = await stream_request(client, url, body, RequestResult(0, k, len(ids)))
            if r.error:
                raise BenchError(f"llama-server, session {session.name} turn {k}: {r.error}")
            mismatched += r.prompt_tokens is not None and r.prompt_tokens != len(ids)
            first = r.start + (r.ttft_s if r.ttft_s is not None else r.end - r.start)
            runs.append(TurnRun(r.prompt_tokens or len(ids), r.tokens, first - r.start,
                                DecodeTiming(max(0, r.chunks - 1), sum(r.gaps_s)), r.start, first + sum(r.gaps_s)))
    return runs, mismatched


# ------------------------------------------------------------------------------------------------------ the row
def options(p: argparse.ArgumentParser) -> None:
    from freetoken_agent.cli.budget import speculate_flag
    from freetoken_agent.evals.perf import llama_server

    d = Workload()
    p.add_argument("--model", default=None, help="a qwen3_moe folder, or 'tiny' (written under --dir); default: the "
                   "7.5B model of `bench_concurrent prepare` in --dir")
    p.add_argument("--dir", default=str(DEFAULT_DIR), help="where the benchmark models and server logs live")
    p.add_argument("--trajectories", default=None, metavar="DIR",
                   help="recorded sessions (*.traj.json), or 'synthetic' (default: ../shared/data/agent-trajectories "
                        "when present, else synthetic)")
    p.add_argument("--sessions", type=int, default=d.sessions)
    p.add_argument("--turns", type=int, default=d.turns, help="assistant turns per session, at most")
    p.add_argument("--max-prompt", type=int, default=d.max_prompt, help="longest prompt plus reply, in tokens")
    p.add_argument("--max-reply", type=int, default=d.max_reply, help="tokens generated per turn, at most")
    p.add_argument("--max-message-chars", type=int, default=d.max_message_chars)
    p.add_argument("--pause-scale", type=float, default=d.pause_scale, help="recorded tool pauses are scaled by this")
    p.add_argument("--max-pause", type=float, default=d.max_pause_s, help="... and capped at this many seconds")
    p.add_argument("--host-memory", default="2.5GB", metavar="SIZE",
                   help="our host budget (dense weights + expert slots); experts beyond it stay on disk")
    p.add_argument("--peer", default="llama.cpp", choices=("llama.cpp", "none"))
    p.add_argument("--peer-cap", default="ours", metavar="ours|SIZE",
                   help="the peer's cgroup memory cap: ours = our process's peak in the same session (default)")
    p.add_argument("--peer-cache", default=str(llama_server.DEFAULT_CACHE), help="where build-peer put llama-server")
    p.add_argument("--phase", default="both", choices=("both", "on", "off"),
                   help="ours with phase-aware residency (on), lru (off), or both")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quant-dense", default="none", choices=("none", "q8", "q4"),
                   help="dense weights on both sides: F32, or the same Q8_0 / Q4_0 blocks")
    p.add_argument("--speculate", default=False, type=speculate_flag, metavar="on|off|K",
                   help="our context speculation (default off; llama-server runs none)")


def _model(args: argparse.Namespace) -> tuple[Path, Path | None]:
    """(model folder, its GGUF twin or None)."""
    from freetoken_agent.evals.perf.bench_gguf_decode import CONFIG, gguf_name
    from freetoken_agent.evals.perf.concurrent_model import MODEL_CONFIG, prepare_model

    if args.model == "tiny":
        return prepare_model(Path(args.dir) / "qwen3_moe-tiny", {**CONFIG, **TINY_CONFIG_OVERRIDES},
                             dense=args.quant_dense, threads=args.threads)
    folder = Path(args.model) if args.model else Path(args.dir) / "qwen3_moe-7b"
    if not (folder / "config.json").is_file():
        hint = " (write it: python -m freetoken_agent.evals.perf.bench_concurrent prepare)" if not args.model else ""
        raise BenchError(f"no model at {folder}{hint}")
    if args.model is None and args.quant_dense != "none":
        return prepare_model(folder, MODEL_CONFIG, dense=args.quant_dense, threads=args.threads)
    gguf = folder / gguf_name(args.quant_dense)
    return folder, gguf if gguf.is_file() else None


def _check_args(args: argparse.Namespace) -> Workload:
    if min(args.sessions, args.turns, args.threads, args.max_reply) < 1:
        raise BenchError("--sessions, --turns, --threads and --max-reply must be at least 1")
    if args.max_prompt < 64 or args.max_message_chars < 1:
        raise BenchError("--max-prompt must be at least 64 and --max-message-chars at least 1")
    if args.pause_scale < 0 or args.max_pause < 0:
        raise BenchError("--pause-scale and --max-pause must not be negative")
    return Workload(args.sessions, args.turns, args.max_prompt, args.max_reply, args.max_message_chars,
                    args.pause_scale, args.max_pause)


def _totals(sessions: list[dict[str, Any]], side: str) -> dict[str, Any] | None:
    rows = [s["sides"][side] for s in sessions if side in s["sides"]]
    if not rows:
        return None
    tokens = [r["generated"] for r in rows]
    ttft = [t for r in rows for t in r["ttft_s"]]
    add = lambda key: None if any(r[key] is None for r in rows) else sum(r[key] for r in rows)  # noqa: E731
    decode_s = sum(r["decode_s"] for r in rows)
    return {"wall_s": round(sum(r["wall_s"] for r in rows), 3), "pauses_s": round(sum(r["pauses_s"] for r in rows), 3),
            "turns": sum(len(g) for g in tokens), "generated": sum(sum(g) for g in tokens),
            "ttft_median_s": round(statistics.median(ttft), 4),
            "decode_tok_s": round(sum(r["decode_tokens"] for r in rows) / decode_s, 3) if decode_s else None,
            "disk_read_bytes": add("disk_read_bytes"), "io_read_bytes": add("io_read_bytes"),
            "peak_memory_bytes": max((r["peak_memory_bytes"] or 0) for r in rows) or None}


@row("agent-session", "recorded agent sessions end to end under a host memory budget through the SDK's Agent, phase "
     "scheduling on vs off, against llama-server with the same weights and RAM cap (wall, TTFT, tok/s, disk bytes)",
     options, format=lambda r, a: format_report(r), check=lambda r: r["exact"],
     headline=lambda r: {k: r[k] for k in ("ours_wall_s", "ours_lru_wall_s", "peer_wall_s", "peer_over_ours",
                                           "peer_over_ours_lru", "lru_over_phase") if k in r})
def agent_session_row(args: argparse.Namespace) -> dict[str, Any]:
    from freetoken_agent.evals.perf import llama_server
    from freetoken_agent.evals.perf.bench_gguf_decode import param_count
    from freetoken_agent.evals.perf.suite import trajectories_from
    from freetoken_agent.runtime.errors import FreeTokenError
    from freetoken_agent.runtime.memory import parse_bytes
    from freetoken_agent.runtime.tokenizer import Tokenizer

    w = _check_args(args)
    try:
        host = parse_bytes(args.host_memory)
        cap = None if args.peer_cap == "ours" else parse_bytes(args.peer_cap)
    except FreeTokenError as exc:
        raise BenchError(str(exc)) from None
    folder_traj = trajectories_from(args.trajectories)
    folder, gguf = _model(args)
    tok = Tokenizer.from_pretrained(folder)
    source, sessions = load_workload(folder_traj, w, tok.encode, tok.decode)
    if not sessions:
        raise BenchError(f"no session from {source} has 2 turns within --max-prompt {w.max_prompt}")
    variants = {"both": [True, False], "on": [True], "off": [False]}[args.phase]
    peer, skipped = None, None
    binary = llama_server.find_peer(Path(args.peer_cache))
    if args.peer == "none":
        skipped = "--peer none"
    elif binary is None:
        skipped = llama_server.why_missing(Path(args.peer_cache))
    elif gguf is None:
        skipped = f"no GGUF twin of {folder} (only the models of bench_concurrent prepare and --model tiny have one)"
    else:
        peer = PeerConfig(binary, gguf, args.threads, Path(args.dir) / "logs")
    if skipped:
        print(f"agent-session: llama.cpp skipped: {skipped}", file=sys.stderr)
    profile_dir = tempfile.TemporaryDirectory(prefix="freetoken-agent-session-")
    ours = OursConfig(folder, host, args.threads, args.quant_dense, args.speculate, Path(profile_dir.name) / "p.json")
    results = []
    try:
        for i, session in enumerate(sessions):
            order = variants if i % 2 == 0 else variants[::-1]
            sides: dict[str, dict[str, Any]] = {}
            prompts: list[list[int]] | None = None
            for j, phase in enumerate(order):
                name = "ours_phase" if phase else "ours_lru"
                print(f"agent-session: {session.name}: {LABELS[name]} ...", file=sys.stderr, flush=True)
                sides[name] = run_ours(ours, session, phase, w.max_prompt)
                played = sides[name].pop("prompts")
                if prompts is not None and played != prompts:
                    raise BenchError(f"session {session.name}: the two variants' prompts differ")
                prompts = played
                if j == 0 and peer is not None:
                    print(f"agent-session: {session.name}: llama.cpp ...", file=sys.stderr, flush=True)
                    limit = cap or sides[name]["peak_memory_bytes"] or host
                    try:
                        sides["llama.cpp"] = run_peer(peer, session, prompts, w.max_prompt, limit)
                    except RuntimeError as exc:  # the server did not start (or died): its log says why
                        raise BenchError(f"llama.cpp, session {session.name}: {exc}") from None
            assert prompts is not None
            results.append({"name": session.name, "turns": len(prompts),
                            "reply_tokens": [len(t.reply_ids) for t in session.turns[: len(prompts)]],
                            "pauses_s": [t.pause_s for t in session.turns[: len(prompts) - 1]], "sides": sides})
    except FreeTokenError as exc:
        raise BenchError(str(exc)) from None
    finally:
        profile_dir.cleanup()
    return report(results, {
        "model": str(folder), "params": param_count(folder), "gguf": str(gguf) if gguf else None, "source": source,
        "workload": vars(w), "host_memory_bytes": host, "threads": args.threads, "quant": "q4",
        "quant_dense": args.quant_dense, "speculate": args.speculate,
        "peer": {"skipped": skipped} if skipped else {"binary": str(binary), "cap": args.peer_cap,
                                                     "flags": "--parallel 1 --load-mode mmap --no-repack",
                                                     "read_ahead_kb": read_ahead_kb(gguf)},
    })


def report(sessions: list[dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    """The row's report: ``meta``, per-side totals, ratios (> 1: ours faster), and whether every turn generated
    its recorded length on every side with the peer's prompts matching (``exact``)."""
    totals = {side: t for side in SIDES if (t := _totals(sessions, side)) is not None}
    out: dict[str, Any] = {**meta, "sessions": sessions, "totals": totals}
    wall = {side: t["wall_s"] for side, t in totals.items()}
    for side, key in (("ours_phase", "ours_wall_s"), ("ours_lru", "ours_lru_wall_s"), ("llama.cpp", "peer_wall_s")):
        if side in wall:
            out[key] = wall[side]
    if "llama.cpp" in wall:
        for side, key in (("ours_phase", "peer_over_ours"), ("ours_lru", "peer_over_ours_lru")):
            if side in wall:
                out[key] = round(wall["llama.cpp"] / wall[side], 3)
    if "ours_phase" in wall and "ours_lru" in wall:
        out["lru_over_phase"] = round(wall["ours_lru"] / wall["ours_phase"], 3)
    out["exact"] = all(
        side["generated"] == s["reply_tokens"] and not side.get("prompt_token_mismatches")
        for s in sessions for side in s["sides"].values()
    )  # fmt: skip
    return out


def format_report(r: dict[str, Any]) -> str:
    """Markdown: the totals per side (ratios against llama.cpp), then each session."""
    mb = lambda v: "-" if v is None else f"{v / 1e6:,.0f}"  # noqa: E731
    num = lambda v, f=".2f": "-" if v is None else format(v, f)  # noqa: E731
    w = r["workload"]
    lines = [f"agent sessions from {r['source']}: {len(r['sessions'])} x up to {w['turns']} turns (prompt + reply <= "
             f"{w['max_prompt']} tokens, replies <= {w['max_reply']} tokens, pauses x{w['pause_scale']} <= "
             f"{w['max_pause_s']} s); {r['params'] / 1e9:.2f}B params, q4 experts, dense {r['quant_dense']}, "
             f"host memory {mb(r['host_memory_bytes'])} MB, {r['threads']} threads", ""]
    peer = r["totals"].get("llama.cpp")
    lines += ["| side | wall s | pauses s | turns | tokens | TTFT median s | decode tok/s | disk read MB | proc io MB | "
              "peak memory MB | llama.cpp wall / side |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for side, t in r["totals"].items():
        ratio = f"{peer['wall_s'] / t['wall_s']:.2f}x" if peer and side != "llama.cpp" else "-"
        lines.append(f"| {LABELS[side]} | {t['wall_s']:.1f} | {t['pauses_s']:.1f} | {t['turns']} | {t['generated']} | "
                     f"{t['ttft_median_s']:.3f} | {num(t['decode_tok_s'])} | {mb(t['disk_read_bytes'])} | "
                     f"{mb(t['io_read_bytes'])} | {mb(t['peak_memory_bytes'])} | {ratio} |")
    if "lru_over_phase" in r:
        lines.append(f"\nphase on vs off: wall {r['lru_over_phase']:.3f}x (off / on)")
    p = r["peer"]
    if "skipped" in p:
        lines.append(f"llama.cpp: skipped ({p['skipped']})")
    else:
        how = next((s["sides"]["llama.cpp"]["memory_limit"] for s in r["sessions"] if "llama.cpp" in s["sides"]), "")
        caps = [mb(s["sides"]["llama.cpp"]["memory_limit_bytes"]) for s in r["sessions"] if "llama.cpp" in s["sides"]]
        lines.append(f"llama.cpp: {p['flags']}, memory cap {', '.join(caps)} MB ({how}; --peer-cap {p['cap']}), "
                     f"disk read-ahead {p['read_ahead_kb']} KB")
    lines.append(f"every turn generated its recorded length on every side, prompts identical: {r['exact']}")
    for s in r["sessions"]:
        lines.append(f"\n{s['name']}: {s['turns']} turns, reply tokens {s['reply_tokens']}, pauses {s['pauses_s']} s")
        for side, v in s["sides"].items():
            lines.append(f"  {LABELS[side]}: wall {v['wall_s']:.1f} s, TTFT {v['ttft_s']} s, decode "
                         f"{num(v['decode_tok_s'])} tok/s, disk {mb(v['disk_read_bytes'])} MB"
                         + (f" (proc io {mb(v['io_read_bytes'])} MB)" if side != "llama.cpp" else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return module_main("agent-session", argv)


if __name__ == "__main__":
    raise SystemExit(main())
