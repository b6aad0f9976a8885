"""The tiny model zoo: five small checkpoints (four MoE architectures and one dense model) that behave like trained
models, so that verdicts on a laptop mean something (docs/models.md, "Random init is a trap").

    python -m lpdiff.harness.spec.zoo build [--name N] [--steps S] [--corpus F] [--out DIR]  # tokenizer + held-out text
                                                                                # (if missing) + model(s)
    python -m lpdiff.harness.spec.zoo measure [--name N] [--prompt-set S] [--dir DIR] [--markdown]

Recipe (seeded; the committed weights are the source of truth, a rebuild on another machine or torch may differ):
  1. Corpus: the top-level modules of the running Python's standard library (``Lib/*.py``), minus a few held-out
     modules whose text is committed to ``harness/data/heldout.txt`` (prompt sets are cut from it).
  2. Tokenizer: byte-level BPE with ``VOCAB`` entries trained on that corpus (one tokenizer for the whole zoo,
     committed to ``harness/data/tokenizer/`` and copied into every model directory).
  3. Each model: transformers' own init under ``torch.manual_seed(SEED)``, then AdamW on next-token loss over
     random windows of ``SEQ_LEN`` tokens, plus three router terms on MoE layers:
       - margin: a hinge on the scale-free routing margin, u_k - u_k+1 < ``margin_target``, where u are the scores
         the router ranks by, standardized over experts per token. Scaling the router does not move u (bf16
         rounding and the propagated noise of bf16 hidden states scale with the scores too), so only a real gap
         satisfies it;
       - balance: E * sum_e P_e^2, P_e the batch mean of softmax(3u)_e, so that the margins are not bought by
         sending every token to the same experts (Nemotron also updates its ``e_score_correction_bias``
         aux-loss-free, as the real model is trained);
       - z: mean squared router logit, which keeps sigmoid routers out of saturation (saturated scores tie).
  4. Conditioning: ``sharpen`` scales lm_head so that the mean next-token entropy on fixed training windows is
     ``target_entropy`` x log V (a logit temperature; peaked distributions like a trained LLM's).
  5. Saved with ``save_pretrained`` in fp32 (the Hub layout transformers writes) plus the tokenizer files.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from lpdiff.harness.spec.catalog import ZOO, ZOO_DIR

DATA_DIR = Path(__file__).resolve().parents[1] / "data"
TOKENIZER_DIR = DATA_DIR / "tokenizer"
HELDOUT = DATA_DIR / "heldout.txt"
VOCAB = 1024
EOS = "<|endoftext|>"
SEQ_LEN = 128
SEED = 0
RECIPE = "zoo-recipe/v1 (harness/zoo.py docstring)"
# Held out of training: their text is committed and the prompt sets are cut from it.
HELDOUT_MODULES = ("bisect.py", "colorsys.py", "fractions.py", "graphlib.py", "queue.py", "sched.py", "shlex.py",
                   "textwrap.py")
# Not prose or code a model can learn from (generated tables, rot13, machine-specific data).
SKIPPED_MODULES = ("__hello__.py", "antigravity.py", "stringprep.py", "this.py")
DOC_SEPARATOR = "\n# ==== {name} ====\n"

_COMMON = dict(vocab_size=VOCAB, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
               max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=None, eos_token_id=0,
               pad_token_id=0, initializer_range=0.02)

# Within the brief's limits: hidden <= 256, <= 6 layers, >= 8 experts, top-k >= 2, about 1M params (4 MB fp32).
# Most expert widths are not multiples of 32 on purpose: kernels that forget to mask partial blocks must fail here.
TINY_CONFIGS: dict[str, dict] = {
    "tiny-qwen3-moe": dict(
        _COMMON, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_hidden_layers=4,
        num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=40, intermediate_size=256,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "tiny-gpt-oss": dict(
        _COMMON, model_type="gpt_oss", architectures=["GptOssForCausalLM"], num_hidden_layers=4,
        num_local_experts=8, num_experts_per_tok=4, intermediate_size=40, attention_bias=True,
        layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=16, rms_norm_eps=1e-5,
        swiglu_limit=7.0,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "original_max_position_embeddings": 256, "truncate": False, "rope_theta": 150000.0}),
    "tiny-qwen3.5-moe": dict(
        _COMMON, model_type="qwen3_5_moe_text", architectures=["Qwen3_5MoeForCausalLM"], num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}),
    "tiny-nemotron-h": dict(
        _COMMON, model_type="nemotron_h", architectures=["NemotronHForCausalLM"],
        layers_block_type=["linear_attention", "moe", "full_attention", "linear_attention", "moe", "mlp"],
        mamba_num_heads=4, mamba_head_dim=32, ssm_state_size=16, n_groups=2, conv_kernel=4, expand=1,
        chunk_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=48,
        moe_shared_expert_intermediate_size=96, intermediate_size=160, mlp_hidden_act="relu2",
        routed_scaling_factor=2.5, n_group=1, topk_group=1, norm_topk_prob=True, layer_norm_epsilon=1e-5,
        use_mamba_kernels=False),
    "tiny-qwen3-dense": dict(
        _COMMON, model_type="qwen3", architectures=["Qwen3ForCausalLM"], num_hidden_layers=4,
        intermediate_size=256, rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}
assert set(TINY_CONFIGS) == set(ZOO)


@dataclass(slots=True)
class TrainConfig:
    steps: int = 1000
    batch: int = 16
    lr: float = 3e-3
    warmup: int = 30
    weight_decay: float = 0.01
    balance_weight: float = 1.0
    margin_weight: float = 0.3
    margin_target: float = 1.0  # wanted u_k - u_k+1 (scores standardized over experts) per token and MoE layer
    router_z_weight: float = 1e-3  # mean(router logit^2): keeps sigmoid routers out of saturation
    bias_update_rate: float = 1e-4  # Nemotron's aux-loss-free correction-bias step
    target_entropy: float = 0.32  # conditioning: lm_head scaled until mean entropy = this x log V (train windows)
    seed: int = SEED

    def __post_init__(self):
        assert self.steps > 0 and self.batch > 0 and self.lr > 0 and self.margin_target > 0


# -- corpus and tokenizer ------------------------------------------------------------------------------------------

def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def training_docs() -> list[str]:
    """The training corpus: every top-level stdlib module except the held-out and skipped ones."""
    out = []
    for f in sorted(stdlib_dir().glob("*.py")):
        if f.name in HELDOUT_MODULES or f.name in SKIPPED_MODULES or f.name.startswith("_sysconfigdata"):
            continue
        out.append(f.read_text(encoding="utf-8", errors="replace"))
    assert len(out) > 100, f"found only {len(out)} stdlib modules under {stdlib_dir()}"
    return out


def write_heldout() -> None:
    parts = []
    for name in HELDOUT_MODULES:
        parts.append(DOC_SEPARATOR.format(name=name) + (stdlib_dir() / name).read_text(encoding="utf-8"))
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    HELDOUT.write_text("".join(parts), encoding="utf-8")


def heldout_docs() -> dict[str, str]:
    """Committed held-out text, by module name (never read from the running Python's stdlib)."""
    text = HELDOUT.read_text(encoding="utf-8")
    docs = {}
    for chunk in text.split("\n# ==== ")[1:]:
        name, _, body = chunk.partition(" ====\n")
        docs[name] = body
    return docs


def build_tokenizer(docs: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer=trainer)
    assert tok.get_vocab_size() == VOCAB and tok.token_to_id(EOS) == 0
    TOKENIZER_DIR.mkdir(parents=True, exist_ok=True)
    tok.save(str(TOKENIZER_DIR / "tokenizer.json"))
    save_tokenizer(TOKENIZER_DIR)
    return load_tokenizer()


def load_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


# -- models --------------------------------------------------------------------------------------------------------

def tiny_config(name: str):
    from transformers import AutoConfig

    if name not in TINY_CONFIGS:
        raise KeyError(f"unknown zoo model {name!r}; known: {', '.join(TINY_CONFIGS)}")
    kw = dict(TINY_CONFIGS[name])
    return AutoConfig.for_model(kw.pop("model_type"), **kw)


def init_model(name: str, seed: int = SEED):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(name), dtype=torch.float32)


