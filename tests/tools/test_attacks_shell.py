"""Attacks from commands the model runs (run_shell, run_tests) under the default sandbox: writes outside the
workspace and into ``.git``, TCP connections (to the outside and to 127.0.0.1), secrets from the agent's environment,
daemons, fork bombs, filling the disk or memory, signalling the agent. Each is contained, and the workspace intact.
The refusal path (no mechanism, no explicit ``full-access``) is tested with the mechanisms disabled."""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import pytest
from freetoken_agent.tools import ToolContext, ToolRegistry, Workspace
from freetoken_agent.tools.sandbox import ResourceLimits, SandboxMode, SandboxPolicy, probe
from tests.tools.test_shell import running, wait_gone

pytestmark = [pytest.mark.anyio, pytest.mark.skipif(not probe().can_sandbox(network=False),
                                                    reason="this machine has no sandbox mechanism")]


@pytest.fixture
def project(root: Path) -> Path:
    (root / ".git" / "hooks").mkdir(parents=True)
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (root / "keep.py").write_text("print('intact')\n")
    return root


def intact(root: Path) -> bool:
    git = root / ".git"
    return (root / "keep.py").read_text() == "print('intact')\n" and \
        (git / "HEAD").read_text() == "ref: refs/heads/main\n" and not any((git / "hooks").iterdir())


async def shell(registry: ToolRegistry, ctx: ToolContext, command: str, timeout_s: float = 20) -> str:
    result = await registry.call("run_shell", {"command": command, "timeout_s": timeout_s}, ctx)
    return result.content


async def test_writes_land_only_in_the_workspace(
    project: Path, tmp_path: Path, ctx: ToolContext, registry: ToolRegistry
) -> None:
    out = await shell(registry, ctx, f"echo ok > made.txt; echo x > {tmp_path}/outside.txt; echo x > /etc/pwned; "
                                     "echo '#!/bin/sh' > .git/hooks/pre-commit; rm -f .git/HEAD; mkdir -p sub/deep; "
                                     "echo tmp > $TMPDIR/t && cat $TMPDIR/t")
    assert (project / "made.txt").read_text() == "ok\n" and (project / "sub" / "deep").is_dir()
    assert not (tmp_path / "outside.txt").exists() and not Path("/etc/pwned").exists()
    assert out.count("Permission denied") == 2 and out.count("Read-only file system") == 2 and "tmp\n" in out
    assert intact(project)


async def test_a_nested_namespace_cannot_undo_the_sandbox(
    project: Path, ctx: ToolContext, registry: ToolRegistry
) -> None:
    out = await shell(registry, ctx, "unshare -Urm sh -c 'umount .git; mount -t tmpfs x .git; touch .git/x'; "
                                     "echo status=$?; touch .git/y")
    assert "status=1" in out and "Read-only file system" in out and intact(project)


async def test_shared_memory_is_private_and_multiprocessing_works(ctx: ToolContext, registry: ToolRegistry) -> None:
    name = f"freetoken-attack-{os.getpid()}"
    pool = "import multiprocessing as m; print(sum(m.Pool(2).map(abs, [-1, -2])))"
    out = await shell(registry, ctx, f"echo x > /dev/shm/{name}; {sys.executable} -c \"{pool}\"; ps -e | wc -l")
    assert not Path("/dev/shm", name).exists() and out.startswith("3\n")
    assert int(out.splitlines()[1]) <= 6  # the sandbox sees only its own processes


async def test_read_only_mode_writes_nothing(project: Path, registry: ToolRegistry) -> None:
    ctx = ToolContext(Workspace(project), sandbox=SandboxPolicy(SandboxMode.READ_ONLY))
    out = await shell(registry, ctx, "cat keep.py; echo x > new.txt; echo t > $TMPDIR/t && cat $TMPDIR/t")
    assert out.startswith("print('intact')\n") and "Permission denied" in out and "t\n" in out
    assert not (project / "new.txt").exists() and intact(project)


async def test_full_access_chosen_explicitly_is_unconfined(
    project: Path, tmp_path: Path, registry: ToolRegistry
) -> None:
    ctx = ToolContext(Workspace(project), sandbox=SandboxPolicy(SandboxMode.FULL_ACCESS))
    result = await registry.call("run_shell", {"command": f"echo x > {tmp_path}/outside.txt"}, ctx)
    assert (tmp_path / "outside.txt").exists() and result.data is not None and result.data["sandbox"] == "full-access"


