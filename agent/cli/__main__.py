"""``python -m agent.cli``: the ``liubai`` command without the console script."""

import sys

from agent.cli.main import main

sys.exit(main())
