"""``python -m posenc_server``: the same as ``posenc serve``."""

import sys

from posenc_server.app import run

sys.exit(run(sys.argv[1:]))
