"""``python -m ckptstream``: the ``ckptstream`` command."""

import sys

from .cli import main

sys.exit(main())
