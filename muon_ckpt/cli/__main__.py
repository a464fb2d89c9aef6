"""``python -m muon_ckpt.cli``: the ``muon-ckpt`` command."""

import sys

from muon_ckpt.cli import main

sys.exit(main())
