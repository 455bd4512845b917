"""The CLI on the CPU: user mistakes are one-line errors (exit 2), help texts, env listing,
exact counters, the Ctrl-C summary, the thread policy, progress and notices, `mamba-rl plot`."""

import re
import subprocess
import sys
import time

import gymnasium as gym
import numpy as np
import pytest
import torch

from mamba_rl.agents.cli import main

TINY = ["--num-envs", "2", "--num-steps", "16", "--num-minibatches", "1", "--update-epochs", "1",
        "--d-model", "16", "--n-layers", "1", "--d-state", "4", "--device", "cpu", "--no-progress"]


def _dirs(tmp_path):
    return ["--runs-dir", str(tmp_path / "runs"), "--checkpoint-dir", str(tmp_path / "ckpt")]


def _help(command, capsys) -> str:
    """What ``mamba-rl COMMAND --help`` prints (it exits 0)."""
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def _option_helps(help_text: str) -> dict[str, str]:
    """``{invocation: help}`` of every option in an argparse help text (an option's entry starts with
    ``  -``; its help follows on the same line after two spaces, or on the indented lines below)."""
    out, current = {}, None
    for line in help_text.splitlines():
        if re.match(r"^ {2}-", line):
            parts = re.split(r"\s{2,}", line.strip(), maxsplit=1)
            current = parts[0]
            out[current] = parts[1] if len(parts) > 1 else ""
        elif current is not None and re.match(r"^ {3,}\S", line):
            out[current] = (out[current] + " " + line.strip()).strip()
        else:
            current = None
    return out


@pytest.mark.parametrize("command", ["train", "eval", "envs", "plot"])
def test_every_option_has_help_and_one_default(command, capsys):
    help_text = _help(command, capsys)
    options = _option_helps(help_text)
    assert options and "-h, --help" in options
    for invocation, text in options.items():
        assert re.sub(r"\s*\(default: [^)]*\)", "", text).strip(), f"{command} {invocation} has no help besides its default"
        assert text.count("(default:") <= 1, (invocation, text)
    assert not re.search(r"\(default: ([^)]*)\)\s*\(default: \1\)", help_text), help_text
    assert help_text.count("(default: 10)") <= 1


def test_help_comes_from_the_config_docstrings(capsys):
    from mamba_rl.agents import PPOConfig
    from mamba_rl.agents.cli import field_docs

    docs = field_docs(PPOConfig)
    help_text = " ".join(_help("train", capsys).split())
    assert docs["normalize_reward"].split()[0] in help_text and "(default: True)" in help_text
    assert "backbone residual stream width" in help_text  # MambaConfig's own docstring
    # an entry that wraps onto more lines keeps its first sentence whole (it once stopped at "ignored")
    assert docs["aux_adv_add"].endswith("or None for the rescaled mix ('aux_adv_weight').")
    assert "``" not in help_text


USER_MISTAKES = [
    (["train", "--env-id", "CartPol-v1"], "Did you mean: `CartPole`"),
    (["train", "--num-envs", "3", "--num-minibatches", "2"], "must be divisible by num_minibatches"),
    (["train", "--learning-rate", "-1"], "learning_rate"),
    (["train", "--threads", "-2"], "threads"),
    (["train", "--async-start-method", "threads"], "async_start_method"),
    (["train", "--device", "gpu"], "PPOConfig.device"),
    (["train", "--resume", "/no/such/checkpoint"], "no RecurrentPPO checkpoint"),
    (["train", "--env-id", "no_such_module_xyz:Foo-v0"], "no_such_module_xyz"),
    (["eval", "--checkpoint", "/no/such/checkpoint"], "no RecurrentPPO checkpoint"),
    (["eval", "--checkpoint", ".", "--episodes", "0"], "--episodes must be an int >= 1, got 0"),
]


@pytest.mark.parametrize("argv,message", USER_MISTAKES)
def test_user_mistakes_are_one_line_errors(argv, message, capsys):
    assert main(argv + ["--no-track"] * (argv[0] == "train")) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"mamba-rl {argv[0]}: error: ") and message in err, err
    assert "Traceback" not in err and len(err.splitlines()) == 1


