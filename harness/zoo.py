"""The tiny model zoo: five small checkpoints (four MoE architectures and one dense model) that behave like trained
models, so that verdicts on a laptop mean something (DESIGN.md: "Random init is a trap").

    python -m harness.zoo build [--name N] [--steps S]   # tokenizer + held-out text (if missing) + model(s)
    python -m harness.zoo measure [--name N]              # entropy, router margins, bf16-vs-fp32 noise

Recipe (seeded; the committed weights are the source of truth, a rebuild on another machine or torch may differ):
  1. Corpus: the top-level modules of the running Python's standard library (``Lib/*.py``), minus a few held-out
     modules whose text is committed to ``harness/data/heldout.txt`` (prompt sets are cut from it).
  2. Tokenizer: byte-level BPE with ``VOCAB`` entries trained on that corpus (one tokenizer for the whole zoo,
     committed to ``harness/data/tokenizer/`` and copied into every model directory).
  3. Each model: transformers' own init under ``torch.manual_seed(SEED)``, then AdamW on next-token loss over
     random windows of ``SEQ_LEN`` tokens, plus two router terms on MoE layers:
       - balance: Switch-style load balancing (fraction routed x mean probability) so that every expert is used
         (Nemotron instead updates its ``e_score_correction_bias`` aux-loss-free, as the real model is trained);
       - margin: a hinge on the scale-free routing margin, (s_k - s_k+1) / std(s) < ``margin_target``, where s are
         the scores the router ranks by. Scaling the router does not move this ratio (bf16 rounding and the
         propagated noise of bf16 hidden states scale with the scores too), so only a real gap satisfies it.
  4. Saved with ``save_pretrained`` in fp32 (the Hub layout transformers writes) plus the tokenizer files.
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

from harness.catalog import ZOO, ZOO_DIR

DATA_DIR = Path(__file__).resolve().parent / "data"
TOKENIZER_DIR = DATA_DIR / "tokenizer"
HELDOUT = DATA_DIR / "heldout.txt"
VOCAB = 1024
EOS = "<|endoftext|>"
SEQ_LEN = 128
SEED = 0
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
# Expert widths are not multiples of 32 on purpose: kernels that forget to mask partial blocks must fail here.
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
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=40, shared_expert_intermediate_size=72,
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
    steps: int = 600
    batch: int = 16
    lr: float = 3e-3
    warmup: int = 30
    weight_decay: float = 0.01
    balance_weight: float = 0.01
    margin_weight: float = 0.1
    margin_target: float = 1.0  # wanted (s_k - s_k+1) / std(s) per token and MoE layer
    bias_update_rate: float = 1e-3  # Nemotron's aux-loss-free correction-bias step
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
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer=trainer)
    assert tok.get_vocab_size() == VOCAB and tok.token_to_id(EOS) == 0
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS, model_max_length=1024)
    TOKENIZER_DIR.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(TOKENIZER_DIR)
    return fast


def load_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)