def token_stream(tok) -> torch.Tensor:
    """The training corpus as one int64 stream, modules separated by EOS."""
    ids: list[int] = []
    for doc in training_docs():
        ids.extend(tok(doc, verbose=False)["input_ids"])
        ids.append(tok.eos_token_id)
    return torch.tensor(ids, dtype=torch.int64)


class RouterTap:
    """Keeps the router logits of the current forward (with their graph) for the router loss terms."""

    def __init__(self, model):
        from lpdiff.harness.spec.routing import is_router

        self.routers = [m for m in model.modules() if is_router(m)]
        self.logits: list[tuple[torch.nn.Module, torch.Tensor]] = []
        self._handles = [m.register_forward_hook(self._hook) for m in self.routers]

    def _hook(self, module, args, output):
        logits = output[0] if isinstance(output, tuple) else output
        self.logits.append((module, logits.reshape(-1, logits.shape[-1])))

    def pop(self) -> list[tuple[torch.nn.Module, torch.Tensor]]:
        out, self.logits = self.logits, []
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


# softmax(3u) is close to the hard top-k choice (a 1-sigma gap is a factor e^3), so P_e tracks real expert usage;
# with softmax(u) the penalty for sending every token to the same two experts was too soft to stop it.
BALANCE_SHARPNESS = 3.0


