"""run_shell: real subprocesses, timeouts that kill whole process groups, output caps, cancellation."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import anyio
import pytest
from freetoken_agent.tools import ToolContext, ToolRegistry, Workspace

pytestmark = pytest.mark.anyio
SLACK_S = 2.5


def alive(pid: int) -> bool:
    """True if ``pid`` runs (a zombie waiting to be reaped counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def running(marker: str) -> list[int]:
    """Host pids of live processes whose command line contains ``marker`` (sandboxed commands see other pids)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                cmdline = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if marker in cmdline and alive(int(name)):
                found.append(int(name))
    return found


def wait_gone(marker: str, within_s: float = 2.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not running(marker):
            return True
        time.sleep(0.02)
    return False


async def test_exit_code_output_cwd_env_stdin(root: Path, registry: ToolRegistry) -> None:
    ctx = ToolContext(Workspace(root), env={"GREETING": "hello"})
    result = await registry.call("run_shell", {"command": "pwd; echo $GREETING; echo oops >&2; cat; exit 7"}, ctx)
    assert not result.is_error
    assert result.content == f"{root.resolve()}\nhello\noops\nexit code: 7"
    assert result.data is not None and result.data["exit_code"] == 7 and result.data["timed_out"] is False
    ok = await registry.call("run_shell", {"command": "true"}, ctx)
    assert ok.content == "(no output)\nexit code: 0"
    empty = await registry.call("run_shell", {"command": "  "}, ctx)
    assert empty.is_error and "command is empty" in empty.content


async def test_timeout_kills_forked_children(root: Path, ctx: ToolContext, registry: ToolRegistry) -> None:
    script = (
        "import os, time\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    time.sleep(60)\n"
        "    os._exit(0)\n"
        "time.sleep(60)\n"
    )
    forker = f"forker_{os.getpid()}_{time.monotonic_ns()}.py"
    (root / forker).write_text(script)
    command = f"sleep 60.0101 & {sys.executable} {forker}; echo never"
    start = time.monotonic()
    result = await registry.call("run_shell", {"command": command, "timeout_s": 1.5}, ctx)
    elapsed = time.monotonic() - start
    assert elapsed < 1.5 + SLACK_S, elapsed
    assert result.is_error and result.content.endswith("Command timed out after 1.5 s; its process group was killed.")
    assert result.data is not None and result.data["exit_code"] is None and result.data["timed_out"] is True
    assert "never" not in result.content
    for marker in ("sleep 60.0101", forker):
        assert wait_gone(marker), f"{marker} survived the timeout"


async def test_background_child_does_not_block_or_survive(root: Path, ctx: ToolContext, registry: ToolRegistry) -> None:
    start = time.monotonic()
    result = await registry.call("run_shell", {"command": "sleep 60.0102 & echo done"}, ctx)
    assert time.monotonic() - start < SLACK_S  # the sleeper holds the output pipe, yet the call returns
    assert result.content == "done\nexit code: 0"
    assert wait_gone("sleep 60.0102")


async def test_output_cap_keeps_head_and_tail(root: Path, registry: ToolRegistry) -> None:
    ctx = ToolContext(Workspace(root), max_output_chars=1000)
    command = f"{sys.executable} -c \"print('HEAD'); print('x' * 100000); print('TAIL')\""
    result = await registry.call("run_shell", {"command": command}, ctx)
    assert result.content.startswith("HEAD\nxxx") and result.content.endswith("exit code: 0")
    assert result.content.endswith("xxx\nTAIL\nexit code: 0")
    assert "characters omitted ...]" in result.content and len(result.content) < 1200
    assert result.data is not None and result.data["output_truncated"] is True


async def test_flood_is_bounded(root: Path, registry: ToolRegistry) -> None:
    ctx = ToolContext(Workspace(root), max_output_chars=2000)
    result = await registry.call("run_shell", {"command": "yes", "timeout_s": 1}, ctx)
    assert result.data is not None and result.data["timed_out"] and len(result.content) < 2200


async def test_cancel_event_kills_the_group(root: Path, ctx: ToolContext, registry: ToolRegistry) -> None:
    async def cancel_soon() -> None:
        await anyio.sleep(0.5)
        ctx.cancel()

    start = time.monotonic()
    async with anyio.create_task_group() as group:
        group.start_soon(cancel_soon)
        result = await registry.call("run_shell", {"command": "sleep 60.0103 & sleep 60"}, ctx)
    assert time.monotonic() - start < 0.5 + SLACK_S
    assert result.is_error and "was cancelled" in result.content
    assert wait_gone("sleep 60.0103")


async def test_cancel_scope_kills_the_group(root: Path, ctx: ToolContext, registry: ToolRegistry) -> None:
    start = time.monotonic()
    with anyio.move_on_after(0.7) as scope:
        await registry.call("run_shell", {"command": "sleep 60.0104 & sleep 60"}, ctx)
    assert scope.cancelled_caught and time.monotonic() - start < 0.7 + SLACK_S
    assert wait_gone("sleep 60.0104")


async def test_output_streams_to_callback(root: Path, registry: ToolRegistry) -> None:
    seen: list[tuple[float, str]] = []
    ctx = ToolContext(Workspace(root), on_output=lambda text: seen.append((time.monotonic(), text)))
    result = await registry.call("run_shell", {"command": "echo first; sleep 0.5; echo second"}, ctx)
    assert "".join(text for _, text in seen) == "first\nsecond\n"
    assert result.content == "first\nsecond\nexit code: 0"
    assert len(seen) >= 2 and seen[-1][0] - seen[0][0] > 0.3  # chunks arrived as produced, not at the end


async def test_child_that_escapes_the_group_cannot_hang_the_call(
    root: Path, ctx: ToolContext, registry: ToolRegistry
) -> None:
    # setsid puts the sleeper in a new session, out of reach of the group kill, still holding the output pipe; the
    # sandbox's PID namespace ends it with the call
    command = "setsid sleep 30.0105 & echo done"
    start = time.monotonic()
    result = await registry.call("run_shell", {"command": command}, ctx)
    try:
        assert time.monotonic() - start < SLACK_S + 1.5
        assert result.content.startswith("done") and result.content.endswith("exit code: 0")
        assert wait_gone("sleep 30.0105")
    finally:
        for pid in running("sleep 30.0105"):
            os.kill(pid, 9)  # never leave a stray process behind, even when the assertion failed


async def test_terminal_escapes_and_progress_redraws_are_cleaned(ctx: ToolContext, registry: ToolRegistry) -> None:
    command = r"printf '\033[1;31mFAILED\033[0m here\n'; printf 'get 10%%\rget 50%%\rget 100%%\n'; printf 'end\r\n'"
    result = await registry.call("run_shell", {"command": command}, ctx)
    assert result.content == "FAILED here\nget 100%\nend\nexit code: 0"
