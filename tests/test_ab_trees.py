"""benchmarks/ab_trees.py's checks and summary (the timing itself needs a GPU: it runs on the device)."""
import pytest

from tests.helpers import load_script


def _ab():
    return load_script("benchmarks/ab_trees.py", "ab_trees")


def _tree(path):
    for p in ("mamba_rl", "csrc", "benchmarks"):
        (path / p).mkdir(parents=True)
    (path / "benchmarks" / "bench.py").write_text("")
    return path


@pytest.mark.parametrize("argv,msg", [
    (["--trees", "A"], "--trees needs at least two trees to compare, got 1"),
    (["--trees", "A", "nope"], "lacks ['mamba_rl', 'csrc', 'benchmarks/bench.py']"),
    (["--trees", "A", "A"], "the same tree twice"),
    (["--trees", "A", "B", "--rows", "128x16"], "--rows expects DMxBxT (e.g. 128x64x1024), got '128x16'"),
    (["--trees", "A", "B", "--rows", "0x16x64"], "--rows expects d_model, B and T >= 1, got '0x16x64'"),
    (["--trees", "A", "B", "--rounds", "0"], "--rounds must be >= 1 and --iters >= 0, got 0 and 0"),
])
def test_bad_arguments_stop_before_any_process_starts(tmp_path, capsys, argv, msg):
    _tree(tmp_path / "A"), _tree(tmp_path / "B")
    argv = [str(tmp_path / a) if a in ("A", "B", "nope") else a for a in argv]
    with pytest.raises(SystemExit) as e:
        _ab().main(argv + ["--out", str(tmp_path / "ab.json")])
    assert e.value.code == 2 and msg in capsys.readouterr().err
    assert not (tmp_path / "ab.json").exists()


def test_summary_is_the_median_over_rounds_per_tree_and_row():
    res = [dict(tree="a", d_model=128, B=16, T=64, us=v) for v in (10.0, 30.0, 20.0)] + \
          [dict(tree="b", d_model=128, B=16, T=64, us=5.0), dict(tree="b", d_model=128, B=64, T=128, us=7.0)]
    assert _ab().summarise(res, ["a", "b"]) == {"a": {"128x16x64": 20.0}, "b": {"128x16x64": 5.0, "128x64x128": 7.0}}
