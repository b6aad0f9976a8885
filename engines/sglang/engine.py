"""SGLangEngine: the offline ``sgl.Engine`` inside a subprocess lane, or the HTTP ``/generate`` API of a server
lpdiff launches or one already running (see the package docstring)."""

from __future__ import annotations

import json
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from lpdiff.engines.base import AdapterChoice, Decoding, EngineConfig, check_request
from lpdiff.engines.sglang.requests import (
    decode_request,
    generate_request,
    parse_batch,
    parse_decode,
    server_args,
    server_cli,
)
from lpdiff.engines.subprocess_lane import (
    LaneConfig,
    LaneEngine,
    ManagedProcess,
    lane_config_from_options,
    strip_lane_options,
)
from lpdiff.harness.spec.errors import InputError
from lpdiff.harness.types import PromptLogprobs

_OWN_OPTIONS = ("mode", "url", "server_args", "port", "request_timeout_s", "checkpoint_dir", "capture_routing")
_RESOLVED = "_resolved"  # option the parent hands the lane: {"server_args": ..., "vocab_size": ...}
_NOT_INSTALLED = (
    "sglang is not installed for {python}: install sglang==0.5.15 (or unpack the offline bundle from "
    "gpu-bundles/sglang-0.5.15.sh and put it on PYTHONPATH), or pass options python=<interpreter "
    "that has SGLang>"
)


def resolve(config: EngineConfig, opts: dict[str, Any], launch: bool = True) -> dict[str, Any]:
    """What the engine needs from lpdiff's side, computed in the caller's process: the vocabulary size and, when
    lpdiff starts SGLang (``launch``), the ServerArgs with the checkpoint written by the caller's transformers (the
    same build as the HF reference's). The lane child then needs neither lpdiff's catalog nor its transformers."""
    from lpdiff.harness.spec.catalog import hf_config

    text = hf_config(config.model).get_text_config()
    out: dict[str, Any] = {"vocab_size": text.vocab_size}
    if config.options.get("capture_routing"):  # requests.parse_routed_experts' shape
        types = getattr(text, "layers_block_type", None)
        out["routing"] = {
            "layers": text.num_hidden_layers,
            "top_k": text.num_experts_per_tok,
            "moe_layers": [i for i, t in enumerate(types) if t == "moe"] if types else None,
        }
    if launch:
        from lpdiff.engines.checkpoint import checkpoint_dir

        # checkpoint_dir gives back the GPU blocks its build cached: SGLang sizes its pools from free memory
        path = checkpoint_dir(config.model, opts.get("checkpoint_dir"), on_cpu=False)
        out["server_args"] = server_args(config, path, opts.get("server_args"))
    return out


# -- offline: sgl.Engine, run inside the lane's child process ------------------------------------------------------


class SGLangOffline:
    """``sgl.Engine`` as an lpdiff engine. Runs in the lane's child (see SGLangEngine); never in the caller."""

    name = "sglang"

    def __init__(self, config: EngineConfig):
        self.config, self.opts = config, dict(config.options)
        self.engine: Any = None  # sgl.Engine while entered

    def __enter__(self) -> SGLangOffline:
        try:
            import sglang as sgl
        except ImportError as e:
            raise ImportError(_NOT_INSTALLED.format(python=sys.executable)) from e
        res = self.resolved = self.opts.get(_RESOLVED) or resolve(self.config, self.opts)
        self.vocab = res["vocab_size"]
        self.engine = sgl.Engine(**res["server_args"])
        return self

    def __exit__(self, *exc) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None

    def version(self) -> str:
        import sglang
        import torch

        return f"sglang {sglang.__version__}, torch {torch.__version__}"

    def _live(self) -> Any:
        if self.engine is None:
            raise RuntimeError("SGLangOffline is used inside `with` (the lane's child enters it)")
        return self.engine

    def prompt_logprobs(self, prompts, adapter: AdapterChoice = None, top_k: int = 0) -> list[PromptLogprobs]:
        names = check_request(prompts, adapter, self.config.adapters)
        routing = self.resolved.get("routing")
        out = self._live().generate(**generate_request(prompts, names, top_k, self.vocab, routing is not None))
        return parse_batch(prompts, out, top_k, self.vocab, routing)

    def decode(self, prompts, adapter: AdapterChoice, how: Decoding):
        names = check_request(prompts, adapter, self.config.adapters)
        out = self._live().generate(**decode_request(prompts, names, how.max_new_tokens, how.sampling, how.seed))
        return parse_decode(prompts, out, how.max_new_tokens)


