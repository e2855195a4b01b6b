"""``python -m ckptpilot`` is the ``ckptpilot`` command."""

import sys

from ckptpilot.cli import main

sys.exit(main())
