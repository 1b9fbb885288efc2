"""Fields a request leaves out take the model's generation_config.json sampling defaults (as vLLM does)."""

from __future__ import annotations

import json
from pathlib import Path

from freetoken_agent.backends.local import LocalEngine
from freetoken_agent.server.app import OpenAIServer
from freetoken_agent.server.protocol import chat_request
from tests.sdk.tiny_checkpoint import build_tiny_qwen3_moe

HI = [{"role": "user", "content": "hi"}]


def test_generation_config_defaults(tmp_path: Path) -> None:
    folder = build_tiny_qwen3_moe(tmp_path / "m")
    config = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "eos_token_id": 2}
    (folder / "generation_config.json").write_text(json.dumps(config))
    server = OpenAIServer(LocalEngine.from_pretrained(folder), "m", default_max_tokens=33)
    left_out = chat_request({"messages": HI}, server.defaults).request
    assert (left_out.temperature, left_out.top_p, left_out.top_k, left_out.max_tokens) == (0.7, 0.8, 20, 33)
    assert not left_out.strict_length  # a default length is clipped to the context, never refused
    given = chat_request({"messages": HI, "temperature": 0, "top_p": 1, "top_k": 0, "max_tokens": 5},
                         server.defaults).request
    assert (given.temperature, given.top_p, given.top_k, given.max_tokens) == (0.0, 1.0, 0, 5)
    (folder / "generation_config.json").write_text(json.dumps({**config, "do_sample": False}))
    greedy = OpenAIServer(LocalEngine.from_pretrained(folder), "m").defaults  # a greedy model stays greedy
    assert (greedy.temperature, greedy.top_p, greedy.top_k) == (0.0, 1.0, 0)
