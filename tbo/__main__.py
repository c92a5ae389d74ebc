"""``python -m tbo``: the same as the ``tbo`` command."""

import sys

from tbo.tools.cli import main

sys.exit(main())
