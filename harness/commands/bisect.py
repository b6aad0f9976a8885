"""``lpdiff bisect MODEL [--adapter A ...] [--tp N] [--fault F]``: where does the triton runtime first leave HF + PEFT?

Both engines see the same prompts. HF is hooked (decoder layers, each layer's token mixer, the MoE's experts with
their routing and its shared expert) and every module of the triton runtime is re-run on HF's own inputs to that
module, so each module's error is its own, not inherited from the layers before it. Per layer, in data-flow order,
each module first on the base weights (adapter off: a defect of the module itself), then its adapter's delta:

  attention, attention_lora                 a full-attention layer's self_attn / Nemotron-H attention mixer
  linear_attention, linear_attention_lora   Qwen3.5's Gated DeltaNet (conv1d, gated delta rule, gated norm)
  mamba, mamba_lora                         Nemotron-H's Mamba-2 mixer (conv1d, SSD scan, gated norm)
  mlp, mlp_lora                             Nemotron-H's dense relu² MLP layer
  router          routing weights scattered to (tokens, experts): wrong experts or wrong weights
  latent, latent_lora                       Nemotron-Super's fc1_latent_proj and fc2_latent_proj, each on HF's input
  experts, expert_lora                      the routed experts on HF's routing
  shared_expert, shared_expert_lora         the MoE's shared expert (Qwen3.5's with its sigmoid gate)
  hidden          the layer's output hidden state, each engine running freely (errors accumulate here)

A module's "_lora" delta is its output with the adapter minus without, in both engines. A layer has the modules of
its kind (a Nemotron-H layer one mixer or one MoE; a Qwen3.5 layer a mixer and a MoE), the table only the columns
some layer has.

Errors are ||a - b|| / ||b|| relative to the HF module's output (for deltas: the module's full output, so a delta
that should be zero still has a scale). The noise floor comes from two correct implementations, never from the
engine under test (a defect that touches every layer would otherwise be its own floor): HF with its second expert
kernel against HF eager (batched_mm on CPU, grouped_mm on a GPU), the worst relative error of any module in any
layer between them — fp32 rounding between two orderings of the same arithmetic (2-3.4e-7 on the tiny zoo, where
the clean runtime's worst module is 3.3e-7). The first layer + module (+ adapter) whose error exceeds ``factor`` x
the floor is named.

A finding inside a Mamba-2 or Gated DeltaNet mixer is followed into it (commands/bisect_steps.py): the mixer's
sub-steps (projections, conv1d, the scan / delta rule and its state, the D skip or the gates, the gated norm,
out_proj) captured in both engines at TP 1, the first above the module's limit (and bisect_steps.STEP_SHARE of
the module's error) named as the finding's ``step``.

The runtime may run at any TP size (its capture returns the all-reduced, full module outputs) against HF at TP 1.
One adapter: every row runs it. Several: one mixed batch of base rows plus every adapter's rows (as a default run's
session), each row's modules compared with HF run with that row's adapter, so a finding names the adapter too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lpdiff.engines.base import dense_routing
from lpdiff.harness.commands import bisect_steps
from lpdiff.harness.spec.errors import InputError

MIXERS = ("attention", "linear_attention", "mamba", "mlp")  # a layer's token mixer, named by its kind
MOE = ("latent", "experts", "shared_expert")  # latent: Nemotron-Super's fc1 / fc2_latent_proj around the experts


def lora_of(module: str) -> str:
    """The name of a module's adapter delta."""
    return "expert_lora" if module == "experts" else f"{module}_lora"


MODULES = (
    *(n for m in MIXERS for n in (m, lora_of(m))),
    "router",
    *(n for m in MOE for n in (m, lora_of(m))),
    "hidden",
)
FACTOR = 10.0
FLOOR_MIN = 1e-7  # fp32 relative rounding: a bit-exact clean module would otherwise give a zero floor
BASE = "base"  # how the report names a mixed batch's rows without an adapter

Choice = str | None  # an adapter name, or None for base rows
Errors = dict[tuple[Choice, int, str], float]  # (adapter, layer, module) -> relative error


