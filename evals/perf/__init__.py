"""Performance and behaviour measurements of the runtime (benchmarks, routing reports)."""
