"""``python -m jaxckpt``: the ``jaxckpt`` command (see :mod:`jaxckpt.cli`)."""

import sys

from .cli import main

sys.exit(main())
