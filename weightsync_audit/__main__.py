"""``python -m weightsync_audit demo`` is ``weightsync-audit demo``."""

import sys

from weightsync_audit.cli import main

if __name__ == "__main__":
    sys.exit(main())