def standardized(scores: torch.Tensor) -> torch.Tensor:
    """Router scores in units of their spread over experts, per token: free of the router's scale."""
    return (scores - scores.mean(-1, keepdim=True)) / (scores.std(-1, keepdim=True) + 1e-6)


def router_losses(taps, tc: TrainConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (balance, margin, z) averaged over MoE layers; zero for a dense model.

    Both read the standardized scores u, so that neither can be met by rescaling the router: margin is the hinge
    relu(target - (u_k - u_k+1)); balance is E * sum_e P_e^2, P_e the batch mean of softmax(BALANCE_SHARPNESS * u)_e
    (1 when usage is uniform). On raw probabilities (Switch's f_e * P_e, or P_e^2) a tiny-scale router with one
    fixed ranking met the balance term while every token went to the same experts."""
    from lpdiff.harness.spec.routing import choice_scores, topk_margin

    balance = margin = z = torch.zeros(())
    for module, logits in taps:
        logits = logits.float()
        u = standardized(choice_scores(module, logits))
        margin = margin + torch.relu(tc.margin_target - topk_margin(u, int(module.top_k))).mean()
        balance = balance + u.shape[-1] * torch.softmax(BALANCE_SHARPNESS * u, dim=-1).mean(0).pow(2).sum()
        z = z + logits.pow(2).mean()
    n = max(1, len(taps))
    return balance / n, margin / n, z / n


@torch.no_grad()
def update_correction_bias(taps, rate: float) -> None:
    """Aux-loss-free balancing (how Nemotron-H / DeepSeek-V3 train the bias): raise the bias of under-used
    experts, lower it for over-used ones."""
    from lpdiff.harness.spec.routing import choice_scores

    for module, logits in taps:
        bias = getattr(module, "e_score_correction_bias", None)
        if bias is None:
            continue
        chosen = choice_scores(module, logits.detach()).topk(int(module.top_k), dim=-1).indices
        load = torch.bincount(chosen.reshape(-1), minlength=bias.numel()).float()
        bias += rate * torch.sign(load.mean() - load)


def lr_at(step: int, tc: TrainConfig) -> float:
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    t = (step - tc.warmup) / max(1, tc.steps - tc.warmup)
    return tc.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def train(name: str, stream: torch.Tensor, tc: TrainConfig, log_every: int = 50):
    """Seeded training of one zoo model from transformers' init; returns (model, log lines)."""
    model = init_model(name, tc.seed)
    model.train()
    gen = torch.Generator().manual_seed(tc.seed)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "router" not in n and ".gate." not in n]
    other = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "router" not in n and ".gate." not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay}, {"params": other, "weight_decay": 0}],
                            lr=tc.lr, betas=(0.9, 0.95))
    tap = RouterTap(model)
    log, t0 = [], time.time()
    for step in range(tc.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, tc)
        starts = torch.randint(0, stream.numel() - SEQ_LEN, (tc.batch,), generator=gen)
        x = torch.stack([stream[s:s + SEQ_LEN] for s in starts.tolist()])
        lm = model(input_ids=x, labels=x, use_cache=False).loss
        taps = tap.pop()
        balance, margin, z = router_losses(taps, tc)
        loss = lm + tc.balance_weight * balance + tc.margin_weight * margin + tc.router_z_weight * z
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        update_correction_bias(taps, tc.bias_update_rate)
        if step % log_every == 0 or step == tc.steps - 1:
            log.append(f"step {step:4d} lm {lm.item():.3f} balance {balance.item():.3f} "
                       f"margin {margin.item():.3f} z {z.item():.2f} t {time.time() - t0:.0f}s")
            print(f"[{name}] {log[-1]}", flush=True)
    tap.remove()
    model.eval()
    scale = sharpen(model, stream, tc.target_entropy, tc.seed)
    log.append(f"sharpen: lm_head x {scale:.4f}")
    return model, log