def test_cuda_without_a_gpu_is_a_one_line_error(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv in (["train", "--device", "cuda"], ["train", "--backend", "cuda", "--device", "cpu"]):
        assert main(argv + ["--no-track"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("mamba-rl train: error: ") and "CUDA" in err and len(err.splitlines()) == 1


def test_bad_checkpoint_is_a_one_line_error(tmp_path, capsys):
    (tmp_path / "agent.safetensors").write_bytes(b"garbage")
    assert main(["eval", "--checkpoint", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("mamba-rl eval: error: ")


def test_a_checkpoint_folders_other_file_is_named_as_such(tmp_path, capsys):
    (tmp_path / "envs.pkl").write_bytes(b"\x80\x04N.")  # the folder's envs pickle, not the checkpoint
    assert main(["eval", "--checkpoint", str(tmp_path / "envs.pkl")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mamba-rl eval: error: ") and "not a RecurrentPPO checkpoint" in err
    assert "agent.safetensors" in err and ".pkl file" in err


def test_a_bug_keeps_its_traceback(tmp_path, monkeypatch):
    from mamba_rl.agents import RecurrentPPO

    def broken(self, *a, **k):
        raise ValueError("a bug inside training")  # even a ValueError: training is not user input

    monkeypatch.setattr(RecurrentPPO, "learn", broken)
    with pytest.raises(ValueError, match="a bug inside training"):
        main(["train", "--env", "CartPole-v1", "--total-timesteps", "32", *TINY, *_dirs(tmp_path)])


def test_subprocess_exit_code_and_single_line():
    r = subprocess.run([sys.executable, "-m", "mamba_rl", "train", "--env-id", "CartPol-v1", "--no-track"],
                       capture_output=True, text=True, timeout=120)
    lines = [ln for ln in r.stderr.splitlines() if "Warning" not in ln and "warn(" not in ln and ln.strip()]
    assert r.returncode == 2 and lines[-1].startswith("mamba-rl train: error: unknown env id 'CartPol-v1'"), r.stderr
    assert "Traceback" not in r.stderr


def test_envs_lists_the_project_ids(capsys):
    from mamba_rl.envs import POMDP_ENV_IDS

    assert main(["envs"]) == 0
    out = capsys.readouterr().out
    assert all(env_id in out for env_id in POMDP_ENV_IDS)
    assert main(["envs", "--all"]) == 0
    assert "CartPole-v1" in capsys.readouterr().out


def test_envs_into_a_closed_pipe_stops_quietly():
    """``mamba-rl envs | head -1``: the reader has gone away before the listing is written (its read end closed
    first, so every write fails); the command stops with the shell's SIGPIPE status (141) and no traceback, as a
    shell tool does."""
    import os

    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run([sys.executable, "-m", "mamba_rl", "envs"], stdout=w, stderr=subprocess.PIPE, timeout=120)
    finally:
        os.close(w)
    err = p.stderr.decode()
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert p.returncode == 141, (p.returncode, err)


def test_run_covers_total_timesteps_and_says_so(tmp_path, capsys):
    rc = main(["train", "--env", "CartPole-v1", "--total-timesteps", "48", *TINY, *_dirs(tmp_path)])
    assert rc == 0
    err = capsys.readouterr().err
    assert "2 updates of 2x16 = 64 env steps (--total-timesteps 48 rounded up to whole rollouts)" in err
    assert "done: 64 env steps" in err


def test_ctrl_c_mid_rollout_counts_only_whole_updates(tmp_path, capsys, monkeypatch):
    real_step = gym.vector.SyncVectorEnv.step
    calls = {"n": 0}

    def step(self, actions):
        calls["n"] += 1
        if calls["n"] == 16 + 5:  # inside the second rollout
            raise KeyboardInterrupt
        return real_step(self, actions)

    monkeypatch.setattr(gym.vector.SyncVectorEnv, "step", step)
    rc = main(["train", "--env", "CartPole-v1", "--total-timesteps", "96", *TINY, *_dirs(tmp_path)])
    assert rc == 130
    err = capsys.readouterr().err
    assert "interrupted after update 1 of 3: 32 of 96 env steps done" in err
    ckpt = re.search(r"continue with: mamba-rl train --resume (\S+)", err).group(1)
    assert ckpt.endswith("interrupted") and f"checkpoint: {ckpt}" in err
    monkeypatch.setattr(gym.vector.SyncVectorEnv, "step", real_step)
    assert main(["train", "--resume", ckpt, "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "after update 1 of 3 (32 of 96 env steps done)" in err and "done: 96 env steps" in err


def test_threads_flag_reaches_torch(tmp_path, monkeypatch):
    from mamba_rl.agents.progress import resolve_threads

    before = torch.get_num_threads()
    seen = {}
    from mamba_rl.agents import RecurrentPPO

    real_init = RecurrentPPO.__init__

    def spy(self, *a, **k):
        seen["threads_at_build"] = torch.get_num_threads()
        real_init(self, *a, **k)

    monkeypatch.setattr(RecurrentPPO, "__init__", spy)
    try:
        assert main(["train", "--env", "CartPole-v1", "--total-timesteps", "32", "--threads", "3", *TINY,
                     *_dirs(tmp_path)]) == 0
        assert seen["threads_at_build"] == 3 == torch.get_num_threads()  # set before the model is built
    finally:
        torch.set_num_threads(before)
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert resolve_threads(0) == 5 and resolve_threads(2) == 2
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert resolve_threads(0) == 1


def test_progress_bar_moves_during_a_rollout():
    from mamba_rl.agents.progress import StepProgress

    counter = {"step": 0}
    bar = StepProgress(total=1000, initial=0, get_step=lambda: counter["step"], interval=0.05)
    try:
        counter["step"] = 37  # the rollout advanced, no update finished yet
        deadline = time.time() + 5
        while bar.bar.n != 37 and time.time() < deadline:
            time.sleep(0.02)
        assert bar.bar.n == 37
    finally:
        bar.close()


class _Unpicklable(gym.Env):
    observation_space = gym.spaces.Box(-1, 1, (2,))
    action_space = gym.spaces.Discrete(2)

    def __init__(self):
        self.hook = lambda: None  # keeps the env from being pickled

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self.observation_space.sample(), {}

    def step(self, action):
        return self.observation_space.sample(), 1.0, False, False, {}


def test_pickle_notice_appears_once(tmp_path, capsys):
    from mamba_rl.agents import RecurrentPPO

    gym.register("mamba_rl_test/Unpicklable-v0", entry_point=_Unpicklable)
    try:
        agent = RecurrentPPO("mamba_rl_test/Unpicklable-v0", num_envs=2, num_steps=8, num_minibatches=1,
                             update_epochs=1, d_model=8, n_layers=1, d_state=2, device="cpu", total_timesteps=48,
                             checkpoint_every=1, track=False, checkpoint_dir=str(tmp_path))
        agent.learn(progress=True)
        agent.close()
    finally:
        del gym.registry["mamba_rl_test/Unpicklable-v0"]
    err = capsys.readouterr().err
    assert err.count("could not be pickled") == 1


def test_an_interrupt_before_the_training_loop_does_not_claim_a_failed_save(tmp_path, capsys, monkeypatch):
    """A Ctrl-C that lands before learn()'s training loop (e.g. while TensorBoard loads) stops the run with exit
    130 and says that nothing was saved because the run had not begun, not that a save failed (none was tried)."""
    from mamba_rl.agents import ppo

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(ppo, "claim_run", interrupted)
    assert main(["train", "--env", "CartPole-v1", "--total-timesteps", "64", *TINY, *_dirs(tmp_path)]) == 130
    err = capsys.readouterr().err
    assert "nothing was saved: the run stopped before its training loop began; no update had run" in err, err
    assert "could not be written" not in err


def test_plot_a_tiny_run(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main(["train", "--env", "CartPole-v1", "--total-timesteps", "64", *TINY, *_dirs(tmp_path)]) == 0
    capsys.readouterr()
    (run,) = (tmp_path / "runs").iterdir()
    from mamba_rl.agents.plot import read_scalars

    scalars = read_scalars(run)
    assert scalars["losses/value_loss"][0] == [32, 64] and scalars["charts/episodic_return"][1]
    out = tmp_path / "curves.png"
    assert main(["plot", str(run), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["plot", str(tmp_path / "nothing")]) == 2
    assert capsys.readouterr().err.strip().endswith("no run folder at " + str(tmp_path / "nothing"))


def test_plot_limits_leave_out_a_lone_spike_and_large_opening_values():
    """The panels' y limits (Tukey's far-out fences): a lone spike among ~100 points (the default run's
    aux explained variance of -4e7) and a loss's large opening values are left out; a curve without outliers,
    a short one and a constant one keep matplotlib's own limits."""
    import numpy as np

    from mamba_rl.agents.plot import _robust_limits

    rng = np.random.default_rng(0)
    ev = rng.uniform(-0.5, 0.9, 98)
    ev[40] = -4e7
    lo, hi = _robust_limits(ev)
    assert -5 < lo < -0.5 and 0.9 < hi < 5
    loss = np.concatenate([[900.0, 400.0, 150.0], rng.uniform(1.0, 3.0, 97)])
    lo, hi = _robust_limits(loss)
    assert 0 < hi < 20 and lo < 1.0
    assert _robust_limits(np.linspace(1.0, 0.1, 100)) is None
    assert _robust_limits(np.array([1.0, 5e6] * 5)) is None  # under 20 points
    assert _robust_limits(np.full(50, 2.0)) is None
    assert _robust_limits(np.array([np.nan] * 30 + [1.0] * 30)) is None


def test_read_scalars_drops_the_steps_a_resume_purged(tmp_path):
    """A run resumed from an earlier checkpoint writes a second event file whose purge_step hides what the first
    file logged from that step on: the plot reads them as TensorBoard does (no step twice, no stale tail)."""
    import time

    from mamba_rl.agents.logger import TensorBoardLogger
    from mamba_rl.agents.plot import read_scalars

    first = TensorBoardLogger(str(tmp_path), purge_step=None)
    first.scalars({"losses/value_loss": 1.0}, 10)
    first.scalars({"losses/value_loss": 2.0}, 20)
    first.scalars({"losses/value_loss": 3.0}, 30)
    first.episodes([(20, 5.0, 7), (30, 6.0, 8)])
    first.close()
    time.sleep(1.1)  # event file names carry the second: the resumed run's file sorts after the first
    resumed = TensorBoardLogger(str(tmp_path), purge_step=11)  # resumed from the checkpoint at step 10
    resumed.scalars({"losses/value_loss": 4.0}, 20)
    resumed.episodes([(20, 9.0, 3)])
    resumed.close()
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 2
    s = read_scalars(tmp_path)
    assert s["losses/value_loss"] == ([10, 20], [1.0, 4.0])
    assert s["charts/episodic_return"] == ([20], [9.0])


def test_plot_out_paths(tmp_path, capsys):
    """--out: a path without a suffix gets ".png" (the file matplotlib writes, and the one printed), an existing
    folder or a path under a file is one error line (exit 2)."""
    pytest.importorskip("matplotlib")
    assert main(["train", "--env", "CartPole-v1", "--total-timesteps", "64", *TINY, *_dirs(tmp_path)]) == 0
    (run,) = (tmp_path / "runs").iterdir()
    capsys.readouterr()
    assert main(["plot", str(run), "--out", str(tmp_path / "curves")]) == 0
    assert capsys.readouterr().out.strip() == f"plot: {tmp_path / 'curves.png'}"
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["plot", str(run), "--out", str(tmp_path)]) == 2
    assert "--out must be the path of the image to write" in capsys.readouterr().err
    (tmp_path / "afile").write_text("x")
    assert main(["plot", str(run), "--out", str(tmp_path / "afile" / "x.png")]) == 2
    err = capsys.readouterr().err
    assert "exists and is not a folder" in err and "Traceback" not in err


def test_a_missing_env_backend_package_is_one_line(monkeypatch, capsys):
    import mamba_rl.envs.envpool_backend as eb

    monkeypatch.setattr(eb, "envpool_available", lambda: False)
    assert main(["train", "--env-backend", "envpool", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "mamba-rl train: error: env backend 'envpool' needs the optional envpool package" in err
    assert "Traceback" not in err


def test_a_refused_value_names_its_flag(capsys):
    assert main(["train", "--num-envs", "0"]) == 2
    err = capsys.readouterr().err
    assert "mamba-rl train: error: --num-envs (PPOConfig.num_envs) must be an int >= 1, got 0" in err


def test_ctrl_c_before_training_is_one_line_not_a_traceback(capsys):
    from mamba_rl.agents import cli

    def interrupted(args):
        raise KeyboardInterrupt

    cli.register_subcommand("interrupted-setup", "test only", lambda p: None, interrupted)
    try:
        assert main(["interrupted-setup"]) == 130
    finally:
        del cli.SUBCOMMANDS["interrupted-setup"]
    err = capsys.readouterr().err
    assert err.strip() == "mamba-rl interrupted-setup: interrupted before anything was saved"


@pytest.mark.parametrize("flags, message", [
    (["--threads", "99999"], "--threads (PPOConfig.threads) must be an int in [0, 1024], got 99999"),
    (["--seed", "99999999999999999999"], "--seed (PPOConfig.seed) must be an int in [0, "),
    (["--exp-name", "a/b"], "expected no path separator, got 'a/b'"),
    (["--device", "cuda:x"], "'cuda:N' (N >= 0), got 'cuda:x'"),
    (["--runs-dir", "/proc/no-such-dir/runs", "--d-model", "16", "--n-layers", "1"],
     "cannot create the run's folders under --runs-dir '/proc/no-such-dir/runs'"),
])
def test_unfit_values_are_one_line_errors(flags, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--no-progress", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mamba-rl train: error: ") and message in err, err


def test_nproc_validates_before_launching_the_ranks(capsys):
    """A usage mistake under --nproc is one line from the launcher (exit 2), not one per rank."""
    assert main(["train", "--nproc", "2", "--num-envs", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "must be divisible by num_minibatches" in err


@pytest.mark.parametrize("argv,message", [
    (["train", "--layer", "Mamba3", "--headdim", "x"], "mamba-rl train: error: argument --headdim: invalid int value: 'x'"),
    (["train", "--nproc", "two"], "mamba-rl train: error: argument --nproc: invalid int value: 'two'"),
    (["train", "--layer", "Mamba3", "--no-such-flag"], "mamba-rl: error: unrecognized arguments: --no-such-flag"),
    (["bogus"], "mamba-rl: error: argument {"),
])
def test_parse_errors_are_one_line_errors(argv, message, capsys):
    """argparse's own errors (a flag value of the wrong type, an unknown flag or command) are one line and
    exit 2 too: they used to come after the whole ``train`` usage block (31 lines)."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(message) and err.endswith("--help)") and len(err.splitlines()) == 1, err


def test_an_explicit_kernel_backend_that_cannot_load_is_a_one_line_error(tmp_path):
    """``--backend cpu`` with the CPU kernels unavailable (here disabled) is the CLI's one-line usage error
    naming the cause and the fallbacks (exit 2), not the backbone's RuntimeError traceback (a breaker found it)."""
    import os

    r = subprocess.run([sys.executable, "-m", "mamba_rl", "train", "--backend", "cpu", *TINY, "--total-timesteps",
                        "64", *_dirs(tmp_path)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "MAMBA_RL_DISABLE_CPU": "1"})
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("mamba-rl train: error: backend 'cpu': the cpu kernels could not load")
    assert "MAMBA_RL_DISABLE_CPU" in lines[0] and "use backend 'auto'" in lines[0]


def test_resuming_a_finished_run_says_there_is_nothing_to_train(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--env-id", "CartPole-v1", "--total-timesteps", "64", *TINY]) == 0
    final = capsys.readouterr().out.strip().split("checkpoint: ")[-1]
    assert main(["train", "--resume", final, *TINY]) == 0
    err = capsys.readouterr().err
    assert "has already done its 64 env steps, so there is nothing to train; pass a larger --total-timesteps" in err
    assert main(["train", "--resume", final, "--total-timesteps", "96", *TINY]) == 0
    assert "nothing to train" not in capsys.readouterr().err


class _Grid2DActions(gym.Env):
    """A 2-D MultiDiscrete action space: one the agent takes in no form (nor with --joint-action)."""
    observation_space = gym.spaces.Box(-1.0, 1.0, (3,))
    action_space = gym.spaces.MultiDiscrete([[2, 3], [2, 2]])

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        return self.observation_space.sample(), {}

    def step(self, action):
        return self.observation_space.sample(), 0.0, False, False, {}


class _EmptyMultiDiscrete(_Grid2DActions):
    action_space = gym.spaces.MultiDiscrete(np.zeros((0,), np.int64))


class _TupleActions(_Grid2DActions):
    action_space = gym.spaces.Tuple((gym.spaces.Discrete(2), gym.spaces.Discrete(3)))


@pytest.mark.parametrize("env_cls, flags, message", [
    (_Grid2DActions, [], "MultiDiscrete action spaces must be 1-D, got nvec shape (2, 2)"),
    (_EmptyMultiDiscrete, [], "MultiDiscrete action spaces need at least one component and every nvec >= 1, got nvec []"),
    (_EmptyMultiDiscrete, ["--action-set-coef", "0.5"], "MultiDiscrete action spaces need at least one component"),
    (_TupleActions, ["--action-set-coef", "0.5"], "unsupported action space Tuple("),
    (_TupleActions, ["--nproc", "2"], "unsupported action space Tuple("),
], ids=["2-D", "empty", "empty-action-set", "tuple-action-set", "tuple-nproc"])
def test_an_action_space_the_agent_cannot_take_is_one_line_without_a_run_folder(env_cls, flags, message, tmp_path,
                                                                                 capsys):
    """The env's fault is named as the env's (not an option's), in one line, with exit code 2, before any run
    folder: also with the action-set loss on, and under --nproc (where the ranks, not this process, would build
    the agent)."""
    gym.register("mamba_rl_test/BadActions-v0", entry_point=env_cls)
    try:
        code = main(["train", "--env-id", "mamba_rl_test/BadActions-v0", *TINY, *_dirs(tmp_path),
                     "--total-timesteps", "32", *flags])
    finally:
        del gym.registry["mamba_rl_test/BadActions-v0"]
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("mamba-rl train: error: the env's action space: " + message), err
    assert "Traceback" not in err and not (tmp_path / "runs").exists()


class _GraphObs(_Grid2DActions):
    observation_space = gym.spaces.Graph(node_space=gym.spaces.Box(-1.0, 1.0, (2,)), edge_space=None)
    action_space = gym.spaces.Discrete(2)


def test_an_observation_space_the_agent_cannot_take_is_one_line_without_a_run_folder(tmp_path, capsys):
    gym.register("mamba_rl_test/GraphObs-v0", entry_point=_GraphObs)
    try:
        code = main(["train", "--env-id", "mamba_rl_test/GraphObs-v0", *TINY, *_dirs(tmp_path),
                     "--total-timesteps", "32"])
    finally:
        del gym.registry["mamba_rl_test/GraphObs-v0"]
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("mamba-rl train: error: the env's observation space: expected one that "
                                        "flattens to a Box"), err
    assert "Traceback" not in err and not (tmp_path / "runs").exists()