def label(choice: Choice) -> str:
    return BASE if choice is None else choice


@dataclass(slots=True)
class Finding:
    layer: int
    module: str
    error: float
    floor: float
    factor: float
    adapter: Choice = None
    step: str | None = None  # the mixer's first sub-step above the limit (bisect_steps.STEPS), where it has steps
    step_error: float | None = None

    @property
    def ratio(self) -> float:
        return self.error / self.floor

    @property
    def limit(self) -> float:
        return self.factor * self.floor


_rel = bisect_steps.rel  # ||a - b|| / ||scale||


def equal_length(prompts: Sequence[Sequence[int]], num_prompts: int = 8) -> list[list[int]]:
    """The first ``num_prompts``, cut to the shortest of them, so HF's batch needs no padding and its flattened
    tokens are the triton runtime's packed order."""
    first = [list(p) for p in prompts[:num_prompts]]
    n = min(len(p) for p in first)
    return [p[:n] for p in first]


def batch_choices(adapters: Sequence[str]) -> list[Choice]:
    """One adapter: every row runs it. Several: base rows, then each adapter's rows (session.mixed_batch's order)."""
    return list(adapters) if len(adapters) == 1 else [None, *adapters]


def _used(adapters: dict, choices: Sequence[Choice]) -> dict:
    """The adapters HF is opened with: the batch's (PEFT's unused adapters change nothing but its load time)."""
    return {c: adapters[c] for c in choices if c is not None}


def hf_captures(
    spec, adapters: dict, choices: Sequence[Choice], prompts, options: dict | None = None, steps: Sequence[int] = ()
) -> dict:
    """HF's per-layer module inputs and outputs on ``prompts`` for each choice (fp32, TP 1): choice -> capture;
    with the hybrid mixers' sub-steps of layers ``steps`` (bisect_steps.STEPS)."""
    from lpdiff.engines import EngineConfig, open_engine

    opts = {"router_margins": False, **(options or {})}
    with open_engine("hf", EngineConfig(model=spec, adapters=_used(adapters, choices), options=opts)) as eng:
        return {c: eng.capture_layers(prompts, c, steps=steps) for c in choices}


def reference_floor(spec, adapters: dict, choices: Sequence[Choice], prompts, reference: dict) -> dict[str, float]:
    """The noise floor of every module kind: the worst module error, over every choice, between HF's two correct
    expert kernels (``reference`` is the eager captures), floored at FLOOR_MIN."""
    from lpdiff.harness.pipeline.noise import noise_pair

    (_, other), _ = noise_pair("hf", "float32")
    pair = hf_captures(spec, adapters, choices, prompts, other)
    errs = [e for c in choices for e in module_errors(pair[c], reference[c]).values()]
    worst = max([FLOOR_MIN] + [e for e in errs if e == e])  # NaN would be a bug in HF itself: ignore
    return dict.fromkeys(MODULES, worst)


def triton_captures(
    spec,
    adapters: dict,
    choices: Sequence[Choice],
    prompts,
    hf: dict,
    fault: str | None = None,
    tp: int = 1,
    steps: Sequence[int] = (),
) -> dict:
    """Each triton module re-run on HF's inputs to it (fp32, TP ``tp``), every choice's rows in one batch ->
    choice -> that choice's rows of the capture (with the sub-steps of the hybrid mixers of layers ``steps``, TP 1).
    The runtime holds every adapter of ``adapters`` in its slots, as a run's session does (unused slots and rank
    padding are where some defects live)."""
    from lpdiff.engines import EngineConfig, open_engine

    rows = [p for _ in choices for p in prompts]
    row_adapters = [c for c in choices for _ in prompts]
    joined = {k: torch.cat([hf[c][k] for c in choices]) for k in hf[choices[0]] if k[1].endswith(INPUTS)}
    cfg = EngineConfig(model=spec, adapters=dict(adapters), tp=tp, options={"fault": fault} if fault else {})
    with open_engine("triton", cfg) as eng:
        got = eng.capture_layers(rows, row_adapters, inputs=joined, steps=steps)
    n = len(prompts) * len(prompts[0])  # tokens per choice: equal-length prompts, packed in order
    return {c: {k: v[g * n : (g + 1) * n] for k, v in got.items()} for g, c in enumerate(choices)}


