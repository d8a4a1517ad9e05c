"""``python -m zps ...`` is ``zps-server ...``.

Once the command has returned, the process ends at once (``os._exit``) after flushing
its logs and output, unless a thread that is not a daemon still runs (then the
interpreter's own exit joins it): its sockets linger for nothing and the kernel releases
its files and locks, so tearing down the interpreter's modules would only add time to
every stop.
"""

import logging
import os
import sys
import threading

from zps.cli.main import server_main

code = server_main()
if any(t is not threading.main_thread() and not t.daemon for t in threading.enumerate()):
    sys.exit(code)
logging.shutdown()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
