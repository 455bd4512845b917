#!/usr/bin/env bash
# The POPGym table of record (issue 24) in one command, from the repository's root:
#     bash benchmarks/learning/popgym_record.sh            (JOBS=N runs at once, default 2; OUT=folder)
# Every run whose JSON is already in OUT for the same budget is kept (popgym.py skips it), so on the committed
# folder this only rewrites table.md, table_full_window.md and curves.png; on an empty OUT it runs them all
# (~270 runs of ~80 s on one core each for mamba, the sb3-contrib LSTM's 24 much slower). The column "record" is the
# default configuration (S_pr_nd) with two per-task settings: BattleshipEasy --joint-action --action-set-coef 10
# (U_as10_joint) and ConcentrationEasy --action-set-coef 10 (U_as10); benchmarks/learning/README.md says why.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-benchmarks/learning/popgym}
JOBS=${JOBS:-2}
pg() { python benchmarks/learning/popgym.py --total 200000 --jobs "$JOBS" --out "$OUT" "$@"; }
ALL="RepeatPreviousEasy AutoencodeEasy PositionOnlyCartPoleEasy NoisyPositionOnlyCartPoleEasy MultiarmedBanditEasy
     BattleshipEasy ConcentrationEasy PositionOnlyPendulumEasy"
# the default (its --set is the default's own value: the folder name keeps the record's runs apart)
pg --methods mamba --variant S_pr_nd --set obs_norm_discrete=True --tasks $ALL --seeds 0 1 2
pg --methods mamba --variant S_pr_nd --set obs_norm_discrete=True --tasks RepeatPreviousEasy MultiarmedBanditEasy \
    --seeds 3 4 5
pg --methods mamba --variant S_pr_nd --set obs_norm_discrete=True --tasks AutoencodeEasy --seeds $(seq 3 23)
# the two per-task settings
pg --methods mamba --variant U_as10_joint --set action_set_coef=10 --set joint_action=True --tasks BattleshipEasy \
    --seeds 0 1 2 3 4 5
pg --methods mamba --variant U_as10 --set action_set_coef=10 --tasks ConcentrationEasy --seeds 0 1 2 3 4 5
# the peers: Mamba-3 with the default's settings of then, and sb3-contrib's RecurrentPPO (LSTM-128)
pg --methods mamba --variant S_pr_m3 --set layer=Mamba3 --set obs_norm_discrete=False --tasks $ALL --seeds 0 1 2
pg --methods sb3 --tasks $ALL --seeds 0 1 2
python benchmarks/learning/popgym.py --summarise-only --out "$OUT" \
    --record-column record mamba__S_pr_nd BattleshipEasy=mamba__U_as10_joint ConcentrationEasy=mamba__U_as10 \
    --columns record mamba__S_pr_nd mamba__S_pr_m3 sb3
