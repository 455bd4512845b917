"""benchmarks/learning/popgym.py: parsing, MMER, the table, and one tiny run of each method end to end (CPU)."""
import json
import math
import os
import re

import pytest

from tests.helpers import load_script



@pytest.fixture(scope="module")
def pg():
    return load_script("benchmarks/learning/popgym.py", "popgym_table")  # not "popgym": that is the env package


def test_env_id_and_sets(pg):
    assert pg.env_id("AutoencodeEasy") == "popgym-AutoencodeEasy-v0"
    assert pg.env_id("popgym-BattleshipEasy-v0") == "popgym-BattleshipEasy-v0"
    assert pg.env_id("mamba_rl/CartPoleNoVel-v1") == "mamba_rl/CartPoleNoVel-v1"
    assert pg.file_name("mamba_rl/CartPoleNoVel-v1") == "mamba_rl_CartPoleNoVel-v1"
    assert pg.parse_sets(["prev_action=True", "learning_rate=3e-4", "backend=cpu"]) == {
        "prev_action": True, "learning_rate": 3e-4, "backend": "cpu"}
    with pytest.raises(ValueError, match="NAME=VALUE"):
        pg.parse_sets(["prev_action"])


def test_mmer_is_the_max_over_finite_points(pg):
    assert pg.mmer([(1024, math.nan), (2048, -0.5), (3072, 0.25), (4096, 0.1)]) == 0.25
    assert math.isnan(pg.mmer([(1024, math.nan)]))
    curve = [(1024, 0.9), (2048, 0.2), (3072, 0.3)]
    assert pg.mmer_full_window(curve, [8, 100, 150]) == 0.3  # the 0.9 is the mean of the first 8 episodes
    assert math.isnan(pg.mmer_full_window(curve, [8, 16, 24]))


def _fake_run(out, method, task, seed, values):
    d = os.path.join(out, method)
    os.makedirs(d, exist_ok=True)
    base = os.path.join(d, f"{task}__seed{seed}")
    with open(base + ".csv", "w") as f:
        f.write("global_step,episodes,mean_return_last100,wall_s\n")
        for i, v in enumerate(values):
            f.write(f"{1024 * (i + 1)},{100 * i},{v},{i}\n")
    json.dump({"task": task, "method": method, "seed": seed, "total": 1024 * len(values), "steps": 1024 * len(values),
               "mmer": max(values), "final": values[-1], "wall_s": 1.0, "versions": {"torch": "x"}, "eval": math.nan},
              open(base + ".json", "w"))


def test_summary_table_and_plot(pg, tmp_path):
    out = str(tmp_path)
    _fake_run(out, "mamba", "BattleshipEasy", 0, [-0.5, -0.3, -0.35])
    _fake_run(out, "mamba", "BattleshipEasy", 1, [-0.5, -0.1, -0.2])
    _fake_run(out, "sb3", "BattleshipEasy", 0, [-0.5, -0.4, -0.42])
    res = pg.summarise(out)
    s = res["summary"]["BattleshipEasy|mamba"]
    assert s["mmer"] == {"0": -0.3, "1": -0.1}
    assert s["mean"] == pytest.approx(-0.2) and s["std"] == pytest.approx(math.sqrt(0.02))
    assert s["spread"] == pytest.approx(0.2)
    assert s["mmer_full"] == {"0": -0.3, "1": -0.1}  # the first point (0 episodes) never counts
    _fake_run(out, "mamba__x", "AutoencodeEasy", 0, [-0.5, -0.4])  # a row without sb3 and without plain mamba
    pg.summarise(out)
    md = open(tmp_path / "table.md").read()
    lines = [line for line in md.splitlines() if line.startswith("|")]
    assert len({line.count("|") for line in lines}) == 1, md  # every row has every column
    full = open(tmp_path / "table_full_window.md").read()
    assert "-0.200 ± 0.141 (2, 3k)" in full
    md = open(tmp_path / "table.md").read()
    row = next(line for line in md.splitlines() if line.startswith("| BattleshipEasy"))
    assert "-0.200 ± 0.141 (2, 3k)" in row and "-0.400 ± 0.000 (1, 3k)" in row and "+0.200" in row
    pg.plot(res["runs"], str(tmp_path / "curves.png"))
    assert (tmp_path / "curves.png").stat().st_size > 1000


