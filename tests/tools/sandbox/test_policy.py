"""SandboxPolicy, the environment allow-list, the probe's report, and the launcher's process semantics."""

from __future__ import annotations

from pathlib import Path

import pytest
from freetoken_agent.tools import ToolContext, ToolRegistry, Workspace, coding_tools
from freetoken_agent.tools.sandbox import (
    Mechanisms,
    ResourceLimits,
    SandboxError,
    SandboxMode,
    SandboxPolicy,
    probe,
    refusal,
)
from freetoken_agent.tools.sandbox.landlock import abi_version


def test_modes_parse_and_bad_values_name_the_choices() -> None:
    assert SandboxPolicy("read-only").mode is SandboxMode.READ_ONLY
    assert SandboxPolicy().mode is SandboxMode.WORKSPACE_WRITE and not SandboxPolicy().network
    assert not SandboxPolicy(SandboxMode.FULL_ACCESS).sandboxed
    with pytest.raises(SandboxError, match="read-only, workspace-write, full-access"):
        SandboxPolicy("danger")
    with pytest.raises(SandboxError, match="must be absolute"):
        SandboxPolicy(writable=("cache",))
    for bad in (0, -1, 1.5, True):
        with pytest.raises(SandboxError, match="processes"):
            ResourceLimits(processes=bad)  # type: ignore[arg-type]


def test_environment_is_built_from_the_allow_list() -> None:
    source = {"PATH": "/bin", "HOME": "/root", "LC_ALL": "C", "GITHUB_TOKEN": "t", "OPENAI_API_KEY": "k", "X": "1"}
    env = SandboxPolicy().environment({"X": "given"}, source)
    assert env["PATH"] == "/bin" and env["LC_ALL"] == "C" and env["X"] == "given" and env["PAGER"] == "cat"
    assert "GITHUB_TOKEN" not in env and "OPENAI_API_KEY" not in env
    assert SandboxPolicy(env_allow=("GITHUB_*",)).environment({}, source)["GITHUB_TOKEN"] == "t"


def test_context_resolves_the_policy_per_tool(root: Path) -> None:
    ctx = ToolContext(Workspace(root), sandbox=SandboxPolicy("read-only"),
                      tool_sandbox={"run_tests": SandboxPolicy(network=True)})
    assert ctx.sandbox_for("run_shell").mode is SandboxMode.READ_ONLY
    assert ctx.sandbox_for("run_tests").network
    assert ToolContext(Workspace(root)).sandbox_for("run_shell") == SandboxPolicy()


def test_probe_reports_what_the_kernel_has(monkeypatch: pytest.MonkeyPatch) -> None:
    found = probe()
    assert found.landlock_abi == abi_version()
    rows = dict(found.rows())
    assert set(rows) >= {"sandbox: landlock", "sandbox: namespaces", "sandbox: bubblewrap", "sandbox: modes"}
    monkeypatch.setenv("FREETOKEN_SANDBOX_DISABLE", "landlock, namespaces")
    off = probe()
    assert off.landlock_abi == 0 and not off.namespaces and not off.can_sandbox(network=True)
    assert dict(off.rows())["sandbox: modes"].startswith("NONE")
    assert "FREETOKEN_SANDBOX_DISABLE" in refusal(SandboxPolicy(), off)


@pytest.mark.parametrize("abi,namespaces,network,ok", [
    (0, True, False, False),  # namespaces alone cannot confine the file system
    (3, False, False, False),  # Landlock before ABI 4 cannot cut TCP
    (3, False, True, True),
    (4, False, False, True),
    (1, True, False, True),
])
def test_which_mechanisms_suffice(abi: int, namespaces: bool, network: bool, ok: bool) -> None:
    assert Mechanisms(abi, namespaces, None).can_sandbox(network) is ok


@pytest.mark.anyio
@pytest.mark.skipif(not probe().can_sandbox(network=False), reason="this machine has no sandbox mechanism")
async def test_commands_keep_normal_signal_and_exit_semantics(root: Path) -> None:
    registry = ToolRegistry(coding_tools())
    ctx = ToolContext(Workspace(root))
    piped = await registry.call("run_shell", {"command": "yes | head -2; echo ${PIPESTATUS[@]}"}, ctx)
    assert piped.content == "y\ny\n141 0\nexit code: 0"  # SIGPIPE is not inherited as ignored
    killed = await registry.call("run_shell", {"command": "kill -TERM $$"}, ctx)
    assert killed.data is not None and killed.data["exit_code"] == 143
    status = await registry.call("run_shell", {"command": "exit 3"}, ctx)
    assert status.data is not None and status.data["exit_code"] == 3
    assert status.data["sandbox"] == "workspace-write" and status.data["sandbox_mechanisms"]
