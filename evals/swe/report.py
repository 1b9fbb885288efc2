"""Reports of a run: a summary, a per-task table (terminal, Markdown, JSON), and two runs side by side."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from freetoken_agent.evals.swe.results import ERROR, RESOLVED, SKIPPED, RunStore, TaskResult
from freetoken_agent.evals.swe.task import EvalError
from rich.console import Console
from rich.table import Table

ENGINE_COLUMNS = [("ttft_s", "TTFT s"), ("prefix_hit_rate", "prefix hit"), ("expert_hit_rate", "expert hit")]


def summarize(results: list[TaskResult]) -> dict[str, Any]:
    """Counts and totals; ``resolved_rate`` is over the tasks that ran (skipped ones are left out)."""
    count = {s: sum(r.status == s for r in results) for s in (RESOLVED, SKIPPED, ERROR)}
    ran = len(results) - count[SKIPPED]
    return {
        "total": len(results),
        "resolved": count[RESOLVED],
        "unresolved": ran - count[RESOLVED] - count[ERROR],
        "skipped": count[SKIPPED],
        "errors": count[ERROR],
        "resolved_rate": count[RESOLVED] / ran if ran else 0.0,
        "wall_s": round(sum(r.wall_s for r in results), 3),  # summed over tasks (workers overlap them)
        "turns": sum(r.turns for r in results),
        "tokens_in": sum(r.tokens_in for r in results),
        "tokens_out": sum(r.tokens_out for r in results),
    }


def _flatten(stats: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in stats.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def engine_value(result: TaskResult, key: str) -> float | None:
    """One engine statistic as a number: ``key`` itself or a nested ``*.key`` (e.g. ``kv.prefix_hit_rate``);
    a per-turn list such as ``ttft_s`` is averaged."""
    flat = _flatten(result.engine)
    value = flat.get(key, next((v for k, v in flat.items() if k.endswith("." + key)), None))
    if isinstance(value, list):
        numbers = [v for v in value if isinstance(v, (int, float))]
        value = sum(numbers) / len(numbers) if numbers else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _engine_columns(results: list[TaskResult]) -> list[tuple[str, str]]:
    return [(k, title) for k, title in ENGINE_COLUMNS if any(engine_value(r, k) is not None for r in results)]


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def task_rows(results: list[TaskResult]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the per-task table (engine columns only when some task has them)."""
    engine = _engine_columns(results)
    header = ["task", "status", "wall s", "turns", "tokens in", "tokens out", *[t for _, t in engine], "reason"]
    rows = []
    for r in results:
        rows.append([r.instance_id, r.status, f"{r.wall_s:.1f}", str(r.turns), str(r.tokens_in), str(r.tokens_out),
                     *[_fmt(engine_value(r, k)) for k, _ in engine], r.reason])
    return header, rows


def _summary_line(summary: dict[str, Any]) -> str:
    return (f"resolved {summary['resolved']}/{summary['total'] - summary['skipped']} "
            f"({100 * summary['resolved_rate']:.1f}%), skipped {summary['skipped']}, errors {summary['errors']}, "
            f"task time {summary['wall_s']:.1f}s, tokens {summary['tokens_in']} in / {summary['tokens_out']} out")


