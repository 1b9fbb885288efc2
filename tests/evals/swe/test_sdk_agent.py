"""A real ``Agent`` (scripted backend, real loop, real coding tools) through two tasks of the built-in suite."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
from freetoken_agent.evals.suites import suite_tasks
from freetoken_agent.evals.suites.spec import materialize
from freetoken_agent.evals.swe.harness import HarnessConfig, run_pending
from freetoken_agent.evals.swe.report import engine_value, markdown
from freetoken_agent.evals.swe.results import RunStore
from freetoken_agent.evals.swe.sdk_agent import SDKAgent
from freetoken_agent.evals.swe.task import Task, load_tasks

from freetoken_agent import Agent
from freetoken_agent.backends.base import GenerateRequest
from freetoken_agent.backends.scripted import ScriptedBackend


def call(name: str, arguments: dict) -> str:
    """A model output in the Hermes/Qwen format calling one tool."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def edit_after_reading(path: str, old: str, new: str):
    """A turn that edits only if the previous tool result (the file as read) showed the buggy line."""

    def turn(request: GenerateRequest) -> str:
        seen = request.messages[-1]
        assert seen["role"] == "tool" and old in seen["content"], seen
        return call("edit_file", {"path": path, "old_string": old, "new_string": new})

    return turn


SCRIPTS = {
    "paginate_last_page": [
        call("read_file", {"path": "pager/core.py"}),
        edit_after_reading("pager/core.py", "return n_items // size", "return (n_items + size - 1) // size"),
        call("run_shell", {"command": "python -c 'from pager import paginate; print(paginate([1, 2, 3], 2))'"}),
        "Fixed page_count: it rounded down, so paginate dropped the last partial page.",
    ],
    "receipt_total": [  # a multi-file fix
        call("search", {"pattern": "def (subtotal_cents|format_cents)"}),
        call("read_file", {"path": "shop/models.py"}),
        edit_after_reading("shop/models.py", "line.unit_cents for line", "line.unit_cents * line.quantity for line"),
        call("read_file", {"path": "shop/receipt.py"}),
        edit_after_reading("shop/receipt.py", "cents // 10}", "cents // 100}"),
        "The subtotal ignored quantities and format_cents divided by 10; both fixed.",
    ],
}


def test_real_agent_resolves_two_suite_tasks(tmp_path: Path) -> None:
    specs = [s for s in suite_tasks("builtin") if s.name in SCRIPTS]
    tasks = load_tasks(materialize(specs, "builtin", tmp_path / "suite"))
    backends: dict[str, ScriptedBackend] = {}

    def factory(task: Task, workspace: Path) -> Agent:
        backend = backends[task.instance_id] = ScriptedBackend(SCRIPTS[task.instance_id.split("__", 1)[1]])
        return Agent.coding(backend, workspace=workspace)

    store = RunStore(tmp_path / "run")
    store.start({"agent": "scripted"}, resume=False)
    results = anyio.run(run_pending, tasks, SDKAgent(factory, name="scripted"), store, HarnessConfig(workers=2))

    for r in results:
        script = SCRIPTS[r.instance_id.split("__", 1)[1]]
        assert r.status == "resolved", r.reason
        assert r.turns == len(script) and r.agent_stopped is None
        assert backends[r.instance_id].remaining == 0  # every scripted turn was played by the real loop
        assert r.tokens_in > 0 and r.tokens_out > 0
        assert len(r.engine["ttft_s"]) == r.turns and engine_value(r, "ttft_s") is not None
        trajectory = store.dir / "tasks" / r.instance_id / "trajectory.jsonl"
        records = [json.loads(ln) for ln in trajectory.read_text().splitlines()]
        assert records[0]["type"] == "run_started" and records[-1]["stop_reason"] == "done"
        final = (store.dir / "tasks" / r.instance_id / "final_message.txt").read_text()
        assert final == script[-1]
    receipt = next(r for r in results if "receipt" in r.instance_id)
    patch = (store.dir / "tasks" / receipt.instance_id / "model.patch").read_text()
    assert "shop/models.py" in patch and "shop/receipt.py" in patch
    assert "TTFT s" in markdown(results, store.meta())


def test_engine_stats_become_per_task_differences() -> None:
    from freetoken_agent.evals.swe.sdk_agent import stats_delta

    before = {"requests": 3, "prefill_s": 1.5, "prefill_tok_s": 900.0, "threads": 2, "phase": "plan",
              "kv": {"prefix_hit_tokens": 10, "prefill_tokens": 30, "prefix_hit_rate": 0.25},
              "experts": {"expert_hits": 5, "expert_misses": 5, "expert_hit_rate": 0.5}, "phase_hints": {"plan": 1}}
    after = {"requests": 5, "prefill_s": 2.0, "prefill_tok_s": 950.0, "threads": 2, "phase": "tool",
             "kv": {"prefix_hit_tokens": 40, "prefill_tokens": 40, "prefix_hit_rate": 0.5},
             "experts": {"expert_hits": 14, "expert_misses": 6, "expert_hit_rate": 0.7},
             "phase_hints": {"plan": 3, "tool": 1}}
    assert stats_delta(before, after) == {
        "requests": 2, "prefill_s": 0.5, "prefill_tok_s": 950.0, "threads": 2, "phase": "tool",
        # hit rates over this task: 30 of 40 prompt tokens reused, 9 of 10 expert lookups resident
        "kv": {"prefix_hit_tokens": 30, "prefill_tokens": 10, "prefix_hit_rate": 0.75},
        "experts": {"expert_hits": 9, "expert_misses": 1, "expert_hit_rate": 0.9},
        "phase_hints": {"plan": 2, "tool": 1}}
    assert stats_delta({}, after) == after  # the first task on a fresh engine: the totals are the task's
    # speculation's statistics: int keys (a histogram per draft length), a cost that is no counter, a list
    spec_before = {"speculation": {"drafted": 4, "verify_cost": 0.2, "k_hist": {1: 2, 3: 1}, "row_cost": [1.1, 1.2]}}
    spec_after = {"speculation": {"drafted": 10, "verify_cost": 0.15, "k_hist": {1: 3, 3: 2}, "row_cost": [1.1, 1.3]}}
    assert stats_delta(spec_before, spec_after) == {
        "speculation": {"drafted": 6, "verify_cost": 0.15, "k_hist": {1: 1, 3: 1}, "row_cost": [1.1, 1.3]}}


def test_agent_timeout_becomes_the_agents_wall_limit(tmp_path: Path) -> None:
    """A slow model hits the task's agent timeout as the Agent's own limit: the run ends cleanly, not cancelled."""
    specs = [s for s in suite_tasks("builtin") if s.name == "tail_zero_lines"]
    task = load_tasks(materialize(specs, "builtin", tmp_path / "suite"))[0].model_copy(update={"agent_timeout_s": 1.0})

    def factory(task: Task, workspace: Path) -> Agent:
        return Agent.coding(ScriptedBackend(["word " * 1000], delay_s=0.01), workspace=workspace)

    store = RunStore(tmp_path / "run")
    store.start({"agent": "slow"}, resume=False)
    [result] = anyio.run(run_pending, [task], SDKAgent(factory, name="slow"), store, HarnessConfig())
    assert result.status == "unresolved" and result.reason == "empty patch"
    assert result.agent_stopped.startswith("wall_time") and len(result.engine["ttft_s"]) == 1
    assert 0.9 < result.agent_s < 5
