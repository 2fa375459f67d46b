"""The warm start's threads: only the cores no other process uses (learner/free_cores.py)."""

import os
import subprocess
import sys
import time

from k3rl.learner.free_cores import FreeCores

SPIN = "import os, time\nend = time.monotonic() + 20\nwhile time.monotonic() < end: pass\n"


def test_cores_that_other_processes_keep_busy_are_not_taken():
    cpus = sorted(os.sched_getaffinity(0))
    spinners = [subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{c}}})\n" + SPIN])
                for c in cpus]  # one busy process on each of this process's CPUs
    try:
        time.sleep(1.0)
        free = FreeCores()
        assert free.threads() == 1  # no window measured yet: one thread
        time.sleep(1.0)
        assert free.cores == len(cpus) and free.threads() == 1
    finally:
        for p in spinners:
            p.kill()
            p.wait()
