"""``lpdiff calibrate`` records thresholds that hold on any CPU."""

from __future__ import annotations


def test_fp32_calibration_is_floored_where_two_kernels_agree_bit_for_bit(monkeypatch):
    """On a CPU where HF's two expert kernels agree bit for bit the measured fp32 noise is 0; the recorded
    threshold must still clear what two correct engines differ by elsewhere (triton vs HF: k2 2.2e-12 on the tiny
    zoo), so it is floored at the reference's fp32 rounding, not at 30 x 1e-14. Eager against eager is that CPU."""
    from lpdiff.harness.commands import calibrate as cal

    recorded = []
    monkeypatch.setattr(cal, "record", lambda *a: recorded.append(a))
    measure = cal.measure_noise
    monkeypatch.setattr(cal, "measure_noise", lambda *a, **k: measure(*a, **{**k, "prompt_sets": ("default",)}))
    eager = cal.Lane("hf", "float32", {"experts_impl": "eager"})
    t = cal.calibrate(
        "tiny-qwen3-moe",
        eager,
        eager,
        [("triton:float32-vs-hf:float32", "float32")],
        factor=30.0,
        num_layers=2,
        log=lambda s: None,
    )
    assert "floored at fp32 rounding" in t.note
    # 3x above triton-vs-HF's own fp32 difference (unfloored: 30 x 1e-14 = 3e-13, below it)
    assert t.k2 > 3 * 2.2e-12 and t.max_abs > 3 * 7.6e-6
    assert recorded and recorded[0][3] == 1
