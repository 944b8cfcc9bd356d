"""``python -m ckptstream.cli``: the ``ckptstream`` command."""

import sys

from . import main

sys.exit(main())
