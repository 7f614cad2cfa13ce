"""``python -m jaxckpt``: the ``jaxckpt`` command (see :mod:`jaxckpt._src.cli`)."""

import sys

from ._src.cli import main

sys.exit(main())