@torch.no_grad()
def sharpen(model, stream: torch.Tensor, target: float, seed: int, windows: int = 32) -> float:
    """Conditioning step: scale lm_head so that the mean next-token entropy on fixed training windows is
    ``target`` x log V. A few CPU minutes leave a ~1M-parameter model calibrated but unsure (entropy ~0.5 log V on
    held-out text); a logit temperature gives the peaked distributions of a trained LLM at a lower NLL cost than an
    entropy penalty during training (both measured; see docs/zoo.md)."""
    gen = torch.Generator().manual_seed(seed + 1)
    starts = torch.randint(0, stream.numel() - SEQ_LEN, (windows,), generator=gen).tolist()
    x = torch.stack([stream[s:s + SEQ_LEN] for s in starts])
    logits = model(input_ids=x, use_cache=False).logits.float()
    want = target * math.log(logits.shape[-1])

    def entropy(s: float) -> float:
        logp = (logits * s).log_softmax(-1)
        return float(-(logp.exp() * logp).sum(-1).mean())

    lo, hi = 0.25, 8.0
    for _ in range(40):  # entropy falls monotonically with the scale
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if entropy(mid) > want else (lo, mid)
    scale = round((lo + hi) / 2, 4)
    model.lm_head.weight.mul_(scale)
    return scale


def hub_compat(cfg: dict) -> dict:
    """Add the spellings the Hub's real config.json files use next to transformers 5's, so that engines reading
    configs with older transformers (vLLM, SGLang bundles) see the same model; transformers 5 ignores them."""
    cfg = dict(cfg)
    if cfg["model_type"] == "qwen3_moe":
        cfg["num_experts"] = cfg["num_local_experts"]
    if cfg["model_type"] == "nemotron_h":
        letters = {"linear_attention": "M", "moe": "E", "full_attention": "*", "mlp": "-"}
        cfg["hybrid_override_pattern"] = "".join(letters[t] for t in cfg["layers_block_type"])
        cfg["num_hidden_layers"] = len(cfg["layers_block_type"])
    return cfg


def save_tokenizer(out: Path) -> None:
    """tokenizer.json plus the plain tokenizer_config.json that transformers 4 and 5 both load."""
    out.mkdir(parents=True, exist_ok=True)
    if out.resolve() != TOKENIZER_DIR.resolve():
        shutil.copyfile(TOKENIZER_DIR / "tokenizer.json", out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "pad_token": EOS,
         "model_max_length": 1024}, indent=1) + "\n")


def save(out: Path, model, info: dict) -> Path:
    if out.exists():
        shutil.rmtree(out)
    model.config.use_cache = True
    model.save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(hub_compat(cfg), indent=2, sort_keys=True) + "\n")
    save_tokenizer(out)
    (out / "build.json").write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")
    return out


