"""Performance and behaviour measurements of the runtime: every benchmark is a row of one harness.

``harness.py`` holds the row registry (``@row``) and runs rows (``freetoken bench list``, ``freetoken bench ROW``);
``timing.py`` is the one timing helper; ``machine.py`` records the machine with every result; ``history.py`` keeps
``results.jsonl`` and generates ``LATEST.md`` (the latest result per row and machine).
"""
