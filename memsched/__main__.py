"""`python -m memsched`: the command line, as the `memsched` console script runs it."""
import sys

from memsched.cli import main

sys.exit(main())