INPUTS = ("_in", "router_ids", "router_weights")  # the reference's points the runtime's re-runs read


def triton_errors(
    spec, adapters: dict, choices: Sequence[Choice], prompts, hf: dict, fault: str | None = None, tp: int = 1
) -> Errors:
    """triton_captures -> relative error per (choice, layer, module), each choice's rows against HF run with that
    choice."""
    got = triton_captures(spec, adapters, choices, prompts, hf, fault, tp)
    return {(c, *k): e for c in choices for k, e in module_errors(got[c], hf[c]).items()}


def module_errors(got: dict, ref: dict) -> dict[tuple[int, str], float]:
    """Two engines' captures -> relative error per (layer, MODULES entry) for the modules the reference captured
    in that layer: a module on the base weights relative to the reference's base output; its adapter delta
    relative to the reference module's full output (so a delta that should be zero still has a scale)."""
    err: dict[tuple[int, str], float] = {}
    for i in sorted({i for i, _ in ref}):
        for mod in (*MIXERS, *MOE):
            if (i, mod) not in ref:
                continue
            if (i, mod) not in got or (i, f"{mod}_base") not in got:
                raise RuntimeError(f"the engine under test captured no {mod} of layer {i}, which the reference has")
            out, base, r, r_base = got[i, mod], got[i, f"{mod}_base"], ref[i, mod], ref[i, f"{mod}_base"]
            err[i, mod] = _rel(base, r_base, r_base)
            err[i, lora_of(mod)] = _rel(out - base, r - r_base, r)
        if (i, "router_ids") in ref:
            ids, ref_ids = got[i, "router_ids"], ref[i, "router_ids"]
            width = 1 + max(int(ids.max()), int(ref_ids.max()))  # one width for both: the error is unchanged by it
            dense = dense_routing(ids, got[i, "router_weights"], width)
            dense_ref = dense_routing(ref_ids, ref[i, "router_weights"], width)
            err[i, "router"] = _rel(dense, dense_ref, dense_ref)
        if (i, "hidden") in ref:
            err[i, "hidden"] = _rel(got[i, "hidden"], ref[i, "hidden"], ref[i, "hidden"])
    return err


def _choices(errors: Errors) -> list[Choice]:
    return list(dict.fromkeys(c for c, _, _ in errors))


def first_above(errors: Errors, floors: dict[str, float], factor: float) -> Finding | None:
    """The earliest layer, then module in data-flow order, then adapter in batch order, above ``factor`` x floor."""
    choices = _choices(errors)
    for layer in sorted({i for _, i, _ in errors}):
        for mod in MODULES:
            for c in choices:
                e = errors.get((c, layer, mod))
                if e is not None and not e <= factor * floors[mod]:  # NaN counts as above
                    return Finding(layer, mod, e, floors[mod], factor, c)
    return None


