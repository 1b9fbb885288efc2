"""The harness on files whose bytes matter: CRLF, mixed line endings, no trailing newline, binary files, a file
name and content that are not UTF-8, Unicode line separators, under a ``.gitattributes`` that would convert line endings.

One upstream repository, one SWE-bench instance per kind of file. Each instance's test patch adds a test that
checks behaviour and the exact bytes of the fixed file, so a patch that loses a CR, a missing final newline or a
binary change leaves the task unresolved. The gold agent (``git apply`` of the gold patch) and an agent that
writes the fixed bytes itself must resolve every instance; the empty agent must resolve none.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import anyio
import pytest
from freetoken_agent.evals.swe.agents import AgentOutcome, EmptyAgent, GoldAgent
from freetoken_agent.evals.swe.gitops import git, patch_bytes
from freetoken_agent.evals.swe.harness import HarnessConfig, run_pending
from freetoken_agent.evals.swe.results import RunStore
from freetoken_agent.evals.swe.task import Task, load_tasks

from tests.evals.swe.support import diff, make_repo

FAST = {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
LATIN1_NAME = os.fsdecode(b"data/caf\xe9.txt")  # not UTF-8: a surrogate stands for the byte 0xE9
BLOB = bytes(range(256)) * 3 + b"\r\n\x00tail"

BASE: dict[str, str | bytes] = {
    # Normal git would check LF blobs out with CRLF here and strip CRs when adding: the harness must not.
    ".gitattributes": b"* text=auto eol=crlf\n",
    "edges/__init__.py": b"",
    "edges/lf.py": b"X = 1\n",
    "edges/win.py": b"def greet(name):\r\n    return 'hello ' + name\r\n\r\n\r\n"
                    b"def shout(name):\r\n    return greet(name).lower()\r\n",
    "edges/tail.py": b"LIMIT = 3\nSCALE = 1",
    "edges/mixed.txt": b"one\r\ntwo\nthree\r\nfour",
    "edges/notes.md": "intro\u2028line\x85next\u2029end\n".encode(),  # Unicode line separators, one line to git
    "data/blob.bin": BLOB,
    "data/old.bin": b"\x00\xff old",
    LATIN1_NAME: b"na\xefve\r\n",
    "tests/test_base.py": """
        def test_checkout_is_raw():
            assert open("edges/lf.py", "rb").read() == b"X = 1\\n"
            assert open("edges/win.py", "rb").read().count(b"\\r\\n") == 6
        """,
}

# instance -> the fixed bytes of each file it changes (None: deleted), and the extra check of its test
FIXES: dict[str, tuple[dict[str, bytes | None], str]] = {
    "crlf": ({"edges/win.py": BASE["edges/win.py"].replace(b".lower()", b".upper()")},  # type: ignore[union-attr]
             "from edges.win import shout\n    assert shout('ada') == 'HELLO ADA'"),
    "no_newline": ({"edges/tail.py": b"LIMIT = 3\nSCALE = 10"},
                   "from edges.tail import SCALE\n    assert SCALE == 10"),
    "mixed_endings": ({"edges/mixed.txt": b"one\r\nTWO\nthree\r\nfour\n"}, ""),
    "binary": ({"data/blob.bin": BLOB[:100] + b"\x00\x01\r\n" + BLOB[103:] + b"\xff", "data/old.bin": None,
                "data/new.bin": b"\x89PNG\r\n\x1a\n\x00\x00"}, ""),
    "non_utf8": ({LATIN1_NAME: b"na\xefve caf\xe9\r\n"}, ""),
    "separators": ({"edges/notes.md": "intro\u2028line\x85NEXT\u2029end\n".encode()}, ""),
}


def expect_bytes(path: str, content: bytes | None) -> str:
    """Test source asserting the exact bytes of ``path`` (a bytes literal, so a name that is not UTF-8 works)."""
    name = os.fsencode(path)
    if content is None:
        return f"    assert not os.path.exists({name!r})\n"
    return f"    assert hashlib.sha256(open({name!r}, 'rb').read()).hexdigest() == " \
           f"{hashlib.sha256(content).hexdigest()!r}\n"


def edge_tasks(root: Path) -> list[dict]:
    """The upstream repository (base, one fix commit and one test commit per instance) and its instances."""
    repo = root / "edges"
    base = make_repo(repo, BASE, "base")
    rows = []
    for name, (fixed_files, check) in FIXES.items():
        git(repo, "checkout", "-q", "--detach", base)
        fixed = make_repo(repo, fixed_files, f"fix {name}")
        body = "".join(expect_bytes(p, c) for p, c in fixed_files.items())
        test = f"import hashlib\nimport os\n\n\ndef test_{name}():\n" + (f"    {check}\n" if check else "") + body
        tested = make_repo(repo, {f"tests/test_{name}.py": test}, f"test {name}")
        rows.append({"instance_id": name, "repo": str(repo), "base_commit": base, "problem_statement": name,
                     "patch": diff(repo, base, fixed), "test_patch": diff(repo, fixed, tested),
                     "FAIL_TO_PASS": [f"tests/test_{name}.py::test_{name}"],
                     "PASS_TO_PASS": ["tests/test_base.py::test_checkout_is_raw"], "env": FAST})
    return rows


class RawEditAgent:
    """Writes the fixed bytes into the workspace itself, as an agent's edit tool would: its diff comes from the
    harness's capture alone, not from a patch it was given."""

    name = "raw-edit"

    async def solve(self, task: Task, workspace: Path, log_dir: Path) -> AgentOutcome:
        for rel, content in FIXES[task.instance_id][0].items():
            path = workspace / rel
            if content is None:
                path.unlink()
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(content)
        return AgentOutcome(final_message="edited")


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> list[Task]:
    root = tmp_path_factory.mktemp("edges")
    path = root / "tasks.jsonl"
    # Through a SWE-bench JSONL as users load it, raw Unicode as Hugging Face exports write it (U+2028 and U+0085
    # unescaped); the surrogates that carry non-UTF-8 bytes are written as JSON escapes.
    rows = edge_tasks(root)
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8",
                    errors="backslashreplace")
    assert "\u2028".encode() in path.read_bytes()
    return load_tasks(path)


