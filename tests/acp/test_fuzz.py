"""Malformed and random input: every message that deserves a reply gets exactly one error, nothing else reaches
stdout, and the server keeps serving (a valid request after the barrage still works)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.acp.support import child_env, freetoken_command, write_script

LIMIT = 64 * 1024  # --max-message-bytes for this server, so oversized lines stay cheap to send
KNOWN = ["initialize", "authenticate", "session/new", "session/load", "session/resume", "session/prompt",
         "session/set_mode", "session/close", "session/list"]
NULL = "null-id"  # expectation: one error response whose id is null


class Barrage:
    """Builds lines and what each one must produce: an error for an id, an error with a null id, or nothing."""

    def __init__(self, rng: random.Random, tmp: Path) -> None:
        self.rng = rng
        self.tmp = tmp
        self.lines: list[bytes] = []
        self.expect_error: set[Any] = set()  # request ids that must get an error
        self.expect_result: set[Any] = set()  # request ids that must succeed
        self.null_errors = 0
        self._next = 0
        self.sent: dict[Any, Any] = {}  # request id -> message, for failure reports

    def _id(self) -> Any:
        self._next += 1
        return self._next if self.rng.random() < 0.5 else f"fz-{self._next}"

    def junk(self, depth: int = 0) -> Any:
        r = self.rng.random()
        if depth > 2 or r < 0.4:
            return self.rng.choice([None, True, False, -1, 0, 3.5, 10**30, "", "x" * self.rng.randint(1, 50),
                                    "\u00e9\u2028\ud800", "../../etc/passwd", "relative/dir"])
        if r < 0.7:
            return [self.junk(depth + 1) for _ in range(self.rng.randint(0, 3))]
        return {self.rng.choice(["sessionId", "cwd", "prompt", "modeId", "type", "protocolVersion", "z"]):
                self.junk(depth + 1) for _ in range(self.rng.randint(0, 3))}

    def add(self, line: bytes | str, expect: Any = None, result: bool = False) -> None:
        self.lines.append(line.encode("utf-8", "surrogatepass") if isinstance(line, str) else line)
        if expect == NULL:
            self.null_errors += 1
        elif expect is not None:
            (self.expect_result if result else self.expect_error).add(expect)

    def request(self, method: str, params: Any, **extra: Any) -> tuple[str, Any]:
        rid = self._id()
        message = {"jsonrpc": "2.0", "id": rid, "method": method, **extra}
        if params is not ...:
            message["params"] = params
        self.sent[rid] = message
        return json.dumps(message), rid

    # ----------------------------------------------------------------------------------------------- kinds
    def random_bytes(self) -> None:
        data = bytes(self.rng.randrange(256) for _ in range(self.rng.randint(1, 80))).replace(b"\n", b"")
        self.add(data + b"}", NULL)  # a trailing brace: never blank, never valid JSON

    def not_an_object(self) -> None:
        value = self.rng.choice([1, "text", None, True, [], [1, 2], [{"jsonrpc": "2.0", "method": "initialize"}]])
        self.add(json.dumps(value), NULL)

    def truncated(self) -> None:
        full, _ = self.request("initialize", {"protocolVersion": 1})
        self.add(full[: self.rng.randint(1, len(full) - 1)], NULL)

    def unknown_method(self) -> None:
        name = self.rng.choice(["foo", "session/explode", "_ext/thing", "", "initialize ", "fs/read_text_file"])
        line, rid = self.request(name, {})
        self.add(line, rid)

    def bad_params(self) -> None:
        method = self.rng.choice(KNOWN)
        bad: dict[str, Callable[[], Any]] = {
            "initialize": lambda: self.rng.choice([{"protocolVersion": v} for v in (-1, 70000, 1.5, None, [], {}, True)]
                                                  + [{}, {"clientCapabilities": {}}]),
            "authenticate": lambda: {"methodId": self.rng.choice([None, 5, [], {}])},
            "session/new": lambda: {"cwd": self.rng.choice(["relative/dir", "", 5, None,
                                                            str(self.tmp / "missing")]), "mcpServers": []},
            "session/load": lambda: {"sessionId": self.rng.choice(["nope", "../x", "a" * 500]),
                                     "cwd": str(self.tmp), "mcpServers": []},
            "session/resume": lambda: {"sessionId": "nope", "cwd": str(self.tmp)},
            "session/prompt": lambda: {"sessionId": self.rng.choice(["nope", 1, None]),
                                       "prompt": self.rng.choice([[], [{"type": "text", "text": "hi"}],
                                                                  [{"type": "image"}], "text", self.junk()])},
            "session/set_mode": lambda: {"sessionId": "nope", "modeId": self.junk()},
            "session/close": lambda: {"sessionId": self.junk()},
            "session/list": lambda: {"cwd": self.junk(), "cursor": "not-a-number"},  # this server keeps none
        }
        # random junk as params, except for initialize, where junk may be a valid version (0) by chance
        junk = self.junk() if method != "initialize" else bad[method]()
        params = self.rng.choice([bad[method](), junk, ..., [1, 2], "params"])
        if params is ... and method in ("initialize", "session/new", "session/load", "session/resume"):
            params = {}  # absent params must fail these too
        line, rid = self.request(method, params)
        self.add(line, rid)

    def bad_envelope(self) -> None:
        rid = self._id()
        message: dict[str, Any] = {"id": rid, "method": "initialize", "params": {"protocolVersion": 1}}
        choice = self.rng.randrange(3)
        if choice == 0:
            message["jsonrpc"] = self.rng.choice(["1.0", 2.0, None])
        elif choice == 1:
            message["jsonrpc"], message["method"] = "2.0", self.rng.choice([5, None, [], {}])
        else:
            message = {"jsonrpc": "2.0", "id": rid}  # neither a method nor a result
        self.add(json.dumps(message), rid)

    def bad_id(self) -> None:
        message = {"jsonrpc": "2.0", "id": self.rng.choice([{}, [], True, 1.5]), "method": "initialize",
                   "params": {"protocolVersion": 1}}
        self.add(json.dumps(message), NULL)

    def notification(self) -> None:
        method = self.rng.choice(["session/cancel", "unknown/notice", "initialize", "$/cancelRequest"])
        self.add(json.dumps({"jsonrpc": "2.0", "method": method, "params": self.junk()}))

    def stray_response(self) -> None:
        self.add(json.dumps({"jsonrpc": "2.0", "id": self.rng.randint(10**6, 10**7),
                             "result": self.junk()}))

    def deep_nesting(self) -> None:
        depth = self.rng.randint(5000, 60000)
        self.add("[" * depth + "]" * depth, NULL)

    def oversized(self) -> None:
        big = json.dumps({"jsonrpc": "2.0", "id": self._id(), "method": "initialize",
                          "params": {"protocolVersion": 1, "pad": "x" * (LIMIT + self.rng.randint(1, 3 * LIMIT))}})
        self.add(big, NULL)  # its id cannot be trusted: the line was dropped unread

    def valid(self) -> None:
        line, rid = self.request("initialize", {"protocolVersion": 1})
        self.add(line, rid, result=True)

    def build(self, count: int) -> None:
        kinds = [self.random_bytes, self.not_an_object, self.truncated, self.unknown_method, self.bad_params,
                 self.bad_params, self.bad_envelope, self.bad_id, self.notification, self.stray_response,
                 self.valid]
        for i in range(count):
            if i % 250 == 7:
                self.oversized()
            elif i % 300 == 11:
                self.deep_nesting()
            else:
                self.rng.choice(kinds)()


async def _exchange(script: Path, lines: list[bytes], final: bytes) -> tuple[list[bytes], int, bytes]:
    command = freetoken_command()
    proc = await asyncio.create_subprocess_exec(
        *command, "acp", "--scripted", str(script), "--no-sessions", "--max-message-bytes", str(LIMIT),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env=child_env(), limit=2**24)
    assert proc.stdin and proc.stdout and proc.stderr
    out: list[bytes] = []
    final_seen = asyncio.Event()

    async def read() -> None:
        assert proc.stdout
        while line := await proc.stdout.readline():
            out.append(line)
            if b'"id":"final"' in line:
                final_seen.set()

    async def write() -> None:
        assert proc.stdin
        for line in lines:
            proc.stdin.write(line + b"\n")
            await proc.stdin.drain()
        proc.stdin.write(final + b"\n")
        await proc.stdin.drain()
        await asyncio.wait_for(final_seen.wait(), 60)
        proc.stdin.close()

    reader = asyncio.create_task(read())
    stderr = asyncio.create_task(proc.stderr.read())
    await write()
    code = await asyncio.wait_for(proc.wait(), 30)
    await reader
    return out, code, await stderr


def test_a_thousand_malformed_messages_get_errors_and_never_corrupt_stdout(tmp_path: Path) -> None:
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    barrage = Barrage(rng, tmp_path)
    barrage.build(1200)
    script = write_script(tmp_path, [])
    final = json.dumps({"jsonrpc": "2.0", "id": "final", "method": "initialize",
                        "params": {"protocolVersion": 1}}).encode()
    out, code, stderr = asyncio.run(_exchange(script, barrage.lines, final))
    why = f"seed={seed}; stderr tail: {stderr[-2000:].decode('utf-8', 'replace')}"
    assert code == 0, why
    responses = []
    for raw in out:  # every byte on stdout is a protocol message, one per line
        assert raw.endswith(b"\n") and raw.count(b"\n") == 1, why
        message = json.loads(raw)
        assert message.get("jsonrpc") == "2.0" and "id" in message, why
        assert ("result" in message) != ("error" in message), why
        responses.append(message)
    by_id: dict[Any, list[dict]] = {}
    for message in responses:
        by_id.setdefault(message["id"], []).append(message)
    final_answer = by_id.pop("final")
    assert final_answer[0]["result"]["protocolVersion"] == 1, why
    nulls = by_id.pop(None, [])
    assert all("error" in m for m in nulls) and len(nulls) == barrage.null_errors, why
    assert set(by_id) == barrage.expect_error | barrage.expect_result, why
    for rid, answers in by_id.items():
        assert len(answers) == 1, (rid, why)
        if rid in barrage.expect_result:
            assert answers[0]["result"]["protocolVersion"] == 1, (rid, why)
        else:
            assert "error" in answers[0], (barrage.sent.get(rid), answers[0], why)
            error = answers[0]["error"]
            assert isinstance(error["code"], int) and error["message"], (rid, why)
    codes = {m["error"]["code"] for m in responses if "error" in m}
    assert {-32700, -32600, -32601, -32602, -32002} <= codes, why
    assert len(barrage.lines) >= 1000
    assert b"Traceback" not in stderr, why


def test_requests_sent_just_before_stdin_closes_are_all_answered(tmp_path: Path) -> None:
    """A one-shot pipeline (``printf ... | freetoken acp``): every request gets its reply before the agent exits;
    a prompt still generating when stdin closes is cancelled and answers ``cancelled``."""
    sessions = tmp_path / "sessions"
    sessions.mkdir()
    (sessions / "sess_saved.json").write_text(json.dumps({"id": "sess_saved", "cwd": str(tmp_path), "history": []}))
    script = write_script(tmp_path, [" ".join(["slow"] * 500)], delay_s=0.02)  # 10 s if never cancelled
    lines = [{"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": 1}},
             {"jsonrpc": "2.0", "id": 2, "method": "session/new", "params": {"cwd": str(tmp_path), "mcpServers": []}},
             {"jsonrpc": "2.0", "id": 3, "method": "no/such"},
             {"jsonrpc": "2.0", "id": 4, "method": "session/load",
              "params": {"sessionId": "sess_saved", "cwd": str(tmp_path), "mcpServers": []}},
             {"jsonrpc": "2.0", "id": 5, "method": "session/prompt",
              "params": {"sessionId": "sess_saved", "prompt": [{"type": "text", "text": "Go."}]}}]
    started = time.monotonic()
    done = subprocess.run([*freetoken_command(), "acp", "--scripted", str(script), "--sessions", str(sessions)],
                          input="".join(json.dumps(m) + "\n" for m in lines).encode(), capture_output=True,
                          env=child_env(), timeout=60)
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - started < 8
    replies = {m["id"]: m for m in map(json.loads, done.stdout.splitlines()) if "id" in m}
    assert replies[1]["result"]["protocolVersion"] == 1
    assert replies[2]["result"]["sessionId"].startswith("sess_")
    assert replies[3]["error"]["code"] == -32601
    assert "modes" in replies[4]["result"]
    assert replies[5]["result"]["stopReason"] == "cancelled"
