"""tools/render_results.py on small CSVs written through benchmarks.common.append_rows: the latest row of
each variant wins, the README headline table and the generation tables render, plots when matplotlib is
installed; and append_rows widens an existing header instead of dropping new columns."""
import csv
import importlib.util
import os

import pytest

from benchmarks import common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("render_results", os.path.join(ROOT, "tools", "render_results.py"))
render = importlib.util.module_from_spec(spec)
spec.loader.exec_module(render)

@pytest.fixture(autouse=True)
def _this_triton_is_the_reference(monkeypatch):
    """The rows these tests write record the installed Triton; the published blocks show the reference release's
    rows only (``REFERENCE_TRITON``), so here the installed one is the reference."""
    import triton
    monkeypatch.setattr(render, "REFERENCE_TRITON", ".".join(triton.__version__.split(".")[:2]) + ".")


def test_published_blocks_keep_the_reference_triton_and_toolchain_compares():
    """Rows of another Triton release stay out of the published tables and appear side by side in ``toolchain``."""
    base = dict(date="2026-12-06 10:00", commit="abc", gpu="GPU X", torch="2.11", bench="bench_vsmooth_attn_sm90",
                H="40", S="32760", D="128", inputs="structured")
    rows = [dict(base, triton="3.6.0", variant="exp2_kernel", ms="26.0"),
            dict(base, triton="3.9.0", variant="exp2_kernel", ms="28.6"),
            dict(base, triton="", variant="old_row", ms="1.0")]
    render_ref = render.REFERENCE_TRITON
    try:
        render.REFERENCE_TRITON = "3.6."
        kept = render.reference_rows(rows)
        assert [r["triton"] for r in kept] == ["3.6.0", ""]
        text = "\n".join(render.toolchain_tables(rows, []))
    finally:
        render.REFERENCE_TRITON = render_ref
    assert "| 40 | 32760 | exp2_kernel | 26.00 | 28.60 (+10.0%) |" in text, text


PIPE = dict(model="wan2.1-t2v-1.3b", B=1, H=12, S=32760, D=128, layers=30, steps=50, guidance=5.0,
            compile="regional")


def _pipe_rows(stock_ms, vs_ms):
    return [dict(PIPE, variant="stock", ms=stock_ms, speedup_vs_stock=1.0, first_generation_s=70.0,
                 first_generation_extra_s=0.0),
            dict(PIPE, variant="vsmooth", ms=vs_ms, speedup_vs_stock=stock_ms / vs_ms, first_generation_s=75.0,
                 first_generation_extra_s=5.0, attn_ms=30000.0, attn_dense_ms=0.0, attn_group_ms=9000.0,
                 attn_anchor_ms=0.0, attn_reuse_ms=21000.0, rel_l2=0.01)]


def test_append_rows_widens_the_header(tmp_path):
    path = str(tmp_path / "x.csv")
    common.append_rows("x", [{"variant": "a", "ms": 1.0, "extra1": 5}], path=path)
    common.append_rows("x", [{"variant": "b", "ms": 2.0, "extra2": 7}], path=path, extras=["extra1", "extra2"])
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0])[:len(common.COLUMNS)] == common.COLUMNS
    assert list(rows[0])[-2:] == ["extra1", "extra2"]
    assert (rows[0]["extra1"], rows[0]["extra2"]) == ("5", "")
    assert (rows[1]["extra1"], rows[1]["extra2"], rows[1]["bench"]) == ("", "7", "x")
    common.append_rows("x", [{"variant": "c", "ms": 3.0, "junk": 1}], path=path)  # not named in extras
    with open(path, newline="") as f:
        assert "junk" not in next(csv.reader(f))  # an existing header only grows by the named extras


