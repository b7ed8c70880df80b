"""`python -m fastbert ...`: the same command as the `fastbert` script (what `torchrun -m fastbert` runs)."""

import sys

from fastbert.cli import main

if __name__ == "__main__":
    sys.exit(main())
