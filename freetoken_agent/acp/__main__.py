"""``python -m freetoken_agent.acp [options]``: the same server as ``freetoken acp``."""

from __future__ import annotations

import sys

from freetoken_agent.cli import main

if __name__ == "__main__":
    sys.exit(main(["acp", *sys.argv[1:]]))
