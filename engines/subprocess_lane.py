"""Run an engine in a child process (a "lane"), so that an engine that kills its own process becomes an error
carrying the engine's last log lines instead of taking the caller down with it.

Why: SGLang 0.5.15 kills its engine on the first request with a PEFT 3D expert adapter, and vLLM 0.25.1 may abort
at exit (rc 134) after its work is done. A verdict needs the numbers of the engines that worked and a FAIL with the
log tail for the one that did not. The lane can also run the engine under another interpreter (``python=``): vLLM
pins its own transformers, so it usually lives in its own virtualenv.

Protocol: the parent writes length-prefixed pickles to the child's stdin; the child answers on an inherited pipe.
Everything the engine prints (stdout, stderr, C-level logs, its own subprocesses) goes to one log file whose tail
is attached to every failure. numpy arrays travel as ``.npy`` bytes, so two virtualenvs with different numpy
versions can talk. The child runs in its own session under a supervisor process (engines/supervise.py), so closing
the lane ends the engine's whole process group, and the supervisor ends that group when the caller dies: a killed
caller leaves nothing running, even when the engine is SIGSTOPped or stuck in C code holding the GIL.
Every call has a deadline (scaled from its tokens unless given), so a hung engine becomes a LaneDied with its log
tail: a FAIL for that engine, and the caller goes on.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from lpdiff.engines.supervise import supervised_argv

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # lpdiff/ in a wheel, the source tree's root otherwise


def _import_root() -> str:
    """A directory whose only entry is ``lpdiff``, for the child's PYTHONPATH: the child may be another virtualenv's
    interpreter (vLLM pins its own transformers), so the parent's site-packages must not come along with lpdiff."""
    import lpdiff

    pkg = Path(lpdiff.__file__).resolve().parent
    root = Path(tempfile.gettempdir()) / f"lpdiff-import-{os.getuid()}-{abs(hash(str(pkg))) % 10**8}"
    link = root / "lpdiff"
    if not link.exists():
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".lpdiff-{os.getpid()}"
        tmp.symlink_to(pkg, target_is_directory=True)
        os.replace(tmp, link)
    return str(root)


_HEADER = struct.Struct("<Q")


class LaneError(RuntimeError):
    """The engine raised inside the lane; the message carries its traceback."""


class LaneDied(RuntimeError):
    """The lane's process ended (killed, crashed, aborted) or stopped answering; ``log_tail`` holds its last log
    lines, ``returncode`` its exit status (None when it hung)."""

    def __init__(self, message: str, returncode: int | None, log_tail: str, log_path: str):
        super().__init__(f"{message}\n--- last lines of {log_path} ---\n{log_tail}")
        self.returncode, self.log_tail, self.log_path = returncode, log_tail, log_path


# -- wire format ---------------------------------------------------------------------------------------------------


def _npy_load(blob: bytes) -> np.ndarray:
    return np.load(io.BytesIO(blob), allow_pickle=False)


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        if isinstance(obj, np.ndarray) and obj.dtype != object:
            buf = io.BytesIO()
            np.save(buf, obj, allow_pickle=False)
            return _npy_load, (buf.getvalue(),)
        return NotImplemented


def _send(fh, obj: Any) -> None:
    buf = io.BytesIO()
    _Pickler(buf, protocol=4).dump(obj)
    data = buf.getvalue()
    fh.write(_HEADER.pack(len(data)) + data)
    fh.flush()


def _read_exact(fd: int, n: int, deadline: float | None, alive) -> bytes:
    chunks, got = [], 0
    while got < n:
        wait = 1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))
        ready, _, _ = select.select([fd], [], [], wait)
        if not ready:
            alive()  # raises when the child is gone or the deadline passed
            continue
        chunk = os.read(fd, n - got)
        if not chunk:
            alive(eof=True)
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


