"""benchmarks/timeline.py's critical-path split: a kernel's time alone, its share of overlaps, and idle gaps."""
from tests.helpers import load_script


def _timeline():
    return load_script("benchmarks/timeline.py", "timeline")


def test_critical_splits_solo_shared_and_idle_time():
    # a [0, 10) alone then with b over [6, 10); b runs on to 12; a gap [12, 15); c [15, 20) alone
    ks = [("a(x)", 7, 0.0, 10.0), ("b", 8, 6.0, 6.0), ("c", 7, 15.0, 5.0)]
    r = _timeline().critical(ks)
    assert r["span_us"] == 20.0 and r["idle_us"] == 3.0
    got = {k["name"]: (k["solo_us"], k["shared_us"]) for k in r["kernels"]}
    assert got == {"a": (6.0, 2.0), "b": (2.0, 2.0), "c": (5.0, 0.0)}
    assert [k["name"] for k in r["kernels"]] == ["a", "c", "b"]  # by total time


def test_every_shape_is_checked_before_any_is_profiled(tmp_path, capsys):
    import pytest

    for bad, msg in (("0x4x4", "d_model, B and T >= 1, got '0x4x4'"), ("12x3", "DMxBxT"), ("axbxc", "DMxBxT")):
        with pytest.raises(SystemExit) as e:
            _timeline().main(["--out", str(tmp_path / "t.json"), "--shape", "128x4x16", bad])
        assert e.value.code == 2 and msg in capsys.readouterr().err
    assert not (tmp_path / "t.json").exists()