def test_render_latest_rows_tables_and_plots(tmp_path, capsys):
    res, img = tmp_path / "results", tmp_path / "img"
    p = str(res / "bench_pipeline.csv")
    common.append_rows("bench_pipeline", _pipe_rows(60000.0, 50000.0), path=p)
    common.append_rows("bench_pipeline", _pipe_rows(52000.0, 40000.0), path=p)  # a later run: it wins
    g = str(res / "bench_generation.csv")
    base = dict(B=1, H=40, S=32760, D=128, steps=3)
    common.append_rows("bench_generation", [
        dict(base, variant="sdpa_cudnn", ms=114.0, speedup_vs_cudnn=1.0, step_ms="38 38 38", rel_l2=1.7e-3),
        dict(base, variant="mcsparse@0.15", ms=70.0, speedup_vs_cudnn=114 / 70, step_ms="38 24 8", n_dense=1,
             ms_dense=38.0, n_group=0, ms_group=0.0, n_anchor=1, ms_anchor=24.0, n_reuse=1, ms_reuse=8.0),
        dict(base, variant="mcsparse@0.15:reuse_breakdown", ms=8.0, attn_kernel_ms=7.7, other_kernels_ms=0.1,
             gap_ms=0.2, host_ms=0.3, outside_share=0.0375)], path=g)
    text = render.main(["--results-dir", str(res), "--img-dir", str(img)])
    assert "| V-Smooth | 40.0 | 1.30x | 75.0 (+5.0) | 30.0 | 0.0 / - / 9.0 / 0.0 / 21.0 | 1.00e-02 |" in text
    assert "| stock (Inductor + cuDNN) | 52.0 | 1.00x |" in text and "60.0" not in text
    assert "| MC-Sparse s = 0.15 | 70 | 1.63x | - | 38 (1) / - (0) / 0 (0) / 24 (1) / 8 (1) |" in text
    assert "| MC-Sparse s = 0.15 | 8.00 | 7.70 | 0.10 | 0.20 | 0.30 | 3.8% |" in text
    gen_head = next(ln for ln in text.splitlines() if ln.startswith("**Bare attention over a 3-step"))
    assert "runs: " in gen_head and "(cuDNN (bf16), MC-Sparse s = 0.15)" in gen_head  # the run, its rows
    assert "own run" not in gen_head  # one run: no note on mixed baselines
    assert "random weights: speed only, not quality" in text
    if importlib.util.find_spec("matplotlib") is None:
        assert "plots skipped" in capsys.readouterr().err
        pytest.skip("matplotlib not installed: tables checked, plots skipped")
    for name in ("bench_pipeline_speedup.png", "bench_generation_phases.png"):
        assert os.path.getsize(img / name) > 1000


def _kernel_rows(path, commit_ms):
    """bench_vsmooth_attn rows of two runs; only the second has an fa4-bf16 baseline."""
    base = dict(B=1, H=40, S=32760, D=128)
    for cudnn, vs, fa4 in commit_ms:
        rows = [dict(base, variant="sdpa_cudnn", ms=cudnn, speedup_vs_cudnn=1.0),
                dict(base, variant="vsmooth_kernel", ms=vs, speedup_vs_cudnn=cudnn / vs, rel_l2=5.7e-3),
                dict(base, variant="vsmooth_op", ms=vs + 1.0, speedup_vs_cudnn=cudnn / (vs + 1.0), rel_l2=5.7e-3),
                dict(base, S=8190, variant="vsmooth_kernel", ms=1.0, speedup_vs_cudnn=2.0)]  # not a table size
        if fa4 is not None:
            rows.append(dict(base, variant="fa4-bf16", ms=fa4))
        common.append_rows("bench_vsmooth_attn", rows, path=path)