# -- parent side ---------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class LaneConfig:
    python: str = sys.executable  # the interpreter (and so the virtualenv) the engine runs under
    env: dict[str, str] = field(default_factory=dict)  # added to the child's environment
    # Building the engine: a full-size MoE checkpoint loads and compiles in 2-5 minutes on one H100; 15 leaves room
    # for a cold disk cache and TP 8 without hiding a hang for half an hour.
    start_timeout_s: float = 900.0
    call_timeout_s: float | None = None  # one call; None: call_floor_s + call_per_token_s x the call's tokens
    # A prefill-only logprob call runs at thousands of tokens/s on a GPU and hundreds on CPU for the tiny zoo;
    # 20 ms a token plus 5 minutes is 10-100x that, so only a hang reaches it.
    call_floor_s: float = 300.0
    call_per_token_s: float = 0.02
    close_timeout_s: float = 60.0  # a clean __exit__ before the process group is killed
    log_path: str | None = None  # None: a temp file, kept after the lane closes
    tail_lines: int = 60

    def __post_init__(self):
        assert self.start_timeout_s > 0 and self.close_timeout_s > 0 and self.tail_lines > 0
        assert self.call_timeout_s is None or self.call_timeout_s > 0
        assert self.call_floor_s > 0 and self.call_per_token_s >= 0

    def call_timeout(self, tokens: int = 0) -> float:
        """The deadline of one call over ``tokens`` tokens: ``call_timeout_s`` when given, else scaled."""
        if self.call_timeout_s is not None:
            return self.call_timeout_s
        return self.call_floor_s + self.call_per_token_s * max(0, int(tokens))


def work_tokens(args: Sequence[Any]) -> int:
    """Tokens in a call whose first argument is a batch of prompts (token-id sequences); 0 for any other call."""
    batch = args[0] if args else None
    if isinstance(batch, (list, tuple)) and all(isinstance(p, (list, tuple, np.ndarray)) for p in batch):
        return sum(len(p) for p in batch)
    return 0


_LANE_KEYS = {
    "python": "python",
    "lane_env": "env",
    "lane_start_timeout_s": "start_timeout_s",
    "lane_call_timeout_s": "call_timeout_s",
    "lane_log": "log_path",
}  # option -> LaneConfig field


def lane_config_from_options(options: dict[str, Any]) -> tuple[LaneConfig | None, dict[str, Any]]:
    """Pop the lane options (``lane``: "inprocess" | "subprocess"; ``python``; ``lane_env``;
    ``lane_start_timeout_s``; ``lane_call_timeout_s``; ``lane_log``) from an engine's options. A ``python`` other
    than this interpreter implies a subprocess lane. Returns (LaneConfig or None for in-process, the rest)."""
    opts = dict(options)
    mode = opts.pop("lane", None)
    keys = _LANE_KEYS
    given = {dst: opts.pop(src) for src, dst in keys.items() if src in opts}
    if mode is None:
        mode = "subprocess" if given.get("python") not in (None, sys.executable) else "inprocess"
    if mode not in ("inprocess", "subprocess"):
        raise ValueError(f"option lane must be 'inprocess' or 'subprocess', got {mode!r}")
    if mode == "inprocess":
        if given:
            raise ValueError(f"options {sorted(k for k in keys if k in options)} need lane='subprocess'")
        return None, opts
    return LaneConfig(**given), opts


class ManagedProcess:
    """A child process in its own session with all its output in one log file: its tail goes into every failure,
    and ``kill`` ends the child's whole process group (what the engine started too). The SubprocessLane and the
    SGLang HTTP server both run under one."""

    def __init__(
        self,
        argv: Sequence[str],
        env: dict[str, str] | None = None,
        log_path: str | None = None,
        tail_lines: int = 60,
        log_prefix: str = "lpdiff-proc-",
    ):
        self.argv, self.env, self.tail_lines = list(argv), dict(env or {}), tail_lines
        if log_path is None:  # LPDIFF_LANE_LOG_DIR: keep every engine's log where a GPU job collects its files
            log_dir = os.environ.get("LPDIFF_LANE_LOG_DIR") or None
            if log_dir:
                os.makedirs(log_dir, exist_ok=True)
            fd, log_path = tempfile.mkstemp(prefix=log_prefix, suffix=".log", dir=log_dir)
            os.close(fd)
        self.log_path = str(log_path)
        self.proc: subprocess.Popen | None = None

    def start(self, **popen) -> ManagedProcess:
        assert self.proc is None, "process already started"
        env = {**os.environ, **self.env}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_import_root(), env.get("PYTHONPATH")) if p)
        env.setdefault("PYTHONUNBUFFERED", "1")
        with open(self.log_path, "ab") as log:  # the supervisor leads the new session: its pid is the group
            self.proc = subprocess.Popen(
                supervised_argv(self.argv),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                cwd=str(PACKAGE_DIR),
                **popen,
            )
        return self

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def wait(self, timeout: float) -> int | None:
        """The exit status once the process has ended within ``timeout`` seconds; None while it runs on (or was
        never started)."""
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def log_tail(self) -> str:
        try:
            lines = Path(self.log_path).read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-self.tail_lines :])

    def died(self, what: str, rc: int | None, why: str) -> LaneDied:
        sig = ""
        if rc is not None and rc < 0 and -rc in signal.valid_signals():
            sig = f" (signal {signal.Signals(-rc).name})"
        return LaneDied(f"{what}: the engine process {why}{sig}", rc, self.log_tail(), self.log_path)

    def kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        # The supervisor leads its own session, so its pid is the group of the engine and everything it started
        # (SGLang's scheduler, vLLM's workers): end the whole group, even when the leader itself has already exited.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        # The engine is the supervisor's child: once the supervisor is gone, init reaps it. Wait (briefly) until the
        # group is empty, so that a closed lane means no process of it is left, not even a zombie.
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except (ProcessLookupError, PermissionError):
                break
            time.sleep(0.01)
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()


