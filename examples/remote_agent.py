"""An agent against a remote OpenAI-compatible server (vLLM, SGLang, llama.cpp, or `freetoken serve`).

    freetoken serve --model MODEL_DIR --port 8000          # or: vllm serve ... --enable-auto-tool-choice
    python examples/remote_agent.py http://localhost:8000/v1 REPO "make the tests pass"

Without arguments it starts a local server in a thread (backed by a scripted model) and talks to it over HTTP.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
from pathlib import Path

from freetoken_agent import Agent, Limits, OpenAICompatible, ScriptedBackend
from freetoken_agent.server import serve_in_thread


def main() -> None:
    with contextlib.ExitStack() as stack:
        if len(sys.argv) == 4:
            url, repo, task = sys.argv[1:]
        else:
            repo = tempfile.mkdtemp()
            (Path(repo) / "notes.txt").write_text("remote agents work\n")
            model = ScriptedBackend(['<tool_call>\n{"name": "read_file", "arguments": {"path": "notes.txt"}}'
                                     "\n</tool_call>", "The notes say: remote agents work."])
            url, task = stack.enter_context(serve_in_thread(model, "scripted")), "What do the notes say?"
        agent = Agent.coding(OpenAICompatible(url), workspace=repo, limits=Limits(max_steps=20, max_wall_s=600))
        result = agent.run_sync(task)
    print(f"{result.stop_reason} in {result.steps} steps ({result.usage.completion_tokens} tokens): "
          f"{result.final_message}")


if __name__ == "__main__":
    main()
