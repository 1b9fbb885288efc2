"""A minimal coding agent: `python examples/coding_agent.py MODEL_DIR REPO "fix the failing test"`.

Without arguments it plays a short scripted session on a throwaway repository, so it runs anywhere.
"""

import sys
import tempfile
from pathlib import Path

import anyio

from freetoken_agent import Agent, LocalEngine, ScriptedBackend
from freetoken_agent.events import PhaseChanged, TextDelta, ToolCallFinished


def demo() -> tuple[ScriptedBackend, str, str]:
    repo = Path(tempfile.mkdtemp()) / "repo"
    repo.mkdir()
    (repo / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    call = '<tool_call>\n{"name": "edit_file", "arguments": {"path": "calc.py", ' \
           '"old_string": "a - b", "new_string": "a + b"}}\n</tool_call>'
    return ScriptedBackend(["Fixing the sign.\n" + call, "Fixed add()."]), str(repo), "add() is wrong; fix it"


async def main() -> None:
    if len(sys.argv) == 4:
        backend, repo, task = LocalEngine.from_pretrained(sys.argv[1]), sys.argv[2], sys.argv[3]
    else:
        backend, repo, task = demo()
    agent = Agent.coding(backend, workspace=repo)
    async for event in agent.stream(task):
        if isinstance(event, PhaseChanged):
            print(f"\n[{event.phase.value}]", end=" ", flush=True)
        elif isinstance(event, TextDelta):
            print(event.text, end="", flush=True)
        elif isinstance(event, ToolCallFinished):
            print(f"\n{event.name}({event.arguments}) -> {event.content.splitlines()[0]}")
    print(f"\n{event.result.stop_reason}: {event.result.final_message}")


anyio.run(main)
