"""``python -m torchvote`` is the ``torchvote`` command."""

import sys

from torchvote.cli import main

sys.exit(main())
