"""What a rank sees of its interpreter, printed as one JSON line by every rank: a warm rank (forked from
nanodist's agent server) must see what a fresh `python -u script` sees. Rank 1 then fails as $FAIL says."""
import sys

PRELOADED = "torch" in sys.modules  # the one difference a warm rank may show: torch was imported before it ran

import atexit  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import pickle  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402


class Point:  # defined in __main__: pickling it needs sys.modules["__main__"] to be this script
    def __init__(self, x):
        self.x = x


def late_thread():  # a non-daemon thread the interpreter waits for before it exits
    time.sleep(0.3)
    print("thread finished", flush=True)


rank = int(os.environ["RANK"])
seen = {
    "name": __name__, "file": __file__, "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(),
    "threads": torch.get_num_threads(), "env": os.environ.get("FROM_LAUNCH"), "stdin": sys.stdin.readable(),
    "unbuffered": sys.stdout.write_through, "pickled": pickle.loads(pickle.dumps(Point(3))).x,
    "excepthook": sys.excepthook is sys.__excepthook__, "stdout_encoding": sys.stdout.encoding,
}
print("SEEN " + json.dumps(seen, sort_keys=True) + " PRELOADED " + str(PRELOADED))
atexit.register(print, "atexit ran", flush=True)
threading.Thread(target=late_thread).start()
if rank == 1:
    fail = os.environ.get("FAIL", "")
    if fail.startswith("exit"):
        sys.exit(int(fail[4:]))
    if fail == "raise":
        raise ValueError("rank one raises on purpose")
