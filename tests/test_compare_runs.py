"""scripts/compare_runs.py: rows matched by key and commit, the ratio and the +-tol flag."""
from scripts import compare_runs as cr

HEAD = "date,commit,gpu,torch,triton,bench,variant,B,H,S,D,density,ms\n"


def test_matches_rows_of_the_named_commits(tmp_path, capsys):
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    a.write_text(HEAD + "d,old,g,t,t,bench_x,k1,1,40,32760,128,1,2.00\n"
                        "d,other,g,t,t,bench_x,k1,1,40,32760,128,1,9.00\n"
                        "d,old,g,t,t,bench_x,k2,1,40,32760,128,1,1.00\n"
                        "d,old,g,t,t,bench_x,acc,1,40,32760,128,1,nan\n")
    b.write_text(HEAD + "d,new,g,t,t,bench_x,k1,1,40,32760,128,1,2.02\n"
                        "d,new,g,t,t,bench_x,k2,1,40,32760,128,1,1.10\n"
                        "d,new,g,t,t,bench_x,k3,1,40,32760,128,1,1.00\n")
    res = cr.compare(cr.load(f"{a}:old"), cr.load(f"{b}:new"), 0.02)
    assert [(k[1], round(r, 3), flag) for k, _, _, r, flag in res] == [("k1", 1.01, False), ("k2", 1.1, True)]
    assert cr.main(["--a", f"{a}:old", "--b", f"{b}:new", "--out", str(tmp_path / "t.txt")]) == 0
    assert "1 outside +-2%" in capsys.readouterr().out
    assert "median new/old 1.055" in (tmp_path / "t.txt").read_text()
