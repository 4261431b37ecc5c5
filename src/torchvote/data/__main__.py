"""``python -m torchvote.data``: the same as ``torchvote data``."""

from torchvote.data.command import main

raise SystemExit(main())
