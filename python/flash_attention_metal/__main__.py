"""``python -m flash_attention_metal``: see ``flash_attention_metal.cli``."""

import sys

from .cli import main

sys.exit(main())