def test_bars_mean_row_and_columns(pg, tmp_path):
    out = str(tmp_path)
    _fake_run(out, "sb3", "BattleshipEasy", 0, [-0.5, -0.4])  # LSTM -0.4: bar -0.35
    _fake_run(out, "sb3", "RepeatPreviousEasy", 0, [0.5, 0.97])  # within 0.05 of 1: bar 0.99
    _fake_run(out, "mamba__a", "BattleshipEasy", 0, [-0.5, -0.3])  # +0.100, meets -0.35
    _fake_run(out, "mamba__a", "RepeatPreviousEasy", 0, [0.5, 0.98])  # +0.010, short of 0.99
    _fake_run(out, "mamba__b", "BattleshipEasy", 0, [-0.5, -0.38])  # +0.020, short of -0.35
    assert pg.bar("BattleshipEasy", -0.4) == (pytest.approx(-0.35), "-0.350")
    assert pg.bar("RepeatPreviousEasy", 0.97) == (0.99, ">= 0.99")
    assert math.isnan(pg.bar("mamba_rl/CartPoleNoVel-v1", 400.0)[0])  # no bar off POPGym's return scale
    pg.summarise(out, columns=["mamba__a", "sb3"])
    md = open(tmp_path / "table.md").read()
    lines = [line for line in md.splitlines() if line.startswith("|")]
    assert len({line.count("|") for line in lines}) == 1, md
    assert "mamba__b" not in md  # not among the columns
    row = next(line for line in lines if line.startswith("| BattleshipEasy"))
    assert "| -0.350 | +0.100 * |" in row
    row = next(line for line in lines if line.startswith("| RepeatPreviousEasy"))
    assert "| >= 0.99 | +0.010 |" in row
    assert lines[-1].startswith("| mean of (method - sb3)") and "+0.055 over 2, bars 1 of 2" in lines[-1]
    assert json.load(open(tmp_path / "summary.json"))["BattleshipEasy|mamba__b"]["mean"] == pytest.approx(-0.38)


@pytest.mark.parametrize("method,extra,folder", [
    ("mamba", ["--variant", "tiny", "--set", "d_model=16", "--set", "n_layers=1"], "mamba__tiny"),
    ("mamba", ["--variant", "mlp", "--set", "d_model=16", "--set", "n_layers=1", "--set", "head_hidden=8"],
     "mamba__mlp"),  # the harness's MLP heads
    ("mamba", ["--variant", "rh", "--set", "d_model=16", "--set", "n_layers=1", "--set", "reward_head=6",
               "--set", "reward_head_q=2"], "mamba__rh"),  # the harness's per-action immediate-reward head
    ("mamba", ["--variant", "as", "--set", "d_model=16", "--set", "n_layers=1", "--set", "action_set=1"],
     "mamba__as"),  # the action-set loss by its harness name (PPOConfig.action_set_coef)
    ("sb3", [], "sb3"),
    ("sb3", ["--sb3-prev-action"], "sb3__prev"),
    ("sb3", ["--variant", "g09", "--set", "gamma=0.9"], "sb3__g09"),  # the LSTM given a --set, in its own folder
])
def test_one_tiny_run_end_to_end(pg, tmp_path, method, extra, folder):
    pytest.importorskip("popgym")
    if method == "sb3":
        pytest.importorskip("sb3_contrib")
    argv = ["--methods", method, "--tasks", "RepeatPreviousEasy", "--seeds", "3", "--total", "1024", "--jobs", "1",
            "--out", str(tmp_path)] + extra
    rc = pg.main(argv)
    assert rc == 0, open(tmp_path / "runs.log").read()[-3000:]
    folder = tmp_path / folder
    r = json.load(open(folder / "RepeatPreviousEasy__seed3.json"))
    assert r["steps"] == 1024 and r["total"] == 1024 and r["method"] == method
    assert math.isfinite(r["mmer"]) and r["versions"]["torch"]
    if "gamma=0.9" in extra:
        assert r["config"]["gamma"] == "0.9"
    if "head_hidden=8" in extra:
        assert r["config"]["head_hidden"] == 8
    if "reward_head=6" in extra:
        assert r["config"]["reward_head"] == 6 and r["config"]["reward_head_q"] == 2
    if "action_set=1" in extra:
        assert r["config"]["action_set"] == 1
    # a finished run of the same budget is not run again
    mtime = os.path.getmtime(folder / "RepeatPreviousEasy__seed3.json")
    assert pg.main(argv) == 0
    assert os.path.getmtime(folder / "RepeatPreviousEasy__seed3.json") == mtime


