"""The demo's real-size timing (vc_compile/demo/speed.py): its mechanics at a tiny size on the CPU (the GPU run
uses 32760 tokens); every method row runs through the backend with its schedule, stock SDPA first."""
import torch

from vc_compile.demo.runner import known_methods

METHODS = known_methods()
from vc_compile.demo.speed import format_speed, time_methods


def test_speed_rows_for_every_method_on_cpu():
    rows = time_methods(list(METHODS)[:3], heads=2, tokens=256, head_dim=64, steps=4, device="cpu",
                        extra={"experimental": {"compiler": "eager"}}, log=lambda *a: None)
    assert [r.method for r in rows] == ["stock SDPA", "vsmooth", "vsmooth+expcast"]  # dense = the stock row
    assert rows[0].speedup == 1.0 and all(r.schedule_ms > 0 and r.step_ms > 0 for r in rows)
    assert all("reference" in r.path for r in rows[1:])  # the CPU path ran, and the row says so
    text = format_speed(rows, heads=2, tokens=256, head_dim=64, steps=4, device_name="cpu")
    assert "speed only" in text and "vsmooth+expcast" in text
    if any(r.speedup < 1.0 for r in rows[1:]):
        assert "slower than stock here" in text  # never slower than stock without saying so


def test_demo_skips_the_timing_on_cpu_by_default(monkeypatch):
    from vc_compile.demo.__main__ import parse_args
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert parse_args([]).speed_tokens == 0
    assert parse_args(["--speed-tokens", "4096"]).speed_tokens == 4096
