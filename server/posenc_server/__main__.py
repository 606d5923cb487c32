"""``python -m posenc_server``: the ``posenc-server`` command (and ``posenc serve``)."""

import sys

from posenc_server.cli import main

sys.exit(main())
