"""``python -m benchmarks.grids``: the grid runner (:mod:`benchmarks.grids.runner`)."""

import sys

from benchmarks.grids.runner import main

sys.exit(main())
