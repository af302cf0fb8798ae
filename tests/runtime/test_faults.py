"""The fault-injection switch (hpcdl/runtime/faults.py) and how a crashed rank reports itself (hpcdl/runtime/errors.py).

Faults that end or freeze a process run in a child interpreter (hpcdl.faults imports nothing heavy).
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcdl.runtime.errors import describe, is_environmental
from hpcdl.runtime.faults import Fault, FaultInjector, FaultSpecError, check, parse
from tests.support.reliability_runs import FAULT_LINE

pytestmark = pytest.mark.processes  # starts processes: not in the fast tier


# ------------------------------------------------------------------ the syntax

def test_parse_entries_ranges_and_spacing() -> None:
    assert parse("1:5:kill, 0:3-9:NaN ,2:7:killsave") == [
        Fault(1, 5, 5, "kill"), Fault(0, 3, 9, "nan"), Fault(2, 7, 7, "killsave")
    ]
    assert parse(None) == [] and parse("") == [] and parse(" , ") == []


@pytest.mark.parametrize("spec, message", [
    ("1:5", "is not RANK:STEP:KIND"),
    ("one:5:kill", "is not RANK:STEP:KIND"),
    ("1:0:kill", "is not RANK:STEP:KIND"),
    ("1:9-3:nan", "is not RANK:STEP:KIND"),
    ("1:5:explode", "kind 'explode' is not one of exception, kill"),
    ("-1:5:kill", "names a negative rank"),
])
def test_malformed_entries_are_refused(spec: str, message: str) -> None:
    with pytest.raises(FaultSpecError, match=re.escape(message)):
        parse(spec)


def test_check_against_the_world() -> None:
    assert check("3:5:kill", world_size=4) == [Fault(3, 5, 5, "kill")]
    with pytest.raises(FaultSpecError, match=re.escape("names rank 4 but the job has 4 rank(s)")):
        check("4:5:kill", world_size=4)
    with pytest.raises(FaultSpecError, match="killsave needs rank 0"):
        check("1:5:killsave", world_size=4)


def test_environment_variable_is_read_and_only_this_ranks_faults_kept(monkeypatch) -> None:
    monkeypatch.setenv("HPCDL_FAULT", "1:5:kill,0:2:nan,1:6:exception")
    assert FaultInjector(1).faults == [Fault(1, 5, 5, "kill"), Fault(1, 6, 6, "exception")]
    assert FaultInjector(3).faults == []


# ------------------------------------------------------------------ what each kind does

def test_nan_poisons_exactly_the_steps_given(capsys) -> None:
    injector = FaultInjector(0, "0:3-5:nan")
    assert [step for step in range(1, 9) if injector.poison_loss(step)] == [3, 4, 5]
    announced = FAULT_LINE.findall(capsys.readouterr().out)
    assert [(kind, rank, step) for kind, rank, step, _ in announced] == [("nan", "0", s) for s in ("3", "4", "5")]
    assert abs(float(announced[0][3]) - time.time()) < 60  # a wall-clock time the job tests can subtract


def test_exception_and_oom_strike_at_their_step_only() -> None:
    injector = FaultInjector(2, "2:4:exception,2:6:oom")
    for step in (1, 2, 3, 5):
        injector.before_step(step)
    with pytest.raises(RuntimeError, match="injected fault on rank 2 at step 4"):
        injector.before_step(4)
    with pytest.raises(MemoryError, match="injected fault on rank 2 at step 6"):
        injector.before_step(6)


def test_term_sends_sigterm_to_itself() -> None:
    received = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        FaultInjector(0, "0:2:term").before_step(2)
        time.sleep(0.1)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert received == [signal.SIGTERM]


def child(code: str) -> subprocess.Popen[str]:
    """A child interpreter that runs ``code`` after ``from hpcdl.runtime.faults import FaultInjector``."""
    return subprocess.Popen([sys.executable, "-c", "from hpcdl.runtime.faults import FaultInjector\n" + code],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("kind, status", [("exit", 3), ("kill", -signal.SIGKILL)])
def test_exit_and_kill_end_the_process(kind: str, status: int) -> None:
    proc = child(f"f = FaultInjector(0, '0:2:{kind}')\nf.before_step(1)\nprint('step 1 done', flush=True)\n"
                 "f.before_step(2)\nprint('survived')")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == status and "step 1 done" in out and "survived" not in out


def wait_for_line(proc: subprocess.Popen[str], text: str) -> None:
    for line in proc.stdout:
        if text in line:
            return
    raise AssertionError(f"{text!r} never printed")


def process_state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_stop_freezes_and_hang_blocks_but_stays_alive() -> None:
    stopped = child("FaultInjector(0, '0:1:stop').before_step(1)\nprint('resumed', flush=True)")
    hung = child("import threading, time\n"
                 "threading.Thread(target=lambda: [print('thread alive', flush=True), time.sleep(0.3), "
                 "print('thread still alive', flush=True)], daemon=True).start()\n"
                 "FaultInjector(0, '0:1:hang').before_step(1)\nprint('came back', flush=True)")
    try:
        wait_for_line(stopped, "injecting fault 'stop'")
        deadline = time.monotonic() + 10
        while process_state(stopped.pid) != "T":
            assert time.monotonic() < deadline, "never stopped"
            time.sleep(0.05)
        wait_for_line(hung, "thread still alive")  # its other threads run on...
        time.sleep(1)
        assert hung.poll() is None  # ...while the main thread never returns
        stopped.send_signal(signal.SIGCONT)
        assert stopped.communicate(timeout=30)[0].strip() == "resumed"
    finally:
        for proc in (stopped, hung):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_killsave_truncates_the_temporary_file_then_kills(tmp_path: Path) -> None:
    assert FaultInjector(0, "0:8:killsave").while_saving(7) is None
    temporary = tmp_path / ".ckpt-000000008.pt.tmp-1"
    temporary.write_bytes(b"x" * 1000)
    proc = child(f"from pathlib import Path\nFaultInjector(0, '0:8:killsave').while_saving(8)(Path({str(temporary)!r}))\n"
                 "print('survived')")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL and "survived" not in out
    assert temporary.stat().st_size == 500


# ------------------------------------------------------------------ how a crashed rank describes itself

def test_describe_gives_one_line() -> None:
    assert describe(RuntimeError("boom\nsecond line")) == "RuntimeError: boom"
    assert describe(MemoryError("no room")) == "out of memory: no room"
    assert describe(ValueError()) == "ValueError"
    worker = OSError("Caught OSError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
                     "  File \"x.py\", line 1, in <module>\nOSError: image file is truncated (3 bytes not processed)")
    assert describe(worker) == "OSError: image file is truncated (3 bytes not processed)"


def test_environmental_errors_are_told_apart_from_bugs() -> None:
    class OutOfMemoryError(RuntimeError):  # the name torch.cuda.OutOfMemoryError has
        pass

    assert is_environmental(MemoryError()) and is_environmental(OSError(28, "No space left on device"))
    assert is_environmental(OutOfMemoryError("CUDA out of memory"))
    assert not is_environmental(RuntimeError("a bug")) and not is_environmental(KeyError("x"))
