"""Trajectory files after crashes: a torn last line is skipped with a warning, a run appended after it reads back
whole, corruption inside a run is a clear error, and any text (line separators, surrogates) round-trips."""

from __future__ import annotations

import warnings
from pathlib import Path

import anyio
import pytest

from freetoken_agent import Agent, ScriptedBackend
from freetoken_agent.trajectory import (
    TrajectoryError,
    TrajectoryWarning,
    TrajectoryWriter,
    assistant_turns,
    read_trajectory,
)
from tests.sdk.conftest import hermes_call

# Non-ASCII text is written raw (ensure_ascii=False), so cuts can fall inside a multi-byte character.
SCRIPT = [hermes_call("read_file", {"path": "calc.py"}, "Lecture du code — étape 1 ✓\n"),
          "Fini: rien à changer ✓"]


def run_agent(repo: Path, path: Path, task: str) -> None:
    result = anyio.run(Agent.coding(ScriptedBackend(list(SCRIPT)), workspace=repo, trajectory=path).run, task)
    assert result.ok


def read(path: Path) -> tuple[list[dict], list[str]]:
    """The records, and the messages of the TrajectoryWarnings raised while reading."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records = list(read_trajectory(path))
    return records, [str(w.message) for w in caught if issubclass(w.category, TrajectoryWarning)]


@pytest.fixture
def one_run(repo: Path, tmp_path: Path) -> tuple[Path, bytes, list[dict]]:
    """A real run's trajectory file, its bytes and its records."""
    path = tmp_path / "t.jsonl"
    run_agent(repo, path, "première tâche")
    records, warned = read(path)
    assert records[0]["type"] == "run_started" and records[-1]["type"] == "run_finished" and not warned
    return path, path.read_bytes(), records


def test_every_cut_inside_the_last_record_is_skipped_with_a_warning(one_run: tuple[Path, bytes, list[dict]]) -> None:
    path, data, records = one_run
    lines = data.split(b"\n")[:-1]
    start = len(data) - len(lines[-1]) - 1  # where the last record begins
    for cut in range(start + 1, len(data) - 1):  # every byte boundary, inside multi-byte characters too
        path.write_bytes(data[:cut])
        got, warned = read(path)
        assert got == records[:-1], cut
        assert warned == [f"{path}:{len(lines)}: skipped a torn line (a writer was killed mid-record)"], cut
    path.write_bytes(data[:-1])  # the record is whole, only its newline is missing: nothing is lost
    assert read(path) == (records, [])


def is_assistant(record: dict) -> bool:
    return record["type"] == "message" and record["message"]["role"] == "assistant"


@pytest.mark.parametrize("torn", ["run_finished", "assistant", "text"])
def test_a_run_appended_after_a_torn_line_reads_back_whole(one_run: tuple[Path, bytes, list[dict]], repo: Path,
                                                          torn: str) -> None:
    path, data, records = one_run
    lines = data.split(b"\n")
    index = max(i for i, r in enumerate(records) if (is_assistant(r) if torn == "assistant" else r["type"] == torn))
    cut = sum(len(line) + 1 for line in lines[:index]) + len(lines[index]) // 2  # the crash: half of that line
    path.write_bytes(data[:cut])
    run_agent(repo, path, "deuxième tâche")
    got, warned = read(path)
    assert got[:index] == records[:index]  # the first run up to the torn line ...
    second = got[index:]  # ... then the whole second run
    assert second[0]["type"] == "run_started" and second[0]["task"] == "deuxième tâche"
    assert [r["type"] for r in second] == [r["type"] for r in records]
    assert warned == [f"{path}:{index + 1}: skipped a torn line (a writer was killed mid-record)"]
    # the replay script: the assistant messages of both runs but the last of the first (lost with the crash,
    # unless only run_finished was torn)
    with pytest.warns(TrajectoryWarning, match=f":{index + 1}: skipped a torn line"):
        turns = assistant_turns(path)
    assert turns == [r["message"] for r in records[:index] + second if is_assistant(r)]
    assert len(turns) == len(SCRIPT) * 2 - (torn != "run_finished")


def test_torn_lines_of_two_crashes_in_a_row_and_an_older_writers_swallowed_record(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    writer = TrajectoryWriter(path)
    writer.write({"type": "run_started", "task": "a"})
    writer.close()
    whole = path.read_bytes()
    # two torn lines (the second run died writing its first record), then a third run, written by an older
    # writer that did not start on a new line: its first record is glued to the torn fragment
    path.write_bytes(whole + whole[:20] + b"\n" + whole[:15] + whole.replace(b'"a"', b'"c"'))
    writer = TrajectoryWriter(path)
    writer.write({"type": "run_finished", "stop_reason": "done"})
    writer.close()
    records, warned = read(path)
    assert [(r["type"], r.get("task")) for r in records] == [("run_started", "a"), ("run_started", "c"),
                                                             ("run_finished", None)]
    assert [w.split(": ")[0] for w in warned] == [f"{path}:2", f"{path}:3"]


@pytest.mark.parametrize("bad", [b'{"t": 1.0, "type": "mess', b"\xff\xfe not utf-8", b"{]"])
def test_an_unreadable_line_inside_a_run_is_a_clear_error(tmp_path: Path, bad: bytes) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(b'{"type": "run_started"}\n' + bad + b'\n{"type": "message", "message": {}}\n')
    with pytest.raises(TrajectoryError, match=rf"^{path}:2: not a JSON line .*line 3, is a 'message'"):
        list(read_trajectory(path))
    path.write_bytes(b'{"type": "run_started"}\n[1, 2]\n')
    with pytest.raises(TrajectoryError, match=rf"^{path}:2: a trajectory record must be an object with a 'type'"):
        list(read_trajectory(path))


def test_any_text_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    texts = ["line\u2028separator\u2029para\x85next\x1cfs\rcr", "surrogate \udce9 from a non-UTF-8 byte", "é✓"]
    writer = TrajectoryWriter(path)
    for text in texts:
        writer.write({"type": "text", "text": text})
    writer.close()
    records, warned = read(path)
    assert [r["text"] for r in records] == texts and not warned
    assert path.read_bytes().count(b"\n") == len(texts)
