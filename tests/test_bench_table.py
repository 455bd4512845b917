"""benchmarks/bench.py's table(): rows that failed (``err``, us=nan) or are missing (e.g. no Mamba-3 rows)."""
import math

import pytest

from tests.helpers import load_script

NAN = float("nan")


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/bench.py", "bench_table")


def _train(model, us, **kw):
    return dict(kind="train", model=model, d_model=128, B=16, T=64, graph=True, us=us, **kw)


def _failed(model):
    return _train(model, NAN, err="RuntimeError('boom')")


def _line(table, prefix, header):
    """The ``| 128 | 16 x 64 |`` line of the section whose header starts with ``header``."""
    lines = table.splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith(header))
    return next(l for l in lines[start:] if l.startswith(prefix)).split(" | ")


def test_best_ignores_a_failed_dtype_whichever_it_is(bench):
    """A failed f32 row (us=nan) must not turn "best" into nan while its bf16 twin succeeded: Python's
    min(nan, x) is nan but min(x, nan) is x, so the result used to depend on which dtype failed."""
    gru = _train("gru1", 300.0)
    for failed, ok in (("f32", "bf16"), ("bf16", "f32")):
        rows = [_failed(f"mamba_rl_{failed}"), _train(f"mamba_rl_{ok}", 400.0, kernels=70),
                _failed(f"mamba3_{failed}"), _train(f"mamba3_{ok}", 2000.0, kernels=60), gru]
        t = bench.table(rows)
        m1 = _line(t, "| 128 | 16 x 64 |", "| d_model | B x T | mamba_rl f32")
        assert m1[-2] == "0.75x", (failed, m1)  # best / GRU-1L = 300 / 400
        m3 = _line(t, "| 128 | 16 x 64 |", "| d_model | B x T | Mamba-1 best")
        assert m3[2] == "400", (failed, m3)  # Mamba-1 best
        assert m3[6] == "0.15x", (failed, m3)  # Mamba-3 best / GRU-1L = 300 / 2000


def test_all_failed_or_absent_rows_give_nan_not_an_error(bench):
    rows = [_failed("mamba_rl_f32"), _failed("mamba_rl_bf16"), _failed("mamba3_f32"), _failed("mamba3_bf16")]
    t = bench.table(rows)
    assert "nanx" in _line(t, "| 128 | 16 x 64 |", "| d_model | B x T | Mamba-1 best")[6]
    t = bench.table([_train("mamba_rl_f32", 400.0)])  # no bf16, no peers, no Mamba-3 rows
    assert "Mamba-3" not in t and "| 128 | 16 x 64 | 400 | nan |" in t
    assert bench.table([]).count("\n") >= 3
    assert math.isnan(bench._best(NAN, NAN)) and bench._best(NAN, 2.0) == bench._best(2.0, NAN) == 2.0


def test_merge_rounds_takes_each_rows_median_over_the_rounds(bench):
    """--rounds: each row's timed fields are the median over the rounds, ours and the peers' alike; other fields
    (kernels, profiles) come from the first round; a round that failed is left out of the median and kept in errs."""
    rounds = [[_train("mamba_rl_bf16", 370.0, api_us=380.0, kernels=37, profile=[("k", 1, 2.0)]),
               _train("gru1", 260.0)],
              [_train("mamba_rl_bf16", 316.0, api_us=320.0, kernels=37), _failed("gru1")],
              [_train("mamba_rl_bf16", 345.0, api_us=350.0, kernels=37), _train("gru1", 262.0)]]
    ours, gru = bench.merge_rounds(rounds)
    assert ours["us"] == 345.0 and ours["api_us"] == 350.0 and ours["us_rounds"] == [370.0, 316.0, 345.0]
    assert ours["kernels"] == 37 and ours["profile"] == [("k", 1, 2.0)] and "errs" not in ours
    assert gru["us"] == 261.0 and math.isnan(gru["us_rounds"][1]) and gru["errs"] == ["RuntimeError('boom')"]
    assert "err" not in gru
    line = _line(bench.table([ours, gru]), "| 128 | 16 x 64 |", "| d_model | B x T | mamba_rl f32")
    assert line[-2] == "0.76x", line  # best / GRU-1L = 261 / 345


def test_merge_rounds_of_one_round_is_that_round(bench):
    rows = [_train("mamba_rl_f32", 406.0, kernels=40), _failed("gru1")]
    merged = bench.merge_rounds([rows])
    assert [dict(r, us=None) for r in merged] == [dict(r, us=None) for r in rows]
    assert merged[0]["us"] == 406.0 and math.isnan(merged[1]["us"]) and merged[1]["err"] == "RuntimeError('boom')"


def test_merge_rounds_of_a_row_that_failed_in_every_round_is_nan(bench):
    merged = bench.merge_rounds([[_failed("lstm1")], [_failed("lstm1")]])
    assert len(merged) == 1 and math.isnan(merged[0]["us"]) and merged[0]["errs"] == ["RuntimeError('boom')"] * 2
