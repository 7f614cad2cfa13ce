"""``python -m jaxckpt``: the ``jaxckpt`` command (see :mod:`jaxckpt._src.cli.main`)."""

import sys

from ._src.cli.main import main

sys.exit(main())
