"""``python -m tbo``: the same as the ``tbo`` command."""

import sys

from .cli import main

sys.exit(main())