def build_one(name: str, stream: torch.Tensor, tc: TrainConfig, out: Path) -> dict:
    """Train ``name`` and save it to ``out`` with a build.json recording how."""
    import platform

    import transformers

    t0 = time.time()
    model, log = train(name, stream, tc)
    info = {"name": name, "train": asdict(tc), "seq_len": SEQ_LEN, "corpus_tokens": stream.numel(), "log": log,
            "build_s": round(time.time() - t0, 1), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "recipe": RECIPE}
    save(out, model, info)
    print(f"[{name}] saved to {out} in {info['build_s']}s", flush=True)
    return info


def build(names: list[str], steps: int | None = None, corpus: str | None = None, out: Path = ZOO_DIR) -> None:
    """Train and save ``names`` under ``out`` (the zoo by default). ``corpus``: a token file written by an earlier
    build (created when missing), so that a build under another Python version trains on the same stdlib text."""
    torch.set_num_threads(max(1, min(torch.get_num_threads(), 2)))  # the recipe's stated budget: 2 cores
    if not HELDOUT.exists():
        write_heldout()
    tok = load_tokenizer() if (TOKENIZER_DIR / "tokenizer.json").exists() else build_tokenizer(training_docs())
    if corpus and Path(corpus).exists():
        stream = torch.load(corpus)
    else:
        stream = token_stream(tok)
        if corpus:
            torch.save(stream, corpus)
    for name in names:
        build_one(name, stream, TrainConfig() if steps is None else TrainConfig(steps=steps), Path(out) / name)


# -- measurement ---------------------------------------------------------------------------------------------------

def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """Spacing of bf16 numbers at |x| (8 significant bits): rounding moves a value by up to half of this."""
    e = torch.floor(torch.log2(x.abs().clamp_min(1e-30)))
    return torch.exp2(e - 7)