def run(agent: object, tasks: list[Task], out: Path) -> tuple[dict[str, object], RunStore]:
    store = RunStore(out)
    store.start({"agent": getattr(agent, "name")}, resume=False)
    results = anyio.run(run_pending, tasks, agent, store, HarnessConfig(workers=len(tasks)))
    return {r.instance_id: r for r in results}, store


def test_the_patches_really_are_edge_cases(tasks: list[Task]) -> None:
    patches = {t.instance_id: patch_bytes(t.patch) for t in tasks}
    assert patches["crlf"].count(b"\r\n") >= 3
    assert b"\\ No newline at end of file" in patches["no_newline"]
    assert b"GIT binary patch" in patches["binary"] and b"deleted file mode" in patches["binary"]
    assert b'"a/data/caf\\351.txt"' in patches["non_utf8"] and b"caf\xe9\r\n" in patches["non_utf8"]
    with pytest.raises(UnicodeDecodeError):
        patches["non_utf8"].decode("utf-8")


@pytest.mark.parametrize("agent", [GoldAgent(), RawEditAgent()], ids=["gold", "raw-edit"])
def test_gold_and_raw_edits_resolve_every_edge_case(agent: object, tasks: list[Task], tmp_path: Path) -> None:
    results, store = run(agent, tasks, tmp_path / "run")
    assert {i: (r.status, r.reason) for i, r in results.items()} == {t.instance_id: ("resolved", "") for t in tasks}
    predictions = store.predictions()
    for task in tasks:
        # The captured diff is byte for byte the gold patch (same diff of the same blobs), stored losslessly.
        model_patch = (store.dir / "tasks" / task.instance_id / "model.patch").read_bytes()
        assert model_patch == patch_bytes(task.patch), task.instance_id
        assert predictions[task.instance_id] == model_patch
        assert results[task.instance_id].patch_bytes == len(model_patch)
    record = next(json.loads(ln) for ln in store.predictions_path.read_text().splitlines() if '"non_utf8"' in ln)
    assert "model_patch_base64" in record  # the only patch that is not UTF-8


def test_the_empty_agent_resolves_none(tasks: list[Task], tmp_path: Path) -> None:
    results, _ = run(EmptyAgent(), tasks, tmp_path / "run")
    for task in tasks:
        result = results[task.instance_id]
        assert result.status == "unresolved" and result.reason.startswith("empty patch"), task.instance_id
        assert result.fail_to_pass["failure"] == task.FAIL_TO_PASS  # the deciding test ran and failed
        assert result.pass_to_pass["success"] == task.PASS_TO_PASS  # the raw checkout check passed

