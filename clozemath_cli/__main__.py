"""`python -m clozemath_cli ...`: the `clozemath` command without its console script."""

import sys

from clozemath_cli import main

sys.exit(main())
