"""The built-in model: data rendering, chat template and the training script (a dev tool, needs ``transformers``).

``python -m freetoken_agent.evals.builtin.train --help`` trains the small ``qwen3_moe`` model that ships in
``freetoken_agent/builtin/``.
"""
