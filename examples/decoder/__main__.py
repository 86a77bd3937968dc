"""`python -m decoder`, from `examples/`: see `decoder.cli`."""

import sys

from decoder.cli import main

sys.exit(main())
