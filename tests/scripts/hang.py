"""Every rank records its pid (and a grandchild's) in $PID_DIR, then hangs forever."""
import os
import subprocess
import sys
import time

import nanodist as nd

info = nd.init()
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
pid_dir = os.environ["PID_DIR"]
with open(os.path.join(pid_dir, f"{info.rank}.pids"), "w") as f:
    f.write(f"{os.getpid()} {child.pid}\n")
print("ready", flush=True)
time.sleep(3600)