class SubprocessLane:
    """``lane = SubprocessLane("lpdiff.engines.vllm:VLLMEngine", (config,)).start()``, then
    ``lane.call("prompt_logprobs", ...)``.

    The child builds ``target(*args)`` and enters it when it has ``__enter__``; ``call`` runs one method there;
    ``close`` exits it cleanly, then ends the child's process group."""

    def __init__(self, target: str, args: Sequence[Any] = (), config: LaneConfig | None = None):
        assert ":" in target, f"target must be 'module:callable', got {target!r}"
        self.target, self.args, self.config = target, tuple(args), config or LaneConfig()
        self.child = ManagedProcess(
            [self.config.python, "-m", "lpdiff.engines.subprocess_lane"],
            self.config.env,
            self.config.log_path,
            self.config.tail_lines,
            log_prefix="lpdiff-lane-",
        )
        self._resp_fd: int | None = None
        self.info: dict[str, Any] = {}

    @property
    def log_path(self) -> str:
        return self.child.log_path

    @property
    def proc(self) -> subprocess.Popen | None:
        return self.child.proc

    # lifecycle
    def start(self) -> SubprocessLane:
        r, w = os.pipe()
        self.child.argv += [str(w)]
        self.child.start(stdin=subprocess.PIPE, pass_fds=(w,))
        os.close(w)
        self._resp_fd = r
        try:
            self.info = self._request(
                ("open", self.target, self.args), self.config.start_timeout_s, f"starting {self.target}"
            )
        except BaseException:
            self._kill()
            raise
        return self

    def call(self, method: str, *args, **kwargs) -> Any:
        if self.proc is None:
            raise RuntimeError("the lane is not running: use it as a context manager or call start() first")
        timeout = self.config.call_timeout(work_tokens(args))
        return self._request(("call", method, args, kwargs), timeout, f"{self.target}.{method}")

    def close(self) -> None:
        if self.proc is None:
            return
        try:
            if self.proc.poll() is None:
                self._request(("close",), self.config.close_timeout_s, f"closing {self.target}")
                self.proc.wait(timeout=self.config.close_timeout_s)
        except (LaneDied, LaneError, subprocess.TimeoutExpired, BrokenPipeError):
            pass  # an engine that aborts at exit (vLLM rc 134) has already delivered its work
        finally:
            self._kill()

    def __enter__(self) -> SubprocessLane:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.close()

    # internals
    def log_tail(self) -> str:
        return self.child.log_tail()

    def _request(self, msg: tuple, timeout: float | None, what: str) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        proc, resp_fd = self.proc, self._resp_fd
        if proc is None or proc.stdin is None or resp_fd is None:
            raise RuntimeError("the lane is not running: use it as a context manager or call start() first")

        def alive(eof: bool = False):
            if eof:  # a dying process closes its pipes a moment before it can be reaped
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)
            rc = proc.poll()
            if rc is not None:
                self._kill()
                raise self.child.died(what, rc, f"exited with status {rc}")
            if eof:  # the answer pipe closed while the process lives on: it cannot answer any more
                self._kill()
                raise self.child.died(what, None, "closed its answer pipe and was killed")
            if deadline is not None and time.monotonic() > deadline:
                self._kill()
                raise self.child.died(what, None, f"did not answer within {timeout:.0f} s and was killed")

        try:
            _send(proc.stdin, msg)
        except (BrokenPipeError, OSError):
            rc = proc.wait(timeout=5)
            self._kill()
            raise self.child.died(what, rc, f"exited with status {rc}") from None
        (size,) = _HEADER.unpack(_read_exact(resp_fd, _HEADER.size, deadline, alive))
        status, payload = pickle.loads(_read_exact(resp_fd, size, deadline, alive))
        if status == "ok":
            return payload
        raise LaneError(f"{what} failed inside the lane:\n{payload}")

    def _kill(self) -> None:
        self.child.kill()
        if self._resp_fd is not None:
            os.close(self._resp_fd)
            self._resp_fd = None


