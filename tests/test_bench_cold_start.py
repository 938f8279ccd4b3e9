"""benchmarks/bench_cold_start.py without a GPU: the parent's bookkeeping (each variant fresh then second on the
same cache directory, differences to stock's in the same mode) on stand-in child results."""
from benchmarks import bench_cold_start as bc


def test_rows_compare_each_mode_with_stock(monkeypatch, capsys):
    calls = []
    fake = {("stock", "fresh"): 23.5, ("stock", "second"): 12.0, ("vsmooth", "fresh"): 26.0,
            ("vsmooth", "second"): 12.4}

    def run_child(label, mode, cache_dir, a):
        calls.append((label, mode, cache_dir))
        return {"first_call_s": fake[(label, mode)], "steady_s": 10.0, "build_s": 1.0, "sites": 30,
                "tokens": 32760, "layers": 30, "model": "wan2.1-t2v-1.3b", "process_s": fake[(label, mode)] + 9}
    appended = []
    monkeypatch.setattr(bc, "run_child", run_child)
    monkeypatch.setattr(bc, "append_rows", lambda bench, rows, **kw: appended.append(rows) or "x.csv")
    assert bc.main(["--methods", "vsmooth"]) == 0
    # fresh then second per variant, the second process on the first one's caches, a new directory per variant
    assert [(c[0], c[1]) for c in calls] == [("stock", "fresh"), ("stock", "second"), ("vsmooth", "fresh"),
                                              ("vsmooth", "second")]
    assert calls[0][2] == calls[1][2] != calls[2][2] == calls[3][2]
    rows = {(r["variant"], r["mode"]): r for r in appended[0]}
    assert rows[("vsmooth", "fresh")]["extra_s"] == 2.5 and rows[("vsmooth", "second")]["extra_s"] == 0.4
    assert rows[("stock", "fresh")]["extra_s"] == 0
    assert rows[("vsmooth", "fresh")]["startup_s"] == 16.0
    assert "vsmooth" in capsys.readouterr().out
