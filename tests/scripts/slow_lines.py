"""Rank 0 prints a line, waits, prints another: a launcher that streams shows the first long before the second."""
import time

import nanodist as nd

info = nd.init()
if info.rank == 0:
    print("first line", flush=True)
    time.sleep(3)
    print("second line", flush=True)
nd.shutdown()
