"""SWE-style task evals and performance benchmarks (``freetoken_agent.evals``)."""
