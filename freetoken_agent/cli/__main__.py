import sys

from freetoken_agent.cli import main

sys.exit(main())
