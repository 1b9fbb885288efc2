"""run_tests: real pytest runs in a temp project, summarised for the model."""

from __future__ import annotations

import time
import venv
from pathlib import Path

import pytest
from freetoken_agent.tools import ToolContext, ToolRegistry, Workspace
from freetoken_agent.tools.shell import summarize_pytest

pytestmark = pytest.mark.anyio


@pytest.fixture
def fast_ctx(root: Path) -> ToolContext:
    # plugin autoload costs seconds per run on a busy machine; the temp project needs no plugins
    return ToolContext(Workspace(root), timeout_s=60.0, env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})


@pytest.fixture
def project(root: Path) -> Path:
    (root / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    (root / "tests").mkdir()
    (root / "tests" / "test_calc.py").write_text(
        "from calc import add\n\n"
        "def test_add():\n    assert add(1, 2) == 3\n\n"
        "def test_zero():\n    assert add(0, 0) == 0\n\n"
        "def test_negative():\n    assert add(-1, -1) == -2\n"
    )
    (root / "pytest.ini").write_text("[pytest]\npythonpath = .\n")
    return root


async def test_failing_then_fixed(project: Path, fast_ctx: ToolContext, registry: ToolRegistry) -> None:
    failing = await registry.call("run_tests", {}, fast_ctx)
    assert not failing.is_error
    assert failing.content.startswith(
        "pytest: 1 passed, 2 failed (exit code 1)\nFailing tests:\n"
        "  tests/test_calc.py::test_add\n  tests/test_calc.py::test_negative\nOutput (tail):\n"
    )
    assert "assert -1 == 3" in failing.content
    assert failing.data is not None
    assert failing.data["failing"] == ["tests/test_calc.py::test_add", "tests/test_calc.py::test_negative"]
    assert (failing.data["passed"], failing.data["failed"], failing.data["exit_code"]) == (1, 2, 1)

    edit = await registry.call("edit_file", {"path": "calc.py", "old_string": "a - b", "new_string": "a + b"}, fast_ctx)
    assert not edit.is_error
    fixed = await registry.call("run_tests", {"paths": ["tests"]}, fast_ctx)
    assert fixed.content.startswith("pytest: 3 passed (exit code 0)\nOutput (tail):")
    assert fixed.data is not None and fixed.data["failing"] == [] and fixed.data["exit_code"] == 0


async def test_select_by_id_and_keyword(project: Path, fast_ctx: ToolContext, registry: ToolRegistry) -> None:
    one = await registry.call("run_tests", {"paths": ["tests/test_calc.py::test_zero"]}, fast_ctx)
    assert one.content.startswith("pytest: 1 passed (exit code 0)")
    keyword = await registry.call("run_tests", {"keyword": "negative"}, fast_ctx)
    assert keyword.data is not None and (keyword.data["failed"], keyword.data["passed"]) == (1, 0)
    missing = await registry.call("run_tests", {"paths": ["tests/test_nope.py"]}, fast_ctx)
    assert missing.is_error and "test path 'tests/test_nope.py' does not exist" in missing.content


async def test_collection_error_and_no_tests(root: Path, fast_ctx: ToolContext, registry: ToolRegistry) -> None:
    none = await registry.call("run_tests", {}, fast_ctx)
    assert none.content.startswith("pytest: no tests were collected (exit code 5)")
    (root / "test_broken.py").write_text("def test_x(:\n    pass\n")
    broken = await registry.call("run_tests", {}, fast_ctx)
    assert broken.content.startswith("pytest: 1 error (exit code 2)\nFailing tests:\n  test_broken.py\n")
    assert "SyntaxError" in broken.content


async def test_timeout(root: Path, registry: ToolRegistry) -> None:
    (root / "test_slow.py").write_text("import time\n\ndef test_slow():\n    time.sleep(60)\n")
    ctx = ToolContext(Workspace(root), env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
    start = time.monotonic()
    result = await registry.call("run_tests", {"timeout_s": 2}, ctx)
    assert time.monotonic() - start < 2 + 2.5
    assert result.is_error and result.content.startswith("The test run timed out after 2 s")
    assert result.data is not None and result.data["timed_out"] is True


def test_summarize_pytest_variants() -> None:
    output = (
        "..F.sE\n"
        "FAILED tests/a.py::test_one[param-1] - AssertionError: x\n"
        "ERROR tests/b.py::test_two - RuntimeError\n"
        "1 failed, 3 passed, 1 skipped, 1 error, 2 warnings in 0.31s\n"
    )
    summary = summarize_pytest(output)
    assert summary == {
        "passed": 3,
        "failed": 1,
        "errors": 1,
        "skipped": 1,
        "warnings": 2,
        "failing": ["tests/a.py::test_one[param-1]", "tests/b.py::test_two"],
    }
    verbose = "===== 2 passed, 1 xfailed in 1.02s ====="
    assert summarize_pytest(verbose)["passed"] == 2 and summarize_pytest(verbose)["xfailed"] == 1


async def test_interpreter_without_pytest(root: Path, registry: ToolRegistry, tmp_path: Path) -> None:
    venv.create(tmp_path / "bare", with_pip=False)  # a real interpreter with no pytest installed
    python = tmp_path / "bare" / "bin" / "python"
    ctx = ToolContext(Workspace(root), python=str(python))
    result = await registry.call("run_tests", {}, ctx)
    assert result.is_error and result.content.startswith(f"pytest is not installed for {python}")
