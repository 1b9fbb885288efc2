"""The execution planner: for one MoE layer step, where each routed expert runs.

Paths (integers in, names out — the planner never touches tensors):
- ``resident``: the expert is in a device slot → compute on the device (adaptive mode: unless the host queue would
  finish it first — a device driven op by op can be slower per expert than the CPU, as measured on an H200);
- ``fetch``: copy it host → device, then compute on the device;
- ``host``: compute on the CPU where the weights already are; only activations move.

Host compute and device work run side by side, so the planner minimizes the step's makespan: experts are taken
heaviest first (most tokens) and each goes to the path whose queue would finish earliest, counting the copies
and host computes already planned in this step. Decode sends one token to a cold expert → host compute wins
whenever the CPU streams the expert faster than the link copies it; prefill sends many → fetch wins.
Without a device tier every expert runs on the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from freetoken_agent.runtime.errors import FreeTokenError
from freetoken_agent.runtime.execution.cost import CostModel

PATHS = ("resident", "fetch", "host")
MODES = ("adaptive", "fetch", "host")


@dataclass(frozen=True)
class ExpertNeed:
    """One routed expert of a step: id, tokens routed to it, where it already is."""

    expert: int
    tokens: int
    on_device: bool
    on_host: bool


@dataclass
class Plan:
    """The path of every expert of a step, and the planner's makespan estimate."""

    paths: dict[int, str] = field(default_factory=dict)
    host_s: float = 0.0
    device_s: float = 0.0

    def experts(self, path: str) -> list[int]:
        return sorted(e for e, p in self.paths.items() if p == path)


class ExecutionPlanner:
    """Splits a step's experts into resident / fetch / host using a ``CostModel``."""

    def __init__(self, cost: CostModel, expert_bytes: int, has_device: bool, mode: str = "adaptive") -> None:
        """``mode``: ``adaptive`` (the cost model decides), ``fetch`` (every cold expert is copied to the device:
        the reference server's slot-pool behaviour) or ``host`` (cold experts always on the CPU: static placement)."""
        if mode not in MODES:
            raise FreeTokenError(f"unknown planner mode {mode!r}; expected one of {', '.join(MODES)}")
        self.cost, self.expert_bytes, self.has_device, self.mode = cost, expert_bytes, has_device, mode
        self.decisions = {p: 0 for p in PATHS}

    def plan(self, needs: list[ExpertNeed], device_room: int | None = None) -> Plan:
        """``device_room``: device slots this step may fill (None = enough); beyond it, experts run on the host."""
        plan = Plan()
        b, cost = self.expert_bytes, self.cost
        room = len(needs) if device_room is None else device_room
        copy_queue = 0.0
        for need in sorted(needs, key=lambda n: (-n.tokens, n.expert)):
            if not self.has_device:
                path = "host"
            elif need.on_device:  # adaptive: a device slower than the host (measured) leaves it to the host queue
                disk = 0.0 if need.on_host else cost.disk_seconds(b)
                host_done = plan.host_s + disk + cost.host_seconds(b, need.tokens)
                device_done = plan.device_s + cost.device_seconds(need.tokens)
                path = "host" if self.mode == "adaptive" and host_done < device_done else "resident"
            else:
                disk = 0.0 if need.on_host else cost.disk_seconds(b)
                host_done = plan.host_s + disk + cost.host_seconds(b, need.tokens)
                fetch_ready = max(copy_queue + cost.copy_seconds(b) + disk, 0.0)
                device_done = max(plan.device_s, fetch_ready) + cost.device_seconds(need.tokens)
                faster = device_done < host_done if self.mode == "adaptive" else self.mode == "fetch"
                path = "fetch" if room > 0 and faster else "host"
            if path == "resident":
                plan.device_s += cost.device_seconds(need.tokens)
            elif path == "fetch":
                room -= 1
                copy_queue += cost.copy_seconds(b) + (0.0 if need.on_host else cost.disk_seconds(b))
                plan.device_s = max(plan.device_s, copy_queue) + cost.device_seconds(need.tokens)
            else:
                plan.host_s += (0.0 if need.on_host else cost.disk_seconds(b)) + cost.host_seconds(b, need.tokens)
            plan.paths[need.expert] = path
            self.decisions[path] += 1
        return plan