def test_set_needs_a_variant(pg, tmp_path):
    with pytest.raises(SystemExit):
        pg.main(["--methods", "mamba", "--set", "prev_action=True", "--out", str(tmp_path)])


@pytest.mark.parametrize("extra,msg", [
    (["--set", "foo"], "--set expects NAME=VALUE, got 'foo'"),
    (["--variant", "v", "--set", "foo=1"], "unknown fields \\['foo'\\]"),
    (["--variant", "v", "--set", "aux_adv_add=abc"], "aux_adv_add must be a finite number or None, got 'abc'"),
    (["--tasks", "NoSuchTaskEasy"], "--tasks: 'NoSuchTaskEasy'"),
    (["--total", "0"], "--total must be >= 1 env steps, got 0"),
])
def test_bad_runs_stop_before_any_worker_starts(pg, tmp_path, capsys, extra, msg):
    """What every run would fail on stops main with one argparse line (exit 2), and nothing is written."""
    pytest.importorskip("popgym")
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        pg.main(["--methods", "mamba", "--seeds", "0", "--jobs", "1", "--out", str(out)] + extra)
    assert e.value.code == 2
    assert re.search(msg, capsys.readouterr().err)
    assert not out.exists()


def test_summarise_refuses_an_unknown_column(pg, tmp_path, capsys):
    (tmp_path / "mamba").mkdir()
    with pytest.raises(SystemExit) as e:
        pg.main(["--summarise-only", "--out", str(tmp_path), "--columns", "mamba", "nothere"])
    assert e.value.code == 2 and "--columns: no run folder ['nothere']" in capsys.readouterr().err