@dataclass(slots=True)
class BisectResult:
    model: str
    choices: list[Choice]
    fault: str | None
    tp: int
    errors: Errors
    floors: dict
    factor: float
    finding: Finding | None
    steps: dict[str, float] | None = None  # the found mixer's sub-step errors (bisect_steps.step_errors)

    def table(self) -> str:
        width = max(len("adapter"), *(len(label(c)) for c in self.choices))
        cols = [m for m in MODULES if any(k[2] == m for k in self.errors)]  # the modules some layer has
        cw = {m: max(10, len(m)) for m in cols}
        rows = [
            f"{'noise':<{width}}  {'':>5}  " + "  ".join(f"{self.floors[m]:>{cw[m]}.3g}" for m in cols),
            f"{'adapter':<{width}}  {'layer':>5}  " + "  ".join(f"{m:>{cw[m]}}" for m in cols),
        ]
        for c in self.choices:
            for i in sorted({i for cc, i, _ in self.errors if cc == c}):
                cells = []
                for m in cols:
                    e = self.errors.get((c, i, m))  # None: a module this layer's kind does not have
                    cells.append(
                        f"{'-':>{cw[m] - 1}} "
                        if e is None
                        else f"{e:>{cw[m] - 1}.3g}{'*' if not e <= self.factor * self.floors[m] else ' '}"
                    )
                rows.append(f"{label(c):<{width}}  {i:>5}  " + "  ".join(cells))
        f = self.finding
        if f is not None and self.steps is not None:
            limit, lora = step_limit(f), f.module.endswith("_lora")
            errs = {k.removesuffix("_lora"): e for k, e in self.steps.items() if k.endswith("_lora") == lora}
            cells = [f"{k} {e:.3g}{'*' if not e <= limit else ''}" for k, e in errs.items()]
            rows.append(f"\nlayer {f.layer} {f.module} of {label(f.adapter)}, step by step (TP 1): " + ", ".join(cells))
        return "\n".join(rows)

    def summary(self) -> str:
        f = self.finding
        what = f"fault {self.fault}" if self.fault else "the runtime"
        head = f"{self.model} [{', '.join(map(label, self.choices))}] tp={self.tp} {what}"
        if f is None:
            return f"{head}: every module within {self.factor:g}x its noise floor"
        inside = ""
        if self.steps is not None:
            inside = (
                f"; inside it first {f.step} (error {f.step_error:.3g})"
                if f.step is not None
                else "; every sub-step within the limit at TP 1"
            )
        return (
            f"{head}: first above noise: layer {f.layer} {f.module} of {label(f.adapter)} "
            f"(error {f.error:.3g} = {f.ratio:.3g}x its floor {f.floor:.3g}; limit {f.factor:g}x){inside}"
        )


@dataclass(slots=True)
class BisectRuns:
    """One bisect per TP size on the same HF captures and floors (a default bisect: TP 1 and 2, as a run's)."""

    results: list[BisectResult]

    @property
    def finding(self) -> Finding | None:
        return next((r.finding for r in self.results if r.finding is not None), None)

    def table(self) -> str:
        return "\n\n".join(f"tp={r.tp}\n{r.table()}" for r in self.results)

    def summary(self) -> str:
        return "\n".join(r.summary() for r in self.results)


# rows a default bisect spreads over its batch: a run's default batch (base + 5 zoo adapters) at 8 prompts each
# costs 6x one adapter's HF captures, the dominant cost on a CPU; 2 prompts per choice keep every choice's rows
DEFAULT_ROWS = 8
MIN_PROMPTS = 2
# the archs whose layers both engines capture module by module (HF: engines/hf_capture.py layer_modules; the triton
# runtime: MoeTransformer's re-runs, a hybrid model's capture_modules)
ARCHS = ("qwen3_moe", "gpt_oss", "qwen3_5_moe", "qwen3_5_moe_text", "nemotron_h")


def bisects(model: str) -> bool:
    """Whether ``lpdiff bisect`` can localise a triton defect on this model (its arch is in ARCHS)."""
    from lpdiff.harness.spec.resolve import resolve_model

    return resolve_model(model, weights=False).arch in ARCHS


