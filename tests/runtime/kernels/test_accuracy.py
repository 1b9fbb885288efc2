"""``python -m freetoken_agent.runtime.kernels.accuracy`` on the built-in model: rows, references, the table."""

from __future__ import annotations

import pytest
from freetoken_agent.runtime.kernels import build
from freetoken_agent.runtime.kernels.accuracy import main


def test_accuracy_table_on_the_builtin_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--tokens", "24", "--quant", "q8"]) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| q8")]
    modes = {r[1].strip(): r for r in rows}
    assert set(modes) == ({"exact", "int8"} if build.load() is not None else {"exact"})
    exact = modes["exact"]
    assert float(exact[4]) == 0.0  # exact mode is the dequantized-weights engine, bit for bit
    assert float(exact[2]) >= 0.9 and float(exact[3]) < 0.01  # q8 barely moves the trained model