class LaneEngine:
    """An Engine whose work runs in a SubprocessLane: ``target`` names the in-process engine class the child
    builds from ``config``. Engines use it for their ``lane="subprocess"`` mode."""

    def __init__(self, name: str, target: str, config, lane: LaneConfig):
        self.name, self.target, self.config, self.lane_config = name, target, config, lane
        self.lane: SubprocessLane | None = None

    def __enter__(self) -> LaneEngine:
        self.lane = SubprocessLane(self.target, (self.config,), self.lane_config).start()
        return self

    def __exit__(self, *exc) -> None:
        if self.lane is not None:
            self.lane.close()
            self.lane = None

    def prompt_logprobs(self, prompts, adapter=None, top_k: int = 0):
        if self.lane is None:
            raise RuntimeError(f"use the engine as a context manager: `with open_engine({self.name!r}, cfg) as eng:`")
        prompts = [[int(t) for t in p] for p in prompts]
        adapter = adapter if adapter is None or isinstance(adapter, str) else list(adapter)
        return self.lane.call("prompt_logprobs", prompts, adapter, top_k)

    def decode(self, prompts, adapter, how):
        if self.lane is None:
            raise RuntimeError(f"use the engine as a context manager: `with open_engine({self.name!r}, cfg) as eng:`")
        prompts = [[int(t) for t in p] for p in prompts]
        adapter = adapter if adapter is None or isinstance(adapter, str) else list(adapter)
        return self.lane.call("decode", prompts, adapter, how)

    def version(self) -> str:
        return self.lane.call("version") if self.lane is not None else f"{self.name} (lane not started)"


def strip_lane_options(config):
    """The config the child builds its in-process engine from: the same, minus the lane options."""
    rest = {k: v for k, v in config.options.items() if k != "lane" and k not in _LANE_KEYS}
    return replace(config, options=rest)


# -- child side ----------------------------------------------------------------------------------------------------


def _resolve(target: str):
    module, _, attr = target.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _serve(resp_fd: int) -> int:
    requests, answers = sys.stdin.buffer, os.fdopen(resp_fd, "wb")
    obj = None
    while True:
        header = requests.read(_HEADER.size)
        if len(header) < _HEADER.size:  # the parent went away: close the engine if we can, end what it started
            if obj is not None and hasattr(obj, "__exit__"):
                obj.__exit__(None, None, None)
            os.killpg(os.getpgrp(), signal.SIGKILL)
        msg = pickle.loads(requests.read(_HEADER.unpack(header)[0]))
        reply: tuple[str, Any]
        try:
            if msg[0] == "open":
                _, target, args = msg
                obj = _resolve(target)(*args)
                if hasattr(obj, "__enter__"):
                    obj = obj.__enter__()
                result = {"pid": os.getpid(), "python": sys.executable}
            elif msg[0] == "call":
                _, method, args, kwargs = msg
                result = getattr(obj, method)(*args, **kwargs)
            elif msg[0] == "close":
                if obj is not None and hasattr(obj, "__exit__"):
                    obj.__exit__(None, None, None)
                obj = None
                _send(answers, ("ok", None))
                return 0
            else:
                raise ValueError(f"unknown lane message {msg[0]!r}")
            reply = ("ok", result)
        except BaseException:  # noqa: BLE001 - every engine error must reach the parent with its traceback
            reply = ("err", traceback.format_exc())
        print(f"[lane] {msg[0]} {msg[1] if len(msg) > 1 else ''}: {reply[0]}", file=sys.stderr, flush=True)
        _send(answers, reply)


if __name__ == "__main__":
    # Serve through the module imported by its real name, so what the child pickles (numpy arrays via _npy_load)
    # names engines.subprocess_lane rather than __main__.
    from lpdiff.engines.subprocess_lane import _serve as serve

    sys.exit(serve(int(sys.argv[1])))
