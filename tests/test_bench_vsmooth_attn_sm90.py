"""benchmarks/bench_vsmooth_attn_sm90.py on the CPU: its arguments, its worst-case inputs and its empty table (the
timed rows need an sm_90 GPU)."""
import pytest
import torch

from benchmarks import bench_vsmooth_attn_sm90 as b


def test_smoke_prints_the_table(capsys):
    assert b.main(["--smoke", "--configs", '[{"byte_mask": false}]', "--shapes", "12x4096x128"]) == 0
    out = capsys.readouterr().out
    assert "speedup_vs_fa3" in out and "(12, 4096, 128)" in out


@pytest.mark.parametrize("bad", [["--configs", '{"byte_mask": false}'], ["--modes", "exp3"]])
def test_bad_arguments_name_the_fix(bad):
    with pytest.raises(SystemExit, match="configs|modes"):
        b.main(["--smoke", *bad])


def test_rising_inputs_move_the_max_in_most_blocks():
    """The worst case for a lazily updated max: along the keys, the running max of most query rows rises in most
    128-key blocks."""
    q, k, v = b.rising_inputs(1, 2, 2048, 64, device="cpu")
    s = (q[0, :, :64].float() @ k[0].float().transpose(-1, -2)) * 64 ** -0.5  # [H, 64 rows, S]
    blk = s.view(2, 64, 16, 128).amax(-1)  # block maxima
    run = blk.cummax(-1).values
    rises = (run[..., 1:] > run[..., :-1]).float().mean()
    assert rises > 0.5