@torch.no_grad()
def forward_stats(model, prompts: list[list[int]]) -> dict:
    """One right-padded batch (padding after a causal prompt changes none of its positions): next-token entropies
    and actual-token logprobs over all real positions, and per MoE layer the router choice scores (N, E), top-k."""
    from lpdiff.harness.spec.routing import choice_scores

    lens = torch.tensor([len(p) for p in prompts])
    ids = torch.zeros(len(prompts), int(lens.max()), dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = torch.tensor(p)
    real = torch.arange(ids.shape[1])[None] < lens[:, None]  # (B, T)
    tap = RouterTap(model)
    logp = model(input_ids=ids, use_cache=False).logits[:, :-1].float().log_softmax(-1)
    routers = [(choice_scores(m, lg)[real.flatten()], int(m.top_k)) for m, lg in tap.pop()]
    tap.remove()
    pred = real[:, 1:]  # positions with a real next token
    entropy = -(logp.exp() * logp).sum(-1)
    actual = logp.gather(-1, ids[:, 1:, None])[..., 0]
    return {"entropy": entropy[pred], "logprobs": actual[pred], "routers": routers}


def _pct(x: torch.Tensor, qs=(1, 10, 50)) -> dict[str, float]:
    x = x.double().flatten()
    return {f"p{q}": float(torch.quantile(x, q / 100)) for q in qs}


def measure(name: str, set_name: str = "default", path: Path | None = None) -> dict:
    """Entropy vs log V, router margins vs bf16 rounding and vs measured bf16 noise, bf16-vs-fp32 logprob noise."""
    from transformers import AutoModelForCausalLM

    from lpdiff.harness.spec.prompts import prompt_set
    from lpdiff.harness.spec.routing import topk_margin

    path = path or ZOO_DIR / name
    prompts = prompt_set(name, set_name)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    n_params = sum(p.numel() for p in model.parameters())
    f32 = forward_stats(model, prompts)
    # loaded again rather than cast: from_pretrained honours the modules a model keeps in fp32
    b16 = forward_stats(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval(), prompts)
    d = b16["logprobs"] - f32["logprobs"]
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    out = {
        "name": name, "prompt_set": set_name, "positions": int(d.numel()), "params": n_params, "vocab": vocab,
        "log_v": math.log(vocab), "entropy_mean": float(f32["entropy"].mean()),
        "nll_mean": float(-f32["logprobs"].mean()),
        "bf16_k2": float(0.5 * (d ** 2).mean()), "bf16_max_abs": float(d.abs().max()),
    }
    if f32["routers"]:
        margins, ratios, noise, flips, load = [], [], [], [], []
        for (s32, k), (s16, _) in zip(f32["routers"], b16["routers"]):
            counts = torch.bincount(s32.topk(k, -1).indices.flatten(), minlength=s32.shape[-1]).float()
            load.append(counts / counts.mean())
            m = topk_margin(s32, k)
            kth = s32.topk(k, dim=-1).values[:, -1]
            margins.append(m)
            ratios.append(m / bf16_ulp(kth))
            noise.append((s16 - s32).abs().max(dim=-1).values)
            same = (s32.topk(k, -1).indices.sort(-1).values == s16.topk(k, -1).indices.sort(-1).values).all(-1)
            flips.append((~same).float())
        margins, ratios, noise, flips = map(torch.cat, (margins, ratios, noise, flips))
        out.update({
            "router_positions": int(margins.numel()),
            "margin": _pct(margins), "margin_over_bf16_ulp": _pct(ratios),
            "bf16_score_noise": _pct(noise, (50, 99, 100)),
            "margin_below_noise_p99": float((margins < torch.quantile(noise.double(), 0.99)).float().mean()),
            "routing_flip_rate": float(flips.mean()),
            "expert_load_min": float(torch.cat(load).min()), "expert_load_max": float(torch.cat(load).max()),
        })
    return out


def markdown(rows: list[dict]) -> str:
    """The measured table of docs/zoo.md."""
    head = ("| model | params | vocab | entropy (nats) | entropy / log V | NLL | router margin p1 / p10 / p50 | "
            "margin / bf16 spacing p1 / p10 / p50 | bf16 score noise p99 / max | fp32-vs-bf16 expert-set flips | "
            "expert load min / max | bf16-vs-fp32 k2 | max abs d |\n" + "|---" * 13 + "|\n")
    lines = []
    for r in rows:
        moe = "margin" in r
        fmt3 = (lambda d: " / ".join(f"{v:.3g}" for v in d.values())) if moe else (lambda d: "-")
        lines.append(
            f"| {r['name']} | {r['params']:,} | {r['vocab']} | {r['entropy_mean']:.2f} | "
            f"{r['entropy_mean'] / r['log_v']:.2f} | {r['nll_mean']:.2f} | {fmt3(r.get('margin'))} | "
            f"{fmt3(r.get('margin_over_bf16_ulp'))} | "
            + (f"{r['bf16_score_noise']['p99']:.3g} / {r['bf16_score_noise']['p100']:.3g} | "
               f"{r['routing_flip_rate']:.2%} | {r['expert_load_min']:.2f} / {r['expert_load_max']:.2f} | "
               if moe else "- | - | - | ")
            + f"{r['bf16_k2']:.2e} | {r['bf16_max_abs']:.3f} |")
    return head + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lpdiff.harness.spec.zoo", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="train and save zoo model(s) (all by default)")
    b.add_argument("--name", action="append", choices=list(TINY_CONFIGS))
    b.add_argument("--steps", type=int, help=f"training steps (default {TrainConfig.steps})")
    b.add_argument("--corpus", help="token file of an earlier build (written when missing)")
    b.add_argument("--out", default=str(ZOO_DIR), help="where to write the model directories (default: the zoo)")
    m = sub.add_parser("measure", help="print the zoo's measured properties as JSON lines")
    m.add_argument("--name", action="append", choices=list(TINY_CONFIGS))
    m.add_argument("--prompt-set", default="default")
    m.add_argument("--dir", default=str(ZOO_DIR), help="where the model directories are (default: the zoo)")
    m.add_argument("--markdown", action="store_true", help="print the table of docs/zoo.md")
    args = ap.parse_args(argv)
    names = args.name or list(TINY_CONFIGS)
    if args.cmd == "build":
        build(names, args.steps, args.corpus, Path(args.out))
    else:
        torch.set_num_threads(max(1, min(torch.get_num_threads(), 2)))
        rows = []
        for n in names:
            rows.append(measure(n, args.prompt_set, Path(args.dir) / n))
            print(json.dumps(rows[-1]), flush=True)
        if args.markdown:
            print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