# -- HTTP: a launched or running server ----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SGLangHTTP:
    """/generate on a running server (``url``), or on one launched here under a ManagedProcess whose log tail is
    attached when it dies."""

    name = "sglang"

    def __init__(self, config: EngineConfig, opts: dict[str, Any], lane: LaneConfig, resolved: dict[str, Any]):
        self.config, self.opts, self.lane, self.resolved = config, opts, lane, resolved
        self.url: str = opts.get("url") or ""  # "": launch a server in __enter__
        self.timeout = opts.get("request_timeout_s")  # None: the lane's work-scaled call deadline
        self.server: ManagedProcess | None = None

    def __enter__(self) -> SGLangHTTP:
        self.vocab = self.resolved["vocab_size"]
        if not self.url:
            port = int(self.opts.get("port") or _free_port())
            argv = [
                self.lane.python,
                "-m",
                "sglang.launch_server",
                *server_cli(self.resolved["server_args"]),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ]
            self.server = ManagedProcess(
                argv, self.lane.env, self.lane.log_path, self.lane.tail_lines, log_prefix="lpdiff-sglang-server-"
            ).start()
            self.url = f"http://127.0.0.1:{port}"
            self._wait_ready(self.server, self.lane.start_timeout_s)
        return self

    def __exit__(self, *exc) -> None:
        if self.server is not None:
            self.server.kill()
            self.server = None

    def _wait_ready(self, server: ManagedProcess, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            rc = server.poll()
            if rc is not None:
                died = server.died("starting the SGLang server", rc, f"exited with status {rc}")
                self.__exit__()
                raise died
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                died = server.died("starting the SGLang server", None, f"was not ready in {timeout:.0f} s")
                self.__exit__()
                raise died
            time.sleep(1.0)

    def post(self, path: str, payload: dict[str, Any], tokens: int = 0) -> Any:
        req = urllib.request.Request(
            self.url + path, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            timeout = float(self.timeout) if self.timeout is not None else self.lane.call_timeout(tokens)
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:  # the server answered: its message says what was wrong
            raise RuntimeError(f"SGLang {path} answered {e.code}: {e.read().decode(errors='replace')[:2000]}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            if self.server is not None:
                rc = self.server.wait(5)  # None: still running, so the request itself failed
                if rc is not None:
                    raise self.server.died(f"SGLang {path}", rc, f"exited with status {rc}") from None
            raise RuntimeError(f"SGLang {path} at {self.url} failed: {e}") from None

    def version(self) -> str:
        try:
            with urllib.request.urlopen(self.url + "/model_info", timeout=10) as r:
                info = json.loads(r.read())
            return f"sglang server {self.url} ({info.get('model_path', '?')})"
        except (urllib.error.URLError, ValueError):
            return f"sglang server {self.url}"

    def prompt_logprobs(self, prompts, adapter: AdapterChoice = None, top_k: int = 0) -> list[PromptLogprobs]:
        names = check_request(prompts, adapter, self.config.adapters)
        routing = self.resolved.get("routing")
        out = self.post(
            "/generate",
            generate_request(prompts, names, top_k, self.vocab, routing is not None),
            sum(map(len, prompts)),
        )
        return parse_batch(prompts, out, top_k, self.vocab, routing)

    def decode(self, prompts, adapter: AdapterChoice, how: Decoding):
        names = check_request(prompts, adapter, self.config.adapters)
        out = self.post(
            "/generate",
            decode_request(prompts, names, how.max_new_tokens, how.sampling, how.seed),
            sum(map(len, prompts)) + how.max_new_tokens * len(prompts),
        )
        return parse_decode(prompts, out, how.max_new_tokens)


# -- the engine ----------------------------------------------------------------------------------------------------


class SGLangEngine:
    name = "sglang"

    def __init__(self, config: EngineConfig):
        lane, opts = lane_config_from_options({"lane": "subprocess", **config.options})
        if lane is None:
            raise InputError(
                "the sglang engine always runs in a subprocess lane (a PEFT 3D adapter kills SGLang's "
                "process); drop option lane='inprocess'"
            )
        unknown = sorted(set(opts) - set(_OWN_OPTIONS))
        if unknown:
            raise InputError(
                f"unknown sglang engine options {unknown}; known: {', '.join(_OWN_OPTIONS)}, python, "
                "lane_env, lane_start_timeout_s, lane_call_timeout_s, lane_log"
            )
        self.mode = opts.get("mode", "offline")
        if self.mode not in ("offline", "http"):
            raise InputError(f"option mode must be 'offline' or 'http', got {self.mode!r}")
        if config.dtype == "float32":
            server_args(config, "")  # raises the fp32 error before anything starts
        self.config, self.opts, self.lane = config, opts, lane
        self._impl: LaneEngine | SGLangHTTP | None = None

    def __enter__(self) -> SGLangEngine:
        resolved = resolve(self.config, self.opts, launch=self.mode == "offline" or "url" not in self.opts)
        impl: LaneEngine | SGLangHTTP
        if self.mode == "offline":
            child = strip_lane_options(self.config)
            child = replace(child, options={**child.options, _RESOLVED: resolved})
            impl = LaneEngine(self.name, "lpdiff.engines.sglang:SGLangOffline", child, self.lane)
        else:
            impl = SGLangHTTP(self.config, self.opts, self.lane, resolved)
        impl.__enter__()
        self._impl = impl
        return self

    def __exit__(self, *exc) -> None:
        if self._impl is not None:
            self._impl.__exit__(*exc)
            self._impl = None

    def version(self) -> str:
        return self._impl.version() if self._impl is not None else "sglang (not started)"

    def prompt_logprobs(
        self, prompts: Sequence[Sequence[int]], adapter: AdapterChoice = None, top_k: int = 0
    ) -> list[PromptLogprobs]:
        if self._impl is None:
            raise RuntimeError("use the engine as a context manager: `with open_engine('sglang', cfg) as eng:`")
        return self._impl.prompt_logprobs(prompts, adapter, top_k)

    def decode(self, prompts: Sequence[Sequence[int]], adapter: AdapterChoice, how: Decoding):
        """SGLang's own generation with its logprobs (requests.decode_request)."""
        if self._impl is None:
            raise RuntimeError("use the engine as a context manager: `with open_engine('sglang', cfg) as eng:`")
        return self._impl.decode(prompts, adapter, how)
