"""Kills the processes of the local Ray instance a job started when the job's driver dies, even by SIGKILL.

Ray ties the GCS, the raylet and the monitors to the driver (PR_SET_PDEATHSIG), but the raylet's agents
(DashboardAgent, RuntimeEnvAgent) and actor processes outlive it: an agent that sees its raylet die first
reports the death to the GCS, which died too, with a fixed 60 s timeout. The reaper is a small process the
driver starts right after the instance (Linux only: it reads /proc). It lists the instance's processes (the
processes the driver started in `ray.init` and everything under them) every second, and when its stdin, a
pipe from the driver, ends (the driver exited or was killed) it kills those still running (SIGKILL).

Runs as a script (`python reaper.py PID...`), with nothing imported from the project.
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional

_EVERY_S = 1.0


def _stat(pid: int) -> Optional[tuple[int, int]]:
    """(parent pid, start time in clock ticks) of a process, or None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), int(fields[19])


def children(pid: int) -> set[int]:
    """The direct children of `pid`."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None and st[0] == pid:
            found.add(int(entry))
    return found


def _tree(roots: set[int]) -> dict[int, int]:
    """pid -> start time of the roots still running and of every process under them."""
    parent_of = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None:
            parent_of[int(entry)] = st
    found, todo = {}, [p for p in roots if p in parent_of]
    while todo:
        pid = todo.pop()
        found[pid] = parent_of[pid][1]
        todo += [c for c, (ppid, _) in parent_of.items() if ppid == pid and c not in found]
    return found


def start(roots: set[int]) -> Optional[subprocess.Popen]:
    """Start a reaper for these processes (and their descendants); None where /proc is missing. Keep the
    returned Popen: its stdin is the pipe whose end sets the reaper off."""
    if not roots or not Path("/proc/self/stat").exists():
        return None
    return subprocess.Popen([sys.executable, __file__, *map(str, sorted(roots))], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def release(proc: Optional[subprocess.Popen]) -> None:
    """The instance was shut down: close the pipe (the reaper kills any leftover and exits) and reap it."""
    if proc is None:
        return
    try:
        proc.stdin.close()
        proc.wait(timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        proc.kill()


def main(argv: list[str]) -> int:
    roots = {int(a) for a in argv}
    known: dict[int, int] = _tree(roots)
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], _EVERY_S)
        if ready and not os.read(sys.stdin.fileno(), 4096):
            break  # the driver is gone (or released us)
        known.update(_tree(roots | set(known)))
    for pid, started in known.items():
        st = _stat(pid)
        if st is not None and st[1] == started:  # the same process, not a reused pid
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
