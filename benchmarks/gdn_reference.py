"""How far HF's fp32 Qwen3.5 reference moves when transformers routes its Gated DeltaNet to fla-core's kernels.

transformers 5.17 decorates Qwen3.5's ``torch_chunk_gated_delta_rule`` (and the conv / recurrent helpers) so that the
module-level name calls fla's Triton kernel whenever ``fla`` imports; fla's dots take fp32 inputs at TF32 precision.
This script scores one long prompt with the full-width model cut to ``--layers`` layers in fp32 twice, fla's kernels
as transformers picked them and then the decorated functions' own torch bodies (``__wrapped__``), and prints max and
mean |Δ| of the prompt logprobs. It needs CUDA and fla-core for the first run to differ (on a CPU both are torch).

  python -m benchmarks.gdn_reference [--model qwen3.5-35b-a3b] [--layers 4] [--length 4609]
"""

from __future__ import annotations

import argparse
import sys
import time


def torch_bodies() -> dict[tuple[object, str], object]:
    """(module, name) -> the torch function behind each kernel-hub-wrapped name of the loaded Qwen3.5 modules."""
    out = {}
    for mname, mod in list(sys.modules.items()):
        if not mname.startswith("transformers.models.qwen3_5") or mod is None:
            continue
        for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn"):
            fn = getattr(mod, name, None)
            if fn is not None and getattr(fn, "__wrapped__", None) is not None:
                out[(mod, name)] = fn.__wrapped__
    return out


def implementation(fn) -> str:
    """The module of the function a kernel-hub wrapper calls (its closure holds it beside the torch body)."""
    cells = [c.cell_contents for c in fn.__closure__ or () if callable(c.cell_contents)]
    other = [f for f in cells if f is not fn.__wrapped__ and getattr(f, "__module__", "")]
    return other[0].__module__ if other else "torch"


def main(argv=None) -> int:
    import torch

    from lpdiff.harness.spec.catalog import get_model, load_hf_model

    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3.5-35b-a3b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--length", type=int, default=4609)
    p.add_argument("--init-recipe", default="peaked/v1")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    spec = get_model(args.model, num_layers=args.layers, init_recipe=args.init_recipe)
    t0 = time.perf_counter()
    model = load_hf_model(spec, torch.float32, device)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (1, args.length), generator=torch.Generator().manual_seed(0)).to(device)

    def logprobs() -> torch.Tensor:
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]

    bodies = torch_bodies()
    kernels = {k: getattr(*k) for k in bodies}
    picked = {k[1]: implementation(v) for k, v in kernels.items()}
    a = logprobs()
    for (mod, name), fn in bodies.items():
        setattr(mod, name, fn)
    b = logprobs()
    for (mod, name), fn in kernels.items():
        setattr(mod, name, fn)
    d = (a - b).abs()
    print(
        f"{args.model} x{args.layers} fp32 on {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, "
        f"{args.length} tokens ({time.perf_counter() - t0:.1f}s): as picked {picked} vs torch bodies: "
        f"max |d| {d.max().item():.3g}, mean |d| {d.mean().item():.3g}, k2 {(0.5 * (a - b) ** 2).mean().item():.3g}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
