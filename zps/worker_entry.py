"""``python -m zps.worker_entry ...`` is ``zps-worker ...``."""

import sys

from zps.cli.main import worker_main

sys.exit(worker_main())
