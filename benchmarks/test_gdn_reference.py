"""benchmarks/gdn_reference.py on the CPU: it finds the three kernel-hub-wrapped Gated DeltaNet names of transformers'
Qwen3.5 modules (so on a GPU with fla-core the comparison swaps them), and both passes are torch here."""

from __future__ import annotations


def test_gdn_reference_swaps_the_wrapped_names(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from benchmarks import gdn_reference

    assert gdn_reference.main(["--model", "tiny-qwen3.5-moe", "--layers", "2", "--length", "37"]) == 0
    names = {name for _, name in gdn_reference.torch_bodies()}
    assert names == {"torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn"}
    assert "max |d| 0," in capsys.readouterr().out  # torch against torch on the CPU