def test_write_replaces_marked_blocks_only(tmp_path):
    res = tmp_path / "results"
    res.mkdir()
    k = str(res / "bench_vsmooth_attn.csv")
    _kernel_rows(k, [(40.0, 32.0, None)])
    with open(k) as fh:  # the second run must differ in (date, commit) to count as another run
        first = fh.read()
    _kernel_rows(k, [(38.0, 27.0, 30.0)])
    with open(k) as fh:
        lines = fh.read().splitlines()
    n_first = len(first.splitlines())
    lines[n_first:] = [ln.replace(ln.split(",")[0], "2099-01-01 00:00", 1) for ln in lines[n_first:]]
    with open(k, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    doc = tmp_path / "doc.md"
    doc.write_text("intro\n<!-- results:pipeline:begin -->\nstale 1.99x\n<!-- results:pipeline:end -->\nmiddle\n"
                   "<!-- results:kernels:begin --><!-- results:kernels:end -->\n"
                   "<!-- results:kernels-summary:begin -->\n<!-- results:kernels-summary:end -->\ntail\n")
    render.main(["--results-dir", str(res), "--no-plots", "--write", "--docs", str(doc)])
    out = doc.read_text()
    assert out.startswith("intro\n<!-- results:pipeline:begin -->\n") and out.endswith("\ntail\n")
    assert "middle" in out and "stale" not in out  # old numbers never survive a rewrite
    assert "No rows yet: `benchmarks/results/bench_pipeline.csv`" in out  # no CSV: says so, invents nothing
    # the latest run wins; x FA4 = fa4 ms / ms of the same run (30 / 27); S = 8190 is not a table size
    assert "| 32760 | V-Smooth kernel | - | 27.00 | 1.41x | 1.11x | - | 5.70e-03 | 2099-01-01" in out
    assert "| 32760 | SDPA cuDNN (bf16) | - | 38.00 | 1.00x | 0.79x |" in out
    assert "| 8190 |" not in out and "32.00" not in out
    assert "**bench_sparse_attn**: no rows yet" in out
    assert "| 32760 | 1.36x (1.07x FA4) | - | - |" in out  # the README summary: the op, x cuDNN and x FA4
    again = doc.read_text()
    render.main(["--results-dir", str(res), "--no-plots", "--write", "--docs", str(doc)])
    assert doc.read_text() == again  # idempotent


def test_write_rejects_broken_markers(tmp_path):
    texts = {"pipeline": "x", "kernels": "y"}
    for bad in ("<!-- results:pipeline:begin -->\nno end\n",
                "<!-- results:pipeline:end -->\n<!-- results:pipeline:begin -->\n",
                "<!-- results:nope:begin --><!-- results:nope:end -->\n",
                "<!-- results:pipeline:begin --><!-- results:kernels:begin -->"
                "<!-- results:pipeline:end --><!-- results:kernels:end -->\n"):
        p = tmp_path / "bad.md"
        p.write_text(bad)
        with pytest.raises(ValueError, match="bad.md"):
            render.write_blocks(str(p), texts)
        assert p.read_text() == bad  # nothing written on error


def test_sm90_ab_block_shows_the_latest_run_per_shape():
    """The launch A/B block: every row of the latest run of each (H, S, inputs), an older run of that shape left
    out, baselines without their long notes."""
    from tools.render_results import sm90_ab_tables
    base = dict(B="1", D="128", gpu="NVIDIA H200", inputs="structured")
    rows = [dict(base, H="40", S="32760", date="2026-12-02 01:00", commit="aaa", variant="expcast_kernel", ms="25.0",
                 speedup_vs_cudnn="1.5", note="old"),
            dict(base, H="40", S="32760", date="2026-12-02 02:00", commit="bbb", variant="fa3-fp8", ms="23.0",
                 speedup_vs_cudnn="1.7", note="a long baseline note"),
            dict(base, H="40", S="32760", date="2026-12-02 02:00", commit="bbb", variant="expcast_kernel", ms="24.0",
                 speedup_vs_cudnn="1.6", speedup_vs_fa3="0.96", note="new")]
    text = sm90_ab_tables(rows)[0]
    assert "24.00" in text and "0.96x" in text and "| new |" in text
    assert "25.00" not in text and "a long baseline note" not in text
    assert "bench_vsmooth_attn_sm90.csv" in sm90_ab_tables([])[0]
    # a D = 64 run of the same (H, S, inputs) is a shape of its own: it hides none of the D = 128 rows
    d64 = [dict(r, D="64", date="2026-12-02 03:00", commit="ccc", ms="17.0", variant=r["variant"] + "_d64")
           for r in rows[1:]]
    text = sm90_ab_tables(rows + d64)[0]
    assert "24.00" in text and "17.00" in text and "| 64 |" in text and "| 128 |" in text


def test_sparse_sm90_block_shows_the_latest_run_per_shape_with_eta():
    """The gather-kernel block: every row of the latest run of each (H, S, D) with its eta and x cuDNN, an older run
    of that shape left out, the configs named shortly (the default, the Triton kernel's shipped config)."""
    from tools.render_results import sparse_sm90_tables
    base = dict(B="1", H="40", S="32760", D="128", gpu="NVIDIA H200", C="128", density="0.15")
    rows = [dict(base, date="2026-12-02 01:00", commit="aaa", variant="gluon_sm90_gather", config="128/2",
                 ms="7.5", eta="0.61", speedup_vs_cudnn="5.0"),
            dict(base, date="2026-12-03 02:00", commit="bbb", variant="sdpa_cudnn", density="1.0", ms="38.0"),
            dict(base, date="2026-12-03 02:00", commit="bbb", variant="triton_gather",
                 config="SparseAttnConfig(block_n=64, num_warps=4)", ms="7.6", eta="0.63", speedup_vs_cudnn="4.99"),
            dict(base, date="2026-12-03 02:00", commit="bbb", variant="gluon_sm90_gather",
                 config="default (SparseAttnSm90Config(block_n=128))", ms="6.48", eta="0.74", speedup_vs_cudnn="5.87",
                 rel_l2="1.69e-3")]
    text = sparse_sm90_tables(rows)[0]
    assert "| 6.48 | 5.87x | 0.74 | 1.69e-03 |" in text and "| default |" in text and "| shipped |" in text
    assert "7.50" not in text and "38.00" in text
    assert "bench_sparse_attn_sm90.csv" in sparse_sm90_tables([])[0]


def test_schedule_block_keeps_the_latest_row_of_each_schedule():
    """The schedule block: one row per (variant, density, steps, warm-up, anchors), the latest; dense rows left out."""
    from tools.render_results import schedule_tables
    base = dict(density="0.15", steps="50", warmup_steps="10", device="cpu", variant="mcsparse@0.15")
    rows = [dict(base, variant="dense", density="1", warmup_steps="", psnr_db="inf", date="2026-12-02", commit="a"),
            dict(base, anchors="10 26", psnr_db="26.0", ssim="0.9", attn_cost="98.7", date="2026-12-02", commit="a"),
            dict(base, anchors="10 26", psnr_db="26.84", ssim="0.903", attn_cost="98.7", date="2026-12-03",
                 commit="b"),
            dict(base, anchors="10 18 26 34 42", psnr_db="33.12", ssim="0.976", attn_cost="125.7", date="2026-12-03",
                 commit="b")]
    rows.append(dict(rows[2], seed="1", psnr_db="26.42", date="2026-12-04"))  # another seed: a row of its own
    text = schedule_tables(rows)[0]
    assert "| 10 26 | 0 | 26.84 | 0.903 | 99 |" in text and "| 10 18 26 34 42 | 0 | 33.12 | 0.976 | 126 |" in text
    assert "| 10 26 | 1 | 26.42 |" in text
    assert "26.00" not in text and "inf" not in text
    assert "bench_mcsparse_schedule.csv" in schedule_tables([])[0]


def test_sm90_kernel_line_quotes_the_default_launches_of_the_latest_run():
    """README's kernel-alone table: per S the latest run's ExpCast and V-Smooth default rows beside FA3 FP8's,
    launch variants and other shapes left out."""
    from tools.render_results import sm90_kernel_line
    base = dict(H="40", D="128", inputs="structured", S="32760")
    rows = [dict(base, date="2026-12-01 01:00", commit="old", variant="expcast_kernel", ms="25.0"),
            dict(base, date="2026-12-03 01:00", commit="new", variant="fa3-fp8", ms="23.0", rel_l2="0.09"),
            dict(base, date="2026-12-03 01:00", commit="new", variant="expcast_kernel", ms="23.5", speedup_vs_fa3="0.98",
                 rel_l2="0.006"),
            dict(base, date="2026-12-03 01:00", commit="new", variant="expcast_kernel:pv_window=1", ms="24.0"),
            dict(base, D="64", date="2026-12-04 01:00", commit="d64", variant="expcast_kernel", ms="16.8")]
    text = sm90_kernel_line(rows)
    assert "23.50 ms, 0.98x FA3 FP8" in text and "23.00 ms; rel. L2 9.0e-02" in text and "2026-12-03 new" in text
    assert "25.00" not in text and "24.00" not in text and "16.80" not in text
    assert sm90_kernel_line([]) == ""


def test_cold_start_block_shows_the_latest_run():
    """bench_cold_start.csv: only the latest run's rows (date to the hour and commit), each process mode."""
    base = dict(model="wan2.1-t2v-1.3b", S=32760, steps=10, gpu="NVIDIA H200")
    old = [dict(base, date="2026-12-01 10:00", commit="aaa", variant="stock", mode="fresh", first_call_s=30.0,
                extra_s=0.0)]
    new = [dict(base, date="2026-12-02 12:59", commit="bbb", variant=v, mode=m, first_call_s=t, extra_s=e,
                steady_s=8.0, startup_s=t - 8.0, startup_extra_s=e)
           for v, m, t, e in (("stock", "fresh", 23.0, 0.0), ("stock", "second", 12.5, 0.0),
                              ("vsmooth", "fresh", 26.9, 3.9), ("vsmooth", "second", 11.6, -0.9))]
    text = render.cold_start_tables(old + new)[0]
    assert "commit bbb" in text and "| vsmooth | fresh | 26.9 | +3.9 |" in text
    assert "30.0" not in text  # the older run is not shown
    assert "No rows yet" in render.cold_start_tables([])[0]


def test_pipeline_table_names_its_runs_the_float8_stack_and_torchao_error_ratio(tmp_path):
    """Rows of one configuration from two runs: the title names both (each speed-up is against its own run's
    stock); a float8-linear variant is named as the method + float8 linears; the attention error is given as a
    multiple of torchao's where a torchao row has one."""
    p = str(tmp_path / "bench_pipeline.csv")
    common.append_rows("bench_pipeline", [
        dict(PIPE, variant="stock", ms=52000.0, speedup_vs_stock=1.0, commit="aaaaaaa", date="2026-01-01 10:00"),
        dict(PIPE, variant="torchao-fp8", ms=40000.0, speedup_vs_stock=1.3, attn_rel_l2=0.1, commit="aaaaaaa",
             date="2026-01-01 10:02")], path=p)
    common.append_rows("bench_pipeline", [
        dict(PIPE, variant="stock", ms=53000.0, speedup_vs_stock=1.0, commit="bbbbbbb", date="2026-01-02 10:00"),
        dict(PIPE, variant="vsmooth+expcast+f8lin", ms=39000.0, speedup_vs_stock=53 / 39, attn_rel_l2=0.004,
             commit="bbbbbbb", date="2026-01-02 10:03")], path=p)
    (text,) = render.pipeline_tables(render.read(p))
    assert "2026-01-01 10:02 commit aaaaaaa (torchao FP8 attention (FA3 FP8))" in text  # the rows shown
    assert "commit bbbbbbb (stock (Inductor + cuDNN), V-Smooth + ExpCast + float8 linears)" in text
    assert "each speed-up against the stock generation of its own run" in text
    assert "| V-Smooth + ExpCast + float8 linears | 39.0 | 1.36x |" in text and "4.00e-03 (0.04x torchao)" in text
    lines = [ln for ln in text.splitlines() if ln.startswith("| ")]
    assert [ln.split(" | ")[0] for ln in lines[1:]] == ["| stock (Inductor + cuDNN)", "| torchao FP8 attention (FA3 FP8)",
                                                        "| V-Smooth + ExpCast + float8 linears"]


def test_pipeline_table_shows_memory_where_a_run_measured_it(tmp_path):
    """Peak GPU memory and the metadata held (the production-size rows) as a column of their own, "-" for a row
    that has none; a table none of whose rows measured memory has no such column."""
    p = str(tmp_path / "bench_pipeline.csv")
    common.append_rows("bench_pipeline", [
        dict(PIPE, variant="stock", ms=52000.0, speedup_vs_stock=1.0, commit="aaaaaaa", date="2026-01-01 10:00"),
        dict(PIPE, variant="mcsparse@0.15", ms=30000.0, peak_mem_gb=42.0971, metadata_gb=9.07105,
             commit="bbbbbbb", date="2026-01-02 10:00")], path=p)
    (text,) = render.pipeline_tables(render.read(p))
    assert "GB peak allocated / metadata held" in text
    assert text.splitlines()[-1].endswith("| 42.1 / 9.1 |") and "| - / - |" in text
    q = str(tmp_path / "other.csv")
    common.append_rows("bench_pipeline", [dict(PIPE, variant="stock", ms=52000.0, commit="c", date="d")], path=q)
    assert "GB peak" not in render.pipeline_tables(render.read(q))[0]


def test_stack_variant_names():
    assert render.name("stock+f8lin") == "float8 linears (torchao), attention stock"
    assert render.name("stock+dbcache") == "cache-dit DBCache, attention stock"
    assert render.name("mcsparse@0.15+f8lin+dbcache") == "MC-Sparse s = 0.15 + float8 linears + cache-dit DBCache"
    assert render._pipe_order(["mcsparse@0.15+dbcache", "vsmooth+f8lin", "stock", "vsmooth"]) == [
        "stock", "vsmooth", "vsmooth+f8lin", "mcsparse@0.15+dbcache"]


def test_each_gpu_keeps_its_own_tables(tmp_path):
    """Rows of another GPU appended after the reference GPU's (an H100 run, say) never replace the H200's latest
    figures: each GPU gets its own tables, the H200's first and unheaded, the other's under its name; one GPU alone
    renders as before, unheaded."""
    res = tmp_path / "results"
    p = str(res / "bench_pipeline.csv")
    h200 = [dict(r, gpu="NVIDIA H200", date="2026-12-04 10:00", commit="aaa") for r in _pipe_rows(52000.0, 40000.0)]
    common.append_rows("bench_pipeline", h200, path=p)
    one = render.blocks(str(res))["pipeline"]
    assert "On the" not in one and "| stock (Inductor + cuDNN) | 52.0 | 1.00x |" in one
    h100 = [dict(r, gpu="NVIDIA H100 80GB HBM3", date="2026-12-05 10:00", commit="bbb")
            for r in _pipe_rows(53000.0, 41000.0)]
    common.append_rows("bench_pipeline", h100, path=p)
    both = render.blocks(str(res))["pipeline"]
    ref, other = both.split("On the NVIDIA H100 80GB HBM3:")
    assert "| stock (Inductor + cuDNN) | 52.0 | 1.00x |" in ref and "53.0" not in ref
    assert "| stock (Inductor + cuDNN) | 53.0 | 1.00x |" in other and "52.0" not in other
    assert render.gpus_of(h100 + h200) == ["NVIDIA H200", "NVIDIA H100 80GB HBM3"]
    # {bench: rows} inputs are split the same way
    k = {"bench_vsmooth_attn": [dict(gpu="NVIDIA H100 80GB HBM3")], "bench_sparse_attn": [dict(gpu="NVIDIA H200")]}
    seen = []
    render.per_gpu(lambda rows: seen.append({b: len(rs) for b, rs in rows.items()}) or "x", k)
    assert seen == [{"bench_vsmooth_attn": 0, "bench_sparse_attn": 1}, {"bench_vsmooth_attn": 1, "bench_sparse_attn": 0}]


def test_key_padding_block_shows_the_latest_run_per_shape():
    base = dict(gpu="NVIDIA H200", H="24", S="25696", kept="64", text="256")
    old = [dict(base, date="2026-12-01 10:00", commit="aaa", variant="sdpa_masked", ms="9.0")]
    new = [dict(base, date="2026-12-07 10:00", commit="bbb", variant=v, ms=ms, host_ms="0.2", speedup_vs_masked=x,
                speedup_vs_kept=y, rel_l2=e)
           for v, ms, x, y, e in (("sdpa_masked", "6.0", "1.0", "0.5", ""), ("sdpa_kept_cudnn", "3.0", "2.0", "1.0", ""),
                                  ("vsmooth+expcast", "2.0", "3.0", "1.5", "6.1e-03"))]
    (text,) = render.key_padding_tables(old + new)
    assert "| 24 | 25696 | 64 of 256 | vsmooth+expcast | 2.00 | 0.200 | 3.00x | 1.50x | 6.10e-03 |" in text
    assert "9.00" not in text and "2026-12-07 bbb" in text  # the older run is not shown
    assert "No rows yet" in render.key_padding_tables([])[0]


def test_kmeans_block_shows_the_latest_run_with_shapes_as_columns():
    """bench_kmeans.csv: the latest commit's rows, one column per (H, S) with ms and the ratio to the reuse call."""
    base = dict(date="2026-12-07 18:30", gpu="NVIDIA H100 80GB HBM3", K=256, iters=3)
    old = [dict(base, commit="aaa", variant="kmeans", H=12, S=32760, ms=0.9, x_reuse_call=0.12, labels_equal="")]
    new = [dict(base, commit="bbb", variant=v, H=h, S=s, ms=ms, x_reuse_call=x, labels_equal=eq)
           for v, h, s, ms, x, eq in (("kmeans", 12, 32760, 0.801, 0.110, 0.9998), ("kmeans", 40, 75600, 3.76, 0.029,
                                                                                   0.9996),
                                      ("sort uint8", 12, 32760, 0.138, 0.019, 1.0))]
    text = render.kmeans_table([{k: str(v) for k, v in r.items()} for r in old + new])
    assert "commit bbb" in text and "0.900" not in text
    assert "| kmeans | 0.801 (0.110x) | 3.760 (0.029x) | 0.9996 |" in text
    assert "| sort uint8 | 0.138 (0.019x) | - | 1.0000 |" in text
    assert "No rows yet" in render.kmeans_table([])
