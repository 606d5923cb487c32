"""``python -m bench [--quick]``: run the benchmark suite."""

import sys

from bench.run import main

sys.exit(main())
