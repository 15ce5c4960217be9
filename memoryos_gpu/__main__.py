"""``python -m memoryos_gpu``: the ``memoryos-gpu`` command line."""

import sys

from memoryos_gpu.cli import main

if __name__ == "__main__":
    sys.exit(main())
