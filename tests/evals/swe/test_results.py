"""The run folder's predictions: patches stored losslessly, and appends after a crash mid-line still read back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from freetoken_agent.evals.swe.results import RESOLVED, RunStore, TaskResult, prediction, prediction_patch
from freetoken_agent.evals.swe.task import EvalError

CRLF_PATCH = b"diff --git a/w.txt b/w.txt\n--- a/w.txt\n+++ b/w.txt\n@@ -1 +1 @@\n-a\r\n+b\r\n"
LATIN1_PATCH = CRLF_PATCH.replace(b"+b", b"+caf\xe9")


def test_predictions_hold_the_exact_bytes() -> None:
    utf8 = json.loads(json.dumps(prediction("t", "m", CRLF_PATCH)))
    assert utf8 == {"instance_id": "t", "model_name_or_path": "m", "model_patch": CRLF_PATCH.decode()}
    latin1 = json.loads(json.dumps(prediction("t", "m", LATIN1_PATCH)))
    assert prediction_patch(latin1) == LATIN1_PATCH
    assert prediction_patch({"model_patch": latin1["model_patch"]}) == LATIN1_PATCH  # Python readers need no base64
    with pytest.raises(ValueError, match="model_patch_base64 is not base64"):
        prediction_patch({**latin1, "model_patch_base64": "not base64!"})


def test_an_append_after_a_torn_line_is_read(tmp_path: Path) -> None:
    store = RunStore(tmp_path)
    store.append(TaskResult("a", RESOLVED), CRLF_PATCH, "m")
    whole = store.predictions_path.read_bytes()
    store.predictions_path.write_bytes(whole + whole[:30])  # a crash while writing the next line
    store.append(TaskResult("b", RESOLVED), LATIN1_PATCH, "m")
    assert store.predictions() == {"a": CRLF_PATCH, "b": LATIN1_PATCH}
    store.predictions_path.write_bytes(whole + b'{"instance_id": "c"}\n')
    with pytest.raises(EvalError, match=r"predictions.jsonl:2: not a prediction record"):
        store.predictions()
