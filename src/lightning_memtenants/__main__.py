"""``python -m lightning_memtenants`` is the ``memtenants`` command."""

import sys

from lightning_memtenants.cli import main

sys.exit(main())