def test_a_run_stopped_by_sigterm_keeps_its_curve_and_runs_again(pg, tmp_path):
    """SIGTERM to the harness (``timeout``, a scheduler) mid-run: it passes the signal on to its worker and waits;
    the worker writes its JSON with the steps reached and the signal; both exit 143; the summary counts the run at
    those steps; the next harness call runs it again."""
    import signal
    import subprocess
    import sys
    import time

    pytest.importorskip("popgym")
    out = tmp_path / "out"
    tiny = ["--variant", "tiny", "--set", "d_model=16", "--set", "n_layers=1"]
    cmd = [sys.executable, pg.__file__, "--methods", "mamba", "--tasks", "RepeatPreviousEasy", "--seeds", "0",
           "--total", "10000000", "--jobs", "1", "--out", str(out)] + tiny
    p = subprocess.Popen(cmd, cwd=pg.ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    run = out / "mamba__tiny" / "RepeatPreviousEasy__seed0"
    csv_path = run.with_suffix(".csv")
    deadline = time.time() + 120
    while time.time() < deadline and (not csv_path.exists() or len(csv_path.read_text().splitlines()) < 3):
        time.sleep(0.2)  # two updates logged
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=150) == 128 + signal.SIGTERM
    r = json.load(open(run.with_suffix(".json")))
    assert r["stopped"] == "signal 15 (SIGTERM)" and 2048 <= r["steps"] < r["total"] and math.isfinite(r["mmer"])
    assert r["config"] == {"d_model": 16, "n_layers": 1}
    assert "stopped by signal 15 (SIGTERM)" in open(out / "runs.log").read()  # the worker's own line
    size = csv_path.stat().st_size
    time.sleep(1.5)
    assert csv_path.stat().st_size == size  # the worker has exited: no orphan writes on
    s = pg.summarise(str(out))["summary"]["RepeatPreviousEasy|mamba__tiny"]
    assert s["steps"] == r["steps"]
    # the harness runs a stopped run of the same budget again (here: the JSON given a budget of 1024 steps)
    r["total"] = 1024
    json.dump(r, open(run.with_suffix(".json"), "w"))
    assert pg.main(["--methods", "mamba", "--tasks", "RepeatPreviousEasy", "--seeds", "0", "--total", "1024",
                    "--jobs", "1", "--out", str(out)] + tiny) == 0
    r2 = json.load(open(run.with_suffix(".json")))
    assert "stopped" not in r2 and r2["steps"] == r2["total"] == 1024


def test_a_record_column_takes_each_task_from_its_folder(pg, tmp_path, capsys):
    out = str(tmp_path)
    for task in ("BattleshipEasy", "ConcentrationEasy"):
        _fake_run(out, "mamba__base", task, 0, [-0.5, -0.4])
        _fake_run(out, "sb3", task, 0, [-0.5, -0.45])
    _fake_run(out, "mamba__as", "BattleshipEasy", 0, [-0.5, -0.2])
    res = pg.summarise(out, columns=["rec", "sb3"], record=("rec", "mamba__base", {"BattleshipEasy": "mamba__as"}))
    s = res["summary"]
    assert s["BattleshipEasy|rec"]["mean"] == -0.2 and s["BattleshipEasy|rec"]["source"] == "mamba__as"
    assert s["ConcentrationEasy|rec"]["mean"] == -0.4 and "source" not in s["ConcentrationEasy|rec"]
    rows = {r.split(" | ")[0][2:]: r for r in open(tmp_path / "table.md").read().splitlines()}
    assert "-0.200 ± 0.000 (1, 2k) from mamba__as" in rows["BattleshipEasy"]
    assert "from" not in rows["ConcentrationEasy"]
    assert set(res["runs"]) == {f"{t}|{m}" for t in ("BattleshipEasy", "ConcentrationEasy") for m in ("rec", "sb3")}
    with pytest.raises(SystemExit):
        pg.main(["--summarise-only", "--out", out, "--record-column", "rec", "mamba__base", "BattleshipEasy=nope"])
    assert "no run folder ['nope']" in capsys.readouterr().err
    assert pg.main(["--summarise-only", "--out", out, "--record-column", "rec", "mamba__base",
                    "BattleshipEasy=mamba__as", "--columns", "rec", "sb3"]) == 0


def test_the_record_script_parses_and_names_committed_folders():
    """benchmarks/learning/popgym_record.sh, the table of record's one command: valid bash, and every folder its
    summary names (--record-column, --columns) and every variant it runs is a committed run folder."""
    import subprocess

    script = "benchmarks/learning/popgym_record.sh"
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    text = open(script).read()
    named = set(re.findall(r"\bmamba__\w+|\bsb3\b", text.split("--summarise-only")[1]))
    named |= {f"mamba__{v}" for v in re.findall(r"--variant (\w+)", text)}
    assert {"mamba__S_pr_nd", "mamba__U_as10_joint", "mamba__U_as10", "sb3"} <= named
    for folder in named:
        assert os.path.isdir(os.path.join("benchmarks/learning/popgym", folder)), folder
