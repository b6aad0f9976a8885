"""Keep engine processes from outliving the process that started them, whatever state they are in.

A watchdog inside the engine's own process cannot do it: a process that is SIGSTOPped, or stuck in C code holding
the GIL, runs none of its threads. Two mechanisms outside it:

* ``python supervise.py CALLER_PID -- ARGV...`` (``supervised_argv``) is a supervisor: the caller starts it as the
  leader of a new session; it forks, the child execs ARGV (the engine lane or server) in the supervisor's process
  group, and the supervisor polls its own parent. When the caller is gone (the supervisor was re-parented) it
  SIGKILLs the whole group: the engine, everything the engine started, and itself. It mirrors the engine's exit
  status (a signal death included), so the caller sees the engine's status as the Popen's. It runs on the standard
  library alone, as a file (``-I -S``: no site-packages), so it is up in tens of milliseconds; the engine child also
  dies with it (PR_SET_PDEATHSIG on Linux), should the supervisor alone be killed.
* ``die_with_parent(pid)`` (and ``guarded`` for multiprocessing targets) for processes the engine spawns itself
  (triton's tensor-parallel workers): PR_SET_PDEATHSIG makes the kernel SIGKILL the process when its parent ends,
  and a parent that already ended before the call is caught by comparing getppid().

PR_SET_PDEATHSIG fires when the *thread* that created the child exits, not the process: workers are spawned from
the thread that starts an engine and used from it; lpdiff starts engines on the main thread (no command starts one
from a worker thread).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import signal
import sys
import time

SUPERVISOR = os.path.abspath(__file__)
POLL_S = 0.1  # how often the supervisor looks at its parent: a killed caller's engine is gone within ~0.1 s
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def supervised_argv(argv: list[str], caller_pid: int | None = None) -> list[str]:
    """``argv`` run under a supervisor that ends its process group when ``caller_pid`` (this process) is gone.
    Start it with ``start_new_session=True``: the supervisor's pid is then the group to kill."""
    return [sys.executable, "-I", "-S", SUPERVISOR, str(caller_pid or os.getpid()), "--", *argv]


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """Have the kernel send ``sig`` to this process when its parent (``parent_pid``) ends (Linux; elsewhere only
    the check below), and exit at once when it has already ended."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


def guarded(parent_pid: int, blob: bytes, *extra):
    """A multiprocessing target: ``die_with_parent`` first, then ``fn(*args, *extra)`` from ``blob`` (a pickle of
    ``(fn, args)``). The pickle is opened only after the guard, so the child imports what ``fn`` needs (torch, for
    a TP worker: seconds) already bound to its parent's life."""
    die_with_parent(parent_pid)
    fn, args = pickle.loads(blob)  # our own pickle, made by the parent a moment ago
    return fn(*args, *extra)


def _mirror(status: int) -> None:
    """Exit as the engine did: the same code, or death by the same signal (no core file)."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            import resource

            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        except (ImportError, ValueError, OSError):
            pass
        with contextlib.suppress(OSError, ValueError):  # SIGKILL's cannot be set (nor needs to be)
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        time.sleep(1)  # a signal that does not end the process by default: fall through to an exit code
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def _supervise(caller: int, argv: list[str]) -> None:
    if os.getppid() != caller:  # the caller died while this interpreter started
        os._exit(1)
    me = os.getpid()
    child = os.fork()
    if child == 0:
        try:
            die_with_parent(me)
            os.execvp(argv[0], argv)
        except OSError as e:
            print(f"lpdiff supervisor: cannot run {argv[0]}: {e}", file=sys.stderr, flush=True)
        finally:
            os._exit(127)
    # The engine's pipes (its request stdin, its answer pipe) must close when the engine dies, so that the caller
    # reads EOF: the supervisor keeps no copy of them.
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    try:
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        fds = list(range(3, 1024))
    for fd in fds:
        if fd > 2:
            with contextlib.suppress(OSError):
                os.close(fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C goes to the caller, which decides
    while True:
        pid, status = os.waitpid(child, os.WNOHANG)
        if pid == child:
            _mirror(status)
        if os.getppid() != caller:
            os.killpg(0, signal.SIGKILL)  # the engine, what it started, and this supervisor
        time.sleep(POLL_S)


if __name__ == "__main__":
    _supervise(int(sys.argv[1]), sys.argv[sys.argv.index("--") + 1 :])