async def test_per_tool_mode_overrides_the_agent_mode(project: Path, registry: ToolRegistry) -> None:
    ctx = ToolContext(Workspace(project), sandbox=SandboxPolicy(SandboxMode.READ_ONLY),
                      tool_sandbox={"run_shell": SandboxPolicy()})
    await shell(registry, ctx, "echo x > allowed.txt")
    assert (project / "allowed.txt").exists()


@pytest.fixture
def listener() -> tuple[socket.socket, int]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.2)
    yield server, server.getsockname()[1]
    server.close()


CONNECT = "import socket,sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2); print('CONNECTED')"


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "10.255.255.1", "1.1.1.1"])
async def test_tcp_connections_are_blocked(
    project: Path, ctx: ToolContext, registry: ToolRegistry, listener: tuple[socket.socket, int], host: str
) -> None:
    server, port = listener
    out = await shell(registry, ctx, f"{sys.executable} -c \"{CONNECT}\" {host} {port}")
    assert "CONNECTED" not in out and ("Error" in out or "error" in out)
    with pytest.raises(TimeoutError):
        server.accept()


async def test_network_can_be_allowed_per_tool(
    project: Path, registry: ToolRegistry, listener: tuple[socket.socket, int]
) -> None:
    server, port = listener
    ctx = ToolContext(Workspace(project), tool_sandbox={"run_shell": SandboxPolicy(network=True)})
    out = await shell(registry, ctx, f"{sys.executable} -c \"{CONNECT}\" 127.0.0.1 {port}")
    assert "CONNECTED" in out


async def test_loopback_inside_the_sandbox_still_works(ctx: ToolContext, registry: ToolRegistry) -> None:
    script = ("import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); s.listen(); "
              "c=socket.create_connection(s.getsockname()); print('LOCAL OK')")
    assert "LOCAL OK" in await shell(registry, ctx, f"{sys.executable} -c \"{script}\"")


async def test_secrets_in_the_agent_environment_stay_out(
    ctx: ToolContext, registry: ToolRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret-value")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-secret-value")
    out = await shell(registry, ctx, f"env; cat /proc/{os.getpid()}/environ; cat /proc/1/environ | tr '\\0' ' '")
    assert "secret-value" not in out and "PATH=" in out and "HOME=" in out


