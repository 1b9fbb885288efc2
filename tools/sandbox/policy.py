"""Sandbox modes and policies for tools that run code: what a command may read, write and reach.

``SandboxMode`` follows Codex CLI's modes: ``read-only`` (read anything, write nothing but a private temp folder, no
network), ``workspace-write`` (the default: also write the workspace, except ``.git``; no network) and
``full-access`` (no sandbox at all; only when chosen explicitly). A :class:`SandboxPolicy` adds the resource limits
and the environment allow-list; a ``ToolContext`` holds one for the agent and optional overrides per tool.
"""

from __future__ import annotations

import enum
import fnmatch
import os
from dataclasses import dataclass, field

from freetoken_agent.tools.context import ToolError

GIB = 1 << 30


class SandboxError(ToolError):
    """A sandbox policy that cannot be honoured (bad value, no mechanism on this machine). Shown to the model."""


class SandboxUnavailable(SandboxError):
    """This machine has no mechanism for the chosen mode, and the user did not choose ``full-access``."""


class SandboxMode(str, enum.Enum):
    """How much a command started by a tool may do."""

    READ_ONLY = "read-only"
    WORKSPACE_WRITE = "workspace-write"
    FULL_ACCESS = "full-access"

    @classmethod
    def parse(cls, value: str | SandboxMode) -> SandboxMode:
        """The mode named ``value``; :class:`SandboxError` naming the choices otherwise."""
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(mode.value for mode in cls)
            raise SandboxError(f"unknown sandbox mode {value!r}; choose one of {choices}") from None


# the variables a build or test run needs; everything else (API keys, tokens, cloud credentials) stays out
DEFAULT_ENV_ALLOW: tuple[str, ...] = (
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "LC_*", "TZ", "TERM", "TMPDIR",
    "VIRTUAL_ENV", "CONDA_PREFIX", "PYTHONPATH", "PYTHONHOME", "JAVA_HOME", "GOPATH", "GOROOT", "CARGO_HOME",
    "RUSTUP_HOME", "NODE_PATH", "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE",
)
# credentials a command has no business reading (hidden where namespaces exist: an empty folder, an empty file)
DEFAULT_HIDDEN: tuple[str, ...] = (
    "~/.ssh", "~/.gnupg", "~/.aws", "~/.azure", "~/.config/gcloud", "~/.kube", "~/.docker/config.json",
    "~/.netrc", "~/.git-credentials", "~/.pypirc", "~/.npmrc", "~/.cargo/credentials.toml",
    "~/.cache/huggingface/token", "~/.config/gh/hosts.yml",
)
TOOL_ENV = {"PAGER": "cat", "GIT_PAGER": "cat", "TERM": "dumb", "NO_COLOR": "1", "PYTHONUNBUFFERED": "1"}


@dataclass(frozen=True)
class ResourceLimits:
    """Per-process limits (``setrlimit``) for sandboxed commands; None leaves a limit as it is (except ``cpu_s``)."""

    cpu_s: int | None = None
    """CPU seconds per process, all its threads together. None: (the call's timeout + 60 s) x the CPU cores, a
    backstop that a command using every core for its whole timeout still stays under."""
    memory_bytes: int | None = 16 * GIB
    """Writable private memory per process (``RLIMIT_DATA``; address-space reservations are not counted)."""
    file_bytes: int | None = 4 * GIB
    """Largest file a process may write (``RLIMIT_FSIZE``): a command cannot fill the disk with one file."""
    processes: int | None = 512
    """Processes at once: ``RLIMIT_NPROC`` plus the sandbox's own count (root is exempt from ``RLIMIT_NPROC``)."""
    open_files: int | None = 4096
    """Open file descriptors per process."""

    def __post_init__(self) -> None:
        for name in ("cpu_s", "memory_bytes", "file_bytes", "processes", "open_files"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise SandboxError(f"resource limit {name} must be a positive integer or None, got {value!r}")

    def as_dict(self) -> dict[str, int | None]:
        """The limits by name, for the launcher."""
        return {name: getattr(self, name) for name in ("cpu_s", "memory_bytes", "file_bytes", "processes",
                                                        "open_files")}


@dataclass(frozen=True)
class SandboxPolicy:
    """What commands started by tools may do. The default: ``workspace-write``, no network, ``.git`` read-only.

    ``full-access`` turns the OS sandbox off (the environment allow-list still applies). Where this machine has no
    sandbox mechanism, the other modes refuse to run commands rather than silently running them unconfined.
    """

    mode: SandboxMode = SandboxMode.WORKSPACE_WRITE
    """``read-only``, ``workspace-write`` or ``full-access``."""
    network: bool = False
    """Allow network access (off in every sandboxed mode unless set)."""
    writable: tuple[str, ...] = ()
    """Extra absolute folders commands may write (``workspace-write`` only), e.g. a shared build cache."""
    read_only: tuple[str, ...] = (".git",)
    """Paths kept read-only even in ``workspace-write`` (relative ones are taken from the workspace root)."""
    hidden: tuple[str, ...] = DEFAULT_HIDDEN
    """Paths (``~`` expanded) commands cannot read: credentials. Needs namespaces; without them they stay readable."""
    limits: ResourceLimits = field(default_factory=ResourceLimits)
    """Resource limits for every sandboxed process."""
    env_allow: tuple[str, ...] = DEFAULT_ENV_ALLOW
    """Names (``fnmatch`` patterns) of the agent's environment variables that commands see."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", SandboxMode.parse(self.mode))
        for path in self.writable:
            if not os.path.isabs(path):
                raise SandboxError(f"writable path {path!r} must be absolute")
        if not isinstance(self.limits, ResourceLimits):
            raise SandboxError(f"limits must be a ResourceLimits, got {type(self.limits).__name__}")

    @property
    def sandboxed(self) -> bool:
        """False only for ``full-access``."""
        return self.mode is not SandboxMode.FULL_ACCESS

    def environment(self, extra: dict[str, str], source: dict[str, str] | None = None) -> dict[str, str]:
        """The environment a command gets: the allow-listed variables of ``source`` (default: ours), the tool
        defaults (no pagers, no colours), then ``extra`` (the variables the user gave the context, always kept)."""
        source = dict(os.environ) if source is None else source
        env = {key: value for key, value in source.items()
               if any(fnmatch.fnmatchcase(key, pattern) for pattern in self.env_allow)}
        env.update(TOOL_ENV)
        env.update(extra)
        return env
