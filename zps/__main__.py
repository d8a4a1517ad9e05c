"""``python -m zps ...`` is ``zps-server ...``."""

import sys

from zps.cli.main import server_main

sys.exit(server_main())
