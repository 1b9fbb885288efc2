"""Tiny synthetic mini-swe-agent trajectories for the built-in model tests (the real data is never needed)."""

from __future__ import annotations

import json
from pathlib import Path

SYSTEM = "You are a helpful assistant that can interact multiple times with a computer shell to solve programming tasks."


def write_session(folder: Path, instance_id: str, turns: list[tuple[str, str, str]]) -> Path:
    """Write ``folder/<instance_id>.traj.json``: a task, then (thought, command, output) turns, then a final answer."""
    messages: list[dict] = [{"role": "system", "content": SYSTEM},
                            {"role": "user", "content": f"<pr_description>Fix the bug in {instance_id}.</pr_description>"}]
    for thought, command, output in turns:
        messages.append({"role": "assistant", "content": f"{thought}\n\n```bash\n{command}\n```"})
        messages.append({"role": "user", "content": [{"type": "text",
                         "text": f"<returncode>0</returncode>\n<output>\n{output}\n</output>"}]})
    messages.append({"role": "assistant", "content": "THOUGHT: The fix is complete."})
    path = folder / f"{instance_id}.traj.json"
    path.write_text(json.dumps({"trajectory_format": "mini-swe-agent-1", "instance_id": instance_id,
                                "messages": messages}))
    return path