async def test_credential_files_are_hidden(
    project: Path, tmp_path: Path, registry: ToolRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_ed25519").write_text("PRIVATE KEY\n")
    (home / ".netrc").write_text("machine x login y password SECRET\n")
    monkeypatch.setenv("HOME", str(home))
    ctx = ToolContext(Workspace(project))
    out = await shell(registry, ctx, "ls -a ~/.ssh; cat ~/.ssh/id_ed25519 ~/.netrc; echo end")
    assert "PRIVATE KEY" not in out and "SECRET" not in out and "No such file" in out and "end" in out
    assert (home / ".ssh" / "id_ed25519").read_text() == "PRIVATE KEY\n"  # hidden in the sandbox only


async def test_the_agent_cannot_be_signalled(ctx: ToolContext, registry: ToolRegistry) -> None:
    out = await shell(registry, ctx, f"kill -9 {os.getpid()}; kill -9 {os.getppid()}; echo tried")
    assert "tried" in out  # and this test process is still alive to read it


@pytest.mark.parametrize("command", [
    "setsid sleep 61.0201 > /dev/null 2>&1 < /dev/null &",
    "nohup sleep 61.0202 > /dev/null 2>&1 &",
    f"{sys.executable} -c \"import os,time; os.fork() and os._exit(0); os.setsid(); os.fork() and os._exit(0); "
    "time.sleep(61.0203)\" &",
])
async def test_daemons_do_not_outlive_the_call(ctx: ToolContext, registry: ToolRegistry, command: str) -> None:
    marker = command.split("sleep")[1].split()[0].strip("()\"&")
    try:
        await shell(registry, ctx, command + " echo started")
        assert wait_gone(marker, within_s=3.0), f"{marker} survived the call"
    finally:
        for pid in running(marker):
            os.kill(pid, 9)


def limited(root: Path, **limits: int) -> ToolContext:
    return ToolContext(Workspace(root), sandbox=SandboxPolicy(limits=ResourceLimits(**limits)))


async def test_fork_bomb_is_contained(project: Path, registry: ToolRegistry) -> None:
    ctx = limited(project, processes=40)
    start = time.monotonic()
    out = await shell(registry, ctx, "bomb() { bomb | bomb & }; bomb; sleep 5", timeout_s=10)
    assert time.monotonic() - start < 8 and "kept 40 or more processes running" in out
    assert intact(project)


async def test_disk_filling_is_capped_per_file(project: Path, registry: ToolRegistry) -> None:
    ctx = limited(project, file_bytes=1 << 20)
    out = await shell(registry, ctx, "head -c 50000000 /dev/zero > big.bin; echo status=$?")
    assert (project / "big.bin").stat().st_size <= 1 << 20 and "status=153" in out  # 128 + SIGXFSZ
    assert intact(project)


async def test_cpu_time_is_capped(project: Path, registry: ToolRegistry) -> None:
    ctx = limited(project, cpu_s=1)
    start = time.monotonic()
    out = await shell(registry, ctx, f"{sys.executable} -c \"while True: pass\"; echo status=$?")
    assert "status=152" in out and time.monotonic() - start < 8  # 128 + SIGXCPU


async def test_memory_is_capped(project: Path, registry: ToolRegistry) -> None:
    ctx = limited(project, memory_bytes=256 << 20)
    out = await shell(registry, ctx, f"{sys.executable} -c \"b = bytearray(1 << 31); print('ALLOCATED')\"")
    assert "MemoryError" in out and "ALLOCATED" not in out


async def test_run_tests_is_sandboxed_too(project: Path, tmp_path: Path, ctx: ToolContext,
                                          registry: ToolRegistry) -> None:
    (project / "test_escape.py").write_text(
        f"def test_write_outside():\n    open({str(tmp_path / 'outside.txt')!r}, 'w').write('x')\n"
        "def test_inside():\n    open('inside.txt', 'w').write('x')\n")
    result = await registry.call("run_tests", {"paths": ["test_escape.py"]}, ctx)
    assert result.data is not None and result.data["passed"] == 1 and result.data["failed"] == 1
    assert "PermissionError" in result.content and not (tmp_path / "outside.txt").exists()
    assert (project / "inside.txt").exists() and intact(project)


@pytest.mark.parametrize("tool,args", [("run_shell", {"command": "touch ran"}), ("run_tests", {"paths": ["."]})])
async def test_refused_when_no_mechanism_exists(
    project: Path, registry: ToolRegistry, monkeypatch: pytest.MonkeyPatch, tool: str, args: dict[str, object]
) -> None:
    monkeypatch.setenv("FREETOKEN_SANDBOX_DISABLE", "landlock,namespaces")
    ctx = ToolContext(Workspace(project))
    result = await registry.call(tool, args, ctx)
    assert result.is_error and "no OS sandbox" in result.content and "'full-access'" in result.content
    assert not (project / "ran").exists()
    explicit = ToolContext(Workspace(project), sandbox=SandboxPolicy(SandboxMode.FULL_ACCESS))
    assert not (await registry.call("run_shell", {"command": "touch ran"}, explicit)).is_error
    assert (project / "ran").exists()


async def test_landlock_alone_still_confines(
    project: Path, tmp_path: Path, registry: ToolRegistry, monkeypatch: pytest.MonkeyPatch,
    listener: tuple[socket.socket, int]
) -> None:
    # without namespaces: Landlock for files and TCP, a child subreaper for daemons, per-entry grants keep .git
    monkeypatch.setenv("FREETOKEN_SANDBOX_DISABLE", "namespaces")
    ctx = ToolContext(Workspace(project))
    _, port = listener
    out = await shell(registry, ctx, f"echo x > {tmp_path}/outside.txt; echo y > .git/hooks/post-merge; "
                                     f"echo ok >> keep.py; {sys.executable} -c \"{CONNECT}\" 127.0.0.1 {port}; "
                                     "setsid sleep 61.0204 > /dev/null 2>&1 < /dev/null & echo done")
    try:
        assert "done" in out and "CONNECTED" not in out and not (tmp_path / "outside.txt").exists()
        assert not any((project / ".git" / "hooks").iterdir()) and (project / "keep.py").read_text().endswith("ok\n")
        assert wait_gone("sleep 61.0204", within_s=3.0)
    finally:
        for pid in running("sleep 61.0204"):
            os.kill(pid, 9)