def markdown(results: list[TaskResult], meta: dict[str, Any]) -> str:
    """The Markdown report: what ran, the summary, the per-task table."""
    summary = summarize(results)
    header, rows = task_rows(results)
    lines = [f"# Eval report: {meta.get('tasks', '?')}", "",
             f"- agent: `{meta.get('agent', '?')}`" + (f", model: `{meta['model']}`" if meta.get("model") else ""),
             f"- {_summary_line(summary)}", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_reports(store: RunStore, order: list[str] | None = None) -> dict[str, Any]:
    """Write ``report.json`` and ``report.md`` into the run folder from its results; return the summary."""
    results = ordered(store, order)
    meta = store.meta()
    summary = summarize(results)
    report = {"meta": meta, "summary": summary, "tasks": [asdict(r) for r in results]}
    (store.dir / "report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (store.dir / "report.md").write_text(markdown(results, meta), encoding="utf-8")
    return summary


def ordered(store: RunStore, order: list[str] | None = None) -> list[TaskResult]:
    """The run's results, in task order when given (else in id order)."""
    results = store.load()
    ids = [i for i in (order or sorted(results)) if i in results]
    return [results[i] for i in ids]


def print_table(results: list[TaskResult], console: Console, title: str = "") -> None:
    """The per-task table and the summary line, for the terminal."""
    header, rows = task_rows(results)
    table = Table(title=title or None)
    for name in header:
        table.add_column(name, justify="right" if name not in ("task", "status", "reason") else "left",
                         no_wrap=name != "reason", overflow="fold")
    style = {RESOLVED: "green", SKIPPED: "yellow", ERROR: "red"}
    for row, r in zip(rows, results):
        table.add_row(*row, style=style.get(r.status))
    console.print(table)
    console.print(_summary_line(summarize(results)))


def load_run(path: Path) -> RunStore:
    """A finished (or partial) run folder; ``EvalError`` when it holds no results."""
    store = RunStore(path)
    if not store.results_path.exists():
        raise EvalError(f"{path} is not a run folder (no results.jsonl)")
    return store


def compare(a: Path, b: Path) -> dict[str, Any]:
    """Two runs side by side: per task both statuses and costs, plus which tasks only one run resolved."""
    runs = [load_run(a), load_run(b)]
    results = [s.load() for s in runs]
    ids = sorted(set(results[0]) | set(results[1]))
    rows = []
    for i in ids:
        ra, rb = results[0].get(i), results[1].get(i)
        rows.append({"instance_id": i,
                     "a": None if ra is None else {"status": ra.status, "wall_s": ra.wall_s, "tokens_out": ra.tokens_out},
                     "b": None if rb is None else {"status": rb.status, "wall_s": rb.wall_s, "tokens_out": rb.tokens_out}})

    def resolved(side: int) -> set[str]:
        return {i for i, r in results[side].items() if r.status == RESOLVED}

    return {
        "a": {"dir": str(a), "meta": runs[0].meta(), "summary": summarize(list(results[0].values()))},
        "b": {"dir": str(b), "meta": runs[1].meta(), "summary": summarize(list(results[1].values()))},
        "only_a": sorted(resolved(0) - resolved(1)),
        "only_b": sorted(resolved(1) - resolved(0)),
        "both": sorted(resolved(0) & resolved(1)),
        "tasks": rows,
    }


def print_comparison(cmp: dict[str, Any], console: Console) -> None:
    """Render ``compare``'s result as one table plus the summary of each run."""
    table = Table(title="A vs B")
    for name in ("task", "A status", "A wall s", "A tok out", "B status", "B wall s", "B tok out"):
        table.add_column(name, justify="left" if name in ("task", "A status", "B status") else "right")
    for row in cmp["tasks"]:
        cells = [row["instance_id"]]
        for side in ("a", "b"):
            r = row[side]
            cells += ["-", "-", "-"] if r is None else [r["status"], f"{r['wall_s']:.1f}", str(r["tokens_out"])]
        table.add_row(*cells, style="bold" if row["instance_id"] in cmp["only_a"] + cmp["only_b"] else None)
    console.print(table)
    for side in ("a", "b"):
        meta = cmp[side]["meta"]
        console.print(f"{side.upper()}: {cmp[side]['dir']} (agent {meta.get('agent', '?')}): "
                      f"{_summary_line(cmp[side]['summary'])}")
    console.print(f"resolved by both: {len(cmp['both'])}, only A: {len(cmp['only_a'])}, only B: {len(cmp['only_b'])}")


def comparison_markdown(cmp: dict[str, Any]) -> str:
    """``compare``'s result as Markdown: both summaries, then one row per task."""
    lines = ["# Eval comparison", ""]
    for side in ("a", "b"):
        meta = cmp[side]["meta"]
        lines.append(f"- **{side.upper()}**: `{cmp[side]['dir']}` (agent `{meta.get('agent', '?')}`"
                     + (f", model `{meta['model']}`" if meta.get("model") else "") + "): "
                     + _summary_line(cmp[side]["summary"]))
    lines += [f"- resolved by both: {len(cmp['both'])}, only A: {len(cmp['only_a'])}, only B: {len(cmp['only_b'])}",
              "", "| task | A status | A wall s | A tokens out | B status | B wall s | B tokens out |",
              "|---|---|---|---|---|---|---|"]
    for row in cmp["tasks"]:
        cells = [row["instance_id"]]
        for side in ("a", "b"):
            r = row[side]
            cells += ["-", "-", "-"] if r is None else [r["status"], f"{r['wall_s']:.1f}", str(r["tokens_out"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
