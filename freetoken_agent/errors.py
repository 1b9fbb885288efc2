"""The agent's small exception hierarchy.

Two kinds: errors that become a message the model reads and the run goes on (:class:`ModelFacingError`), and
errors that end the run (:class:`RunEnded`: a limit, a cancellation, a backend failure). The loop catches both;
``Agent.run`` reports the second kind in ``RunResult.stop_reason`` rather than raising.
"""

from __future__ import annotations


class AgentError(Exception):
    """Base of every error the agent loop raises."""


class ModelFacingError(AgentError):
    """A problem with the model's output that is sent back to the model as a message; the run continues."""


class FormatError(ModelFacingError):
    """The model wrote a tool call that cannot be read (bad markers, arguments that are not a JSON object)."""


class RunEnded(AgentError):
    """Ends the run. ``reason`` is the ``RunResult.stop_reason``."""

    reason: str = "error"


class LimitExceeded(RunEnded):
    """A configured limit was reached."""


class StepLimitExceeded(LimitExceeded):
    """``Limits.max_steps`` model calls were made."""

    reason = "max_steps"


class TokenLimitExceeded(LimitExceeded):
    """``Limits.max_tokens`` tokens were generated over the run."""

    reason = "max_tokens"


class TimeLimitExceeded(LimitExceeded):
    """``Limits.max_wall_s`` seconds passed."""

    reason = "wall_time"


class RunCancelled(RunEnded):
    """``Agent.cancel()`` was called while the run was going."""

    reason = "cancelled"


class BackendError(RunEnded):
    """The backend failed (server unreachable, HTTP error, scripted outputs exhausted, engine error)."""

    reason = "backend_error"
