#!/usr/bin/env python3
"""Run mpirun, pass its stderr through, and make sure the job ends when a node is lost.

    python3 launch/supervise.py [--grace S] [--map HOST=RANKS;...] -- mpirun ...

Open MPI 4.1 ends a job by itself when a node's daemon dies (a crash closes its TCP connection) or,
with short ``oob_tcp_keepalive_*`` settings, when an idle connection to a daemon stops answering.
It does not end when a rank calls MPI_Abort while a node is cut off: mpirun sends the kill order
to every daemon, the one it cannot reach never acknowledges it, TCP keeps retransmitting for
~15 minutes (net.ipv4.tcp_retries2) and keepalives are not sent while data is unacknowledged. So
this supervisor watches stderr for the abort (hpcdl's stall verdict or Open MPI's MPI_ABORT
notice) and kills mpirun's process group ``--grace`` seconds later if it is still there. It also
turns the multi-line reports of a lost node (Open MPI's, or the remote shell's when a daemon is
killed) into one line that names the node and its ranks (``--map``, from the host list).

Standard library only: it runs before any virtual environment is known.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time

ABORT_PATTERNS = (re.compile(r"hpcdl: .*ending the job"), re.compile(r"MPI_ABORT was invoked"),
                  re.compile(r"ORTE has lost communication with a remote daemon"))
# Lines that say a node (or everything on it) is gone, and the host each names. Open MPI names a
# lost daemon; when a daemon is killed it says only "unable to reliably start one or more daemons",
# so the remote shell that carried it must say where: ssh, srun (Open MPI's launcher inside a Slurm
# allocation) and launch/vcluster-rsh each print the host.
NODE_GONE = (
    (re.compile(r"Remote daemon: \[\[\d+,\d+\],\d+\] on node (\S+)"), "Open MPI lost its daemon there"),
    (re.compile(r"^\s*Peer host:\s*(\S+)"), "connections to it broke"),
    (re.compile(r"connect\(\) to (\S+?):\d+ failed"), "its ranks stopped accepting connections"),
    (re.compile(r"vcluster-rsh: connection to \S+ \((\S+)\) closed"), "its daemon was killed"),
    (re.compile(r"Connection to (\S+) closed by remote host"), "its remote shell closed"),
    (re.compile(r"Timeout, server (\S+) not responding"), "its remote shell timed out"),
    (re.compile(r"srun: error: (\S+): tasks? [\d,-]+: (?:Killed|Exited|Terminated)"), "its Slurm tasks died"),
)
EXIT_LOST = 3  # what hpcdl's watchdog exits with; used when mpirun had to be killed


def note(message: str) -> None:
    print(f"[hpcdl] {message}", file=sys.stderr, flush=True)


def parse_map(text: str) -> dict[str, str]:
    """'10.0.0.1=0,1;10.0.0.2=2,3' -> {'10.0.0.1': '0, 1', ...}"""
    found = {}
    for part in filter(None, text.split(";")):
        host, _, ranks = part.partition("=")
        found[host] = ", ".join(filter(None, ranks.split(",")))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(prog="launch/supervise.py")
    parser.add_argument("--grace", type=float, default=20.0,
                        help="seconds mpirun may take to end after an abort before it is killed")
    parser.add_argument("--map", default="", help="HOST=RANK,RANK;... for naming a lost node's ranks")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command to run")
    ranks_on = parse_map(args.map)
    env = dict(os.environ)
    env["PATH"] = env.pop("HPCDL_JOB_PATH", env.get("PATH", ""))  # the launcher's PATH, not a shim's
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, start_new_session=True, env=env)
    aborted_at: list[float] = []
    killed = threading.Event()
    named: set[str] = set()

    def forward_signal(sig: int, _frame: object) -> None:  # Ctrl-C / scancel reach mpirun as before
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, forward_signal)

    def reaper() -> None:
        while proc.poll() is None:
            if aborted_at and time.monotonic() - aborted_at[0] > args.grace:
                note(f"mpirun still running {args.grace:.0f} s after the job was aborted (it waits for a "
                     "daemon it cannot reach): killing it")
                killed.set()
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                time.sleep(5)  # a process outside the group may still hold stderr open: do not wait on it
                os._exit(EXIT_LOST)
            time.sleep(0.5)

    threading.Thread(target=reaper, daemon=True).start()
    assert proc.stderr is not None
    for raw in proc.stderr:
        sys.stderr.buffer.write(raw)
        sys.stderr.buffer.flush()
        line = raw.decode(errors="replace")
        if not aborted_at and any(p.search(line) for p in ABORT_PATTERNS):
            aborted_at.append(time.monotonic())
        for pattern, why in NODE_GONE:
            found = pattern.search(line)
            if found and found.group(1) not in named:
                host = found.group(1)
                named.add(host)
                note(f"node {host} lost or its ranks died: {why} (ranks {ranks_on.get(host, '?')}); ending the job")
                if not aborted_at:
                    aborted_at.append(time.monotonic())
    rc = proc.wait()
    if killed.is_set():
        return EXIT_LOST
    return rc


if __name__ == "__main__":
    sys.exit(main())
