"""``python -m meshnode.cli``: the ``meshnode`` command without its console script."""

import sys

from meshnode.cli import main

sys.exit(main())
