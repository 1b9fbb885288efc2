"""``--threads N`` reaches the engine (torch's threads and the kernels' pool) in every command that loads a model.

It used to set torch's count in the CLI only; ``Engine.from_pretrained`` then chose "the free cores" itself, so on a
busy machine ``freetoken serve --threads 2`` ran on one thread (a 7.5B model's prefill at half speed)."""

from __future__ import annotations

from pathlib import Path

import pytest
from freetoken_agent.cli import build_parser
from freetoken_agent.cli.budget import engine_kwargs
from freetoken_agent.cli.run import agent_engine_kwargs
from freetoken_agent.runtime.engine import Engine
from freetoken_agent.runtime.kernels import ops

from tests.runtime.arch_configs import save_checkpoint


@pytest.mark.parametrize("argv", [["serve"], ["generate", "--prompt", "hi"], ["run", "task"], ["acp"]])
def test_every_loading_command_passes_threads(argv: list[str]) -> None:
    args = build_parser().parse_args([*argv, "--threads", "2"])
    kwargs = agent_engine_kwargs(args) if argv[0] in ("run", "acp") else engine_kwargs(args)
    assert kwargs["threads"] == 2
    assert "threads" not in engine_kwargs(build_parser().parse_args(argv))  # unset: the engine's own default


def test_the_engine_keeps_the_count_it_was_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    monkeypatch.delenv("FREETOKEN_THREADS", raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (5.0, 5.0, 5.0))  # a busy machine: "free cores" would be 1
    save_checkpoint("qwen3_moe", tmp_path)
    before = ops.get_threads()
    try:
        engine = Engine.from_pretrained(tmp_path, threads=2)
        assert engine.stats()["threads"] == 2
        assert ops.get_threads() == 2
        engine.close()
    finally:
        ops.set_threads(before)