def bisect(
    model: str,
    adapters: Sequence[str] | None = None,
    fault: str | None = None,
    factor: float = FACTOR,
    num_prompts: int | None = None,
    tp: int | Sequence[int] | None = None,
) -> BisectResult | BisectRuns:
    """``adapters``: zoo names or PEFT directories, resolved as ``lpdiff run --adapter`` does (None: every zoo
    adapter of the model, with base rows: the batch a default ``lpdiff run`` judges); several make a mixed batch
    with base rows. ``tp``: one size -> a BisectResult; several, or None (``lpdiff run``'s default sizes for
    triton, commands/run.py default_tps) -> BisectRuns, HF's side computed once. ``num_prompts`` per adapter
    (None: DEFAULT_ROWS over the batch, at least MIN_PROMPTS each)."""
    from lpdiff.engines import capabilities
    from lpdiff.harness.commands.run import default_tps
    from lpdiff.harness.spec.resolve import resolve

    sizes = capabilities("triton").tp
    tps = list(default_tps("triton")) if tp is None else [tp] if isinstance(tp, int) else list(dict.fromkeys(tp))
    for t in tps:
        if t not in sizes:  # before any engine starts
            raise InputError(f"--tp {t}: the triton runtime runs TP {', '.join(map(str, sizes))}")
    r = resolve(model, list(adapters) if adapters else None)
    if r.spec.arch not in ARCHS:
        raise InputError(
            f"lpdiff bisect captures {', '.join(ARCHS)} layers module by module, not {r.spec.arch}; "
            f"`lpdiff metamorphic {model} ADAPTER --engine triton` judges the runtime against itself"
        )
    if not r.adapters:
        raise InputError(f"model {model!r} has no zoo adapters: name one with --adapter (a PEFT directory)")
    choices = batch_choices(list(r.adapters))
    prompts = equal_length(r.prompts, num_prompts or max(MIN_PROMPTS, DEFAULT_ROWS // len(choices)))
    hf = hf_captures(r.spec, r.adapters, choices, prompts, {"experts_impl": "eager"})
    floors = reference_floor(r.spec, r.adapters, choices, prompts, hf)
    out: list[BisectResult] = []
    drilled: dict[tuple, dict[str, float]] = {}  # (layer, module, adapter) -> its mixer's sub-step errors
    for t in tps:
        errors = triton_errors(r.spec, r.adapters, choices, prompts, hf, fault, t)
        res = BisectResult(model, choices, fault, t, errors, floors, factor, first_above(errors, floors, factor))
        into_mixer(res, r.spec, r.adapters, prompts, hf, drilled)
        out.append(res)
    return out[0] if isinstance(tp, int) else BisectRuns(out)


def drill(spec, adapters: dict, choices: Sequence[Choice], prompts, hf: dict, finding: Finding, fault) -> dict:
    """The named mixer's sub-step errors for the finding's adapter choice (bisect_steps.step_errors): HF re-captures
    that choice with the layer's steps traced; the runtime runs the module comparison's whole batch at TP 1 on HF's
    captured inputs (``hf``: choice -> capture)."""
    layer, choice = finding.layer, finding.adapter
    ref = hf_captures(spec, adapters, [choice], prompts, steps=[layer])[choice]
    got = triton_captures(spec, adapters, choices, prompts, hf, fault, 1, [layer])[choice]
    mixer = bisect_steps.mixer_of(finding.module)
    assert mixer is not None, "drill runs on a finding in a mixer (into_mixer)"
    return bisect_steps.step_errors(got, ref, layer, mixer)


def into_mixer(res: BisectResult, spec, adapters: dict, prompts, hf: dict, cache: dict | None = None) -> None:
    """A finding in a Mamba-2 / Gated DeltaNet mixer: its sub-step errors (``drill``, once per layer, module and
    adapter over ``cache``) into ``res.steps`` and the first above the limit into the finding."""
    f = res.finding
    if f is None or bisect_steps.mixer_of(f.module) is None:
        return
    key = (f.layer, f.module, f.adapter)
    cache = {} if cache is None else cache
    if key not in cache:
        cache[key] = drill(spec, adapters, res.choices, prompts, hf, f, res.fault)
    set_step(res, cache[key])


def step_limit(f: Finding) -> float:
    """How far a sub-step of the found mixer must be off to be named: the module's limit, and STEP_SHARE of the
    module's own error (bisect_steps.STEP_SHARE)."""
    return max(f.limit, bisect_steps.STEP_SHARE * f.error)


def set_step(res: BisectResult, steps: dict[str, float]) -> None:
    """The found mixer's sub-step errors into ``res``; the first above the finding's limit, and above STEP_SHARE of
    the module's own error, into the finding."""
    f = res.finding
    mixer = None if f is None else bisect_steps.mixer_of(f.module)
    assert f is not None and mixer is not None, "set_step runs on a finding in a mixer (into_mixer)"
    res.steps = steps
    hit = bisect_steps.first_step(steps, mixer, f.module.endswith("_lora"), step_limit(f))
    f.step, f.step_error = hit if hit is not None else (None, None)
