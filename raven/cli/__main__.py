"""``python -m raven.cli``: the `raven` command."""

import sys

from raven.cli import main

sys.exit(main())
