"""An agent with a custom tool next to the coding tools.

`python examples/custom_tool_agent.py MODEL_DIR` runs it on a local model; without arguments a scripted model
plays the calls, so the example runs anywhere.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from freetoken_agent import Agent, LocalEngine, ScriptedBackend, tool
from freetoken_agent.tools import ToolContext, ToolError


@tool(kind="read", expected_s=0.1)
def todo_report(ctx: ToolContext, extension: str = ".py") -> dict:
    """List the TODO comments in the workspace.

    Args:
        extension: Only look at files ending with this.
    """
    if not extension.startswith("."):
        raise ToolError(f"extension must start with '.', got {extension!r}")
    found = {}
    for path in sorted(ctx.workspace.root.rglob(f"*{extension}")):
        lines = [n for n, line in enumerate(path.read_text().splitlines(), 1) if "TODO" in line]
        if lines:
            found[str(path.relative_to(ctx.workspace.root))] = lines
    return found


def scripted() -> ScriptedBackend:
    call = {"name": "todo_report", "arguments": {"extension": "py"}}  # a mistake the tool reports back
    fixed = {"name": "todo_report", "arguments": {"extension": ".py"}}
    return ScriptedBackend([f"<tool_call>\n{json.dumps(call)}\n</tool_call>",
                            f"<tool_call>\n{json.dumps(fixed)}\n</tool_call>",
                            lambda request: "TODOs: " + request.messages[-1]["content"]])


def main() -> None:
    workspace = Path(tempfile.mkdtemp())
    (workspace / "app.py").write_text("x = 1  # TODO: rename\n\ndef f():\n    pass  # TODO: implement\n")
    backend = LocalEngine.from_pretrained(sys.argv[1]) if len(sys.argv) > 1 else scripted()
    agent = Agent(backend=backend, tools=[todo_report], workspace=workspace,
                  instructions="You report TODO comments. Call todo_report, then answer with what it found.")
    result = agent.run_sync("Which TODOs are left in this project?")
    for message in result.messages[2:]:
        print(f"{message['role']:>9}: {message.get('content') or message.get('tool_calls')}")
    print(f"{result.stop_reason} after {result.steps} steps: {result.final_message}")


if __name__ == "__main__":
    main()
