"""Package data only: the built-in model, a small ``qwen3_moe`` Hugging Face folder (no code).

Find it with ``freetoken_agent.runtime.builtin.builtin_model_dir()``; it was trained by
``python -m freetoken_agent.evals.builtin.train`` (see ``training.json`` here for the exact run).
"""
