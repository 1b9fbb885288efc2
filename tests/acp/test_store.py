"""Saved sessions: atomic records, lookups that cannot leave the folder, and paged listings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from freetoken_agent.acp.jsonrpc import INVALID_PARAMS, RESOURCE_NOT_FOUND, RpcError
from freetoken_agent.acp.store import PAGE_SIZE, SessionStore


def test_save_load_and_refuse_ids_that_are_not_session_ids(tmp_path: Path) -> None:
    store = SessionStore(tmp_path / "s")
    store.save({"id": "sess_a", "cwd": "/w", "history": [{"role": "user", "content": "hi"}], "saved": 1.0})
    assert store.load("sess_a")["history"][0]["content"] == "hi"
    assert not list((tmp_path / "s").glob(".*tmp"))  # the temporary file was renamed into place
    (tmp_path / "outside.json").write_text(json.dumps({"id": "x", "cwd": "/w"}))
    for bad in ("../outside", "sess_missing", "", ".hidden", "a/b", "x" * 300):
        with pytest.raises(RpcError) as err:
            store.load(bad)
        assert err.value.code == RESOURCE_NOT_FOUND


def test_list_pages_newest_first_filters_by_cwd_and_skips_damaged_files(tmp_path: Path) -> None:
    store = SessionStore(tmp_path)
    count = PAGE_SIZE * 2 + 7
    for i in range(count):
        store.save({"id": f"sess_{i:03d}", "cwd": "/work/a" if i % 2 else "/work/b", "title": f"task {i}",
                    "history": [], "saved": 1000.0 + i})
    (tmp_path / "sess_bad.json").write_text("{broken")
    seen: list[str] = []
    cursor = None
    while True:
        page = store.list(cursor=cursor)
        seen += [info["sessionId"] for info in page["sessions"]]
        cursor = page.get("nextCursor")
        if cursor is None:
            break
    assert seen == [f"sess_{i:03d}" for i in reversed(range(count))]
    only_a = store.list(cwd="/work/a")["sessions"]
    newest_a = max(i for i in range(count) if i % 2)
    assert {info["cwd"] for info in only_a} == {"/work/a"} and only_a[0]["title"] == f"task {newest_a}"
    assert only_a[0]["updatedAt"].startswith("1970-01-01T00:")
    with pytest.raises(RpcError) as err:
        store.list(cursor="abc")
    assert err.value.code == INVALID_PARAMS
    assert SessionStore(tmp_path / "none").list() == {"sessions": []}
