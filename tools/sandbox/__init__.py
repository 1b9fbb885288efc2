"""The OS sandbox for tools that run code (``run_shell``, ``run_tests``): Landlock, namespaces, rlimits.

``SandboxPolicy`` says what a command may do (modes ``read-only``, ``workspace-write``, ``full-access``);
``confined`` turns a command into one that runs under the policy (or refuses when the machine cannot enforce it);
``probe`` reports the mechanisms this machine has (``freetoken doctor`` prints them).
"""

from __future__ import annotations

from freetoken_agent.tools.sandbox.command import Confined, confined, refusal
from freetoken_agent.tools.sandbox.policy import (
    ResourceLimits,
    SandboxError,
    SandboxMode,
    SandboxPolicy,
    SandboxUnavailable,
)
from freetoken_agent.tools.sandbox.probe import Mechanisms, probe

__all__ = ["Confined", "Mechanisms", "ResourceLimits", "SandboxError", "SandboxMode", "SandboxPolicy",
           "SandboxUnavailable", "confined", "probe", "refusal"]
