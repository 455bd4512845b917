"""`mamba-rl train | eval` and `python -m mamba_rl` on CPU, with tiny models."""

import subprocess
import sys

import pytest
from mamba_rl.agents import PPOConfig, RecurrentPPO

from mamba_rl.agents.cli import main

TINY = ["--num-envs", "2", "--num-steps", "16", "--num-minibatches", "1", "--update-epochs", "1",
        "--d-model", "16", "--n-layers", "1", "--d-state", "4", "--device", "cpu", "--no-progress"]


def test_every_config_field_has_a_flag(capsys):
    import dataclasses

    from mamba_rl import MambaConfig

    with pytest.raises(SystemExit) as exit_:
        main(["train", "--help"])
    assert exit_.value.code == 0
    help_text = capsys.readouterr().out
    names = [f.name for f in dataclasses.fields(PPOConfig) if f.name != "backbone"]
    names += [f.name for f in dataclasses.fields(MambaConfig) if f.init]  # the backbone's fields, flat
    assert {"dt_rank", "rms_norm_eps", "d_model"} <= set(names)
    for name in names:
        assert "--" + name.replace("_", "-") in help_text, name


def test_flags_given_override_the_defaults_and_nothing_else(tmp_path, capsys):
    """What a run was configured with, read back from its checkpoint: the flags given, PPOConfig's
    defaults for everything else (flat backbone flags land in ``backbone``; "none" and --no-X parse)."""
    from mamba_rl import MambaConfig
    from mamba_rl.agents.checkpoint import read_agent_config

    dirs = ["--runs-dir", str(tmp_path / "runs"), "--checkpoint-dir", str(tmp_path / "ckpt")]
    given = ["--env", "CartPole-v1", "--target-kl", "none", "--no-anneal-lr", "--max-grad-norm", "1.5",
             "--dt-rank", "3", "--rms-norm-eps", "1e-6", "--total-timesteps", "32"]
    assert main(["train", *given, *TINY, *dirs]) == 0
    final = capsys.readouterr().out.strip().splitlines()[-1].split("checkpoint: ")[1]
    _, cfg = read_agent_config(final)
    want = PPOConfig(env_id="CartPole-v1", target_kl=None, anneal_lr=False, max_grad_norm=1.5, total_timesteps=32,
                     num_envs=2, num_steps=16, num_minibatches=1, update_epochs=1, device="cpu",
                     runs_dir=str(tmp_path / "runs"), checkpoint_dir=str(tmp_path / "ckpt"),
                     backbone=MambaConfig(d_model=16, n_layers=1, d_state=4, dt_rank=3, rms_norm_eps=1e-6))
    assert cfg == want


def test_train_eval_resume(tmp_path, capsys):
    dirs = ["--runs-dir", str(tmp_path / "runs"), "--checkpoint-dir", str(tmp_path / "ckpt")]
    rc = main(["train", "--env", "CartPole-v1", "--total-timesteps", "64", "--checkpoint-every", "1", *TINY, *dirs])
    assert rc == 0
    out = capsys.readouterr()
    final = out.out.strip().splitlines()[-1].split("checkpoint: ")[1]
    assert final.endswith("final") and "tensorboard --logdir" in out.err
    run = final.split("/")[-2]
    assert (tmp_path / "runs" / run).is_dir()
    assert (tmp_path / "ckpt" / run / "update_000001" / "agent.safetensors").is_file()

    assert main(["eval", "--checkpoint", final, "--episodes", "2", "--deterministic"]) == 0
    line = capsys.readouterr().out
    assert "CartPole-v1: mean return" in line and "± " in line and "over 2 episodes" in line

    # resume from update 1 of 2: continues the same run (same run name, same step counter)
    rc = main(["train", "--resume", str(tmp_path / "ckpt" / run / "update_000001"), "--no-progress"])
    assert rc == 0
    assert "resuming " + run + " after update 1 of 2 (32 of 64 env steps done)" in capsys.readouterr().err
    # another backbone shape on resume is named as such (it was reported as another action space)
    rc = main(["train", "--resume", final, "--d-model", "8", "--d-state", "2", "--total-timesteps", "96",
               "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "holds a backbone with d_model 16, d_state 4, but the config to load it into has d_model 8, " \
                       "d_state 2; resume without --d-model, --d-state" in err, err


def test_bad_input_is_a_clear_error(tmp_path, capsys):
    assert main(["eval", "--checkpoint", str(tmp_path / "nothing")]) == 2
    assert "no RecurrentPPO checkpoint at" in capsys.readouterr().err
    assert main(["train", "--num-envs", "3", "--num-minibatches", "2", "--device", "cpu"]) == 2
    assert "must be divisible by num_minibatches" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--dtype"])  # argparse: missing value


def test_ctrl_c_saves_a_checkpoint(tmp_path):
    agent = RecurrentPPO("CartPole-v1", config=PPOConfig(
        num_envs=2, num_steps=16, num_minibatches=1, update_epochs=1, d_model=16, n_layers=1, d_state=4,
        device="cpu", total_timesteps=320, track=False, checkpoint_dir=str(tmp_path / "ckpt")))

    def interrupt(agent, metrics):
        if metrics["update"] == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        agent.learn(callback=interrupt)
    resumed = RecurrentPPO.load(tmp_path / "ckpt" / agent.run_name / "interrupted")
    assert resumed.update == 2 and resumed.global_step == 64


def test_python_dash_m():
    r = subprocess.run([sys.executable, "-m", "mamba_rl", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "train" in r.stdout and "eval" in r.stdout


@pytest.mark.parametrize("argv, want", [(["--prev-action"], True), (["--prev-action", "auto"], "auto"),
                                        (["--prev-action", "off"], False), (["--no-prev-action"], False),
                                        (["--prev-action", "on"], True), ([], None)])
def test_prev_action_flag_takes_on_off_auto(argv, want):
    from mamba_rl.agents.cli import build_parser

    ns = build_parser().parse_args(["train", *argv])
    assert getattr(ns, "prev_action", None) == want and type(getattr(ns, "prev_action", None)) is type(want)


def test_prev_action_flag_refuses_other_words(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--prev-action", "maybe"])
    assert exit_.value.code == 2
    assert "expected on, off or auto, got 'maybe'" in capsys.readouterr().err
