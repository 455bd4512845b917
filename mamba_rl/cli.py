"""Command line: ``mamba-rl train | eval`` (also ``python -m mamba_rl``).

``mamba-rl train`` with no arguments trains recurrent PPO on ``mamba_rl/CartPoleNoVel-v1``
(device auto, dtype f32, CleanRL's PPO defaults), logs TensorBoard to
``runs/{env}__{exp_name}__{seed}__{unix_time}`` and checkpoints under
``checkpoints/{run name}/`` (periodically, at the end, and on Ctrl-C). Every PPOConfig field is a
flag (``--num-envs 16``, ``--prev-action``, ``--no-anneal-lr``, ``--target-kl 0.02``, ...), and so is
every field of its backbone MambaConfig (``--d-model 64``, ``--n-layers 2``, ``--dt-rank 8``,
``--rms-norm-eps 1e-6``, ...).
``--resume PATH`` continues a run from a checkpoint folder: backbone, heads, both optimizers,
counters and RNG states; the envs are rebuilt and reset, unless ``--resume-envs`` also restores them
mid-episode from the checkpoint's ``envs.pkl`` (a pickle: trusted checkpoints only), which makes the
continuation identical to a run that never stopped.

``mamba-rl eval --checkpoint PATH --episodes N [--deterministic] [--video]`` runs N episodes,
resetting the memory at each, and prints the mean and std of the return.

Subcommands are argparse subparsers registered in ``SUBCOMMANDS``; add one with
``register_subcommand(name, add_arguments, run)``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from typing import Any, Callable, Sequence

__all__ = ["main", "build_parser", "register_subcommand", "SUBCOMMANDS"]

# name -> (help, add_arguments(parser), run(args) -> exit code)
SUBCOMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {}


def register_subcommand(name: str, help: str, add_arguments: Callable[[argparse.ArgumentParser], None],
                        run: Callable[[argparse.Namespace], int]) -> None:
    """Add ``mamba-rl NAME``: ``add_arguments`` fills its parser, ``run(args)`` returns the exit code."""
    SUBCOMMANDS[name] = (help, add_arguments, run)


def _optional_float(text: str) -> float | None:
    if text.lower() in ("none", "null", "off"):
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'none', got {text!r}") from None


def _int_or_auto(text: str) -> int | str:
    if text.lower() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int or 'auto', got {text!r}") from None


_FIELD_HELP = {
    "env_id": "gymnasium id, mamba_rl/...NoVel id or popgym-... id",
    "total_timesteps": "env steps to train for (all envs together)",
    "device": "auto | cpu | cuda | cuda:N",
    "dtype": "backbone compute dtype: f32 | bf16 | f16",
    "backend": "backbone backend: auto | cuda | reference",
    "num_steps": "steps per env per rollout (BPTT length)",
    "num_minibatches": "minibatches per epoch (slices over envs)",
    "max_grad_norm": "global clip over heads + backbone ('none': off)",
    "target_kl": "early-stop the epochs above this approx_kl ('none': off)",
    "prev_action": "append the previous action to the input",
    "prev_reward": "append the previous reward to the input",
    "normalize_obs": "running mean/std observation normalisation",
    "memoryless": "reset the recurrent state every step (ablation)",
    "checkpoint_every": "checkpoint every N updates (0: only at the end / Ctrl-C)",
    "track": "write TensorBoard logs",
    "d_model": "backbone residual width",
    "n_layers": "backbone Mamba blocks",
    "d_state": "backbone SSM state size per channel",
    "d_conv": "backbone causal conv kernel size",
    "expand": "backbone d_inner = expand * d_model",
    "dt_rank": "backbone dt projection rank: an int or 'auto' (ceil(d_model / 16))",
    "rms_norm_eps": "backbone RMSNorm epsilon",
}

# argparse keywords per field type (PPOConfig's and MambaConfig's annotations)
_TYPE_KW: list[tuple[Any, dict[str, Any]]] = [
    (bool, dict(action=argparse.BooleanOptionalAction)),
    (int, dict(type=int, metavar="INT")),
    (float, dict(type=float, metavar="FLOAT")),
    (float | None, dict(type=_optional_float, metavar="FLOAT|none")),
    (int | str, dict(type=_int_or_auto, metavar="INT|auto")),
]


def _config_fields() -> list[tuple[dataclasses.Field, Any, str]]:
    """(field, type hint, group) of every flag: PPOConfig's fields, with ``backbone`` expanded into
    the MambaConfig constructor fields (PPOConfig takes those flat)."""
    from mamba_rl import MambaConfig
    from mamba_rl.agents.config import PPOConfig

    ppo_hints, mamba_hints = typing.get_type_hints(PPOConfig), typing.get_type_hints(MambaConfig)
    out = []
    for f in dataclasses.fields(PPOConfig):
        if f.name == "backbone":
            out += [(g, mamba_hints[g.name], "backbone") for g in dataclasses.fields(MambaConfig) if g.init]
        else:
            out.append((f, ppo_hints[f.name], "ppo"))
    return out


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    groups = {"ppo": parser.add_argument_group("PPOConfig (defaults: CleanRL's PPO)"),
              "backbone": parser.add_argument_group("PPOConfig.backbone (MambaConfig)")}
    for f, hint, group in _config_fields():
        flag = "--" + f.name.replace("_", "-")
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        help_text = f"{_FIELD_HELP.get(f.name, '')} (default: {default})".strip()
        kw: dict[str, Any] = dict(dest=f.name, default=argparse.SUPPRESS, help=help_text)
        kw.update(next((dict(k) for t, k in _TYPE_KW if hint == t), dict(type=str, metavar="STR")))
        flags = [flag, "--env"] if f.name == "env_id" else [flag]
        groups[group].add_argument(*flags, **kw)


def _config_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The config flags given on the command line, flat (backbone fields by their own names)."""
    names = {f.name for f, _, _ in _config_fields()}
    return {k: v for k, v in vars(args).items() if k in names}


def _train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--resume", metavar="PATH", default=None,
                   help="continue from a checkpoint folder (flags given here override its config)")
    p.add_argument("--resume-envs", action="store_true",
                   help="with --resume: also restore the envs mid-episode from the checkpoint's envs.pkl (a pickle: "
                        "only for checkpoints you trust); by default the envs are rebuilt and reset")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_config_flags(p)


def _run_train(args: argparse.Namespace) -> int:
    from mamba_rl.agents import PPOConfig, RecurrentPPO

    overrides = _config_overrides(args)
    if args.resume:
        agent = RecurrentPPO.load(args.resume, restore_envs=args.resume_envs, **overrides)
        print(f"resuming {agent.run_name} at update {agent.update}, step {agent.global_step}", file=sys.stderr)
    else:
        agent = RecurrentPPO(config=PPOConfig(**overrides))
    c = agent.config
    print(f"run {agent.run_name}: {c.env_id}, device {agent.device}, dtype {c.dtype}, backend {agent.net.backend}, "
          f"{c.num_updates} updates of {c.num_envs}x{c.num_steps} steps", file=sys.stderr)
    if c.track:
        print(f"TensorBoard: tensorboard --logdir {c.runs_dir}", file=sys.stderr)
    try:
        agent.learn(progress=not args.no_progress)
    except KeyboardInterrupt:
        print(f"\ninterrupted; checkpoint saved to {agent.checkpoint_root / 'interrupted'} "
              f"(continue with --resume)", file=sys.stderr)
        agent.close()
        return 130
    final = agent.checkpoint_root / "final"
    recent = list(agent.recent_returns)
    if recent:
        print(f"mean return of the last {len(recent)} episodes: {sum(recent) / len(recent):.2f}", file=sys.stderr)
    print(f"checkpoint: {final}")
    agent.close()
    return 0


def _eval_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, metavar="PATH", help="checkpoint folder (or its agent.safetensors)")
    p.add_argument("--episodes", type=int, default=10, help="episodes to run (default: 10)")
    p.add_argument("--deterministic", action="store_true", help="take the mode of the policy")
    p.add_argument("--video", action="store_true", help="record videos (gymnasium RecordVideo)")
    p.add_argument("--video-dir", default=None, help="video folder (default: {checkpoint}/videos)")
    p.add_argument("--seed", type=int, default=None, help="episode k resets with seed+k (default: config seed+10000)")
    p.add_argument("--device", default=None, help="auto | cpu | cuda (default: the checkpoint's)")


def _run_eval(args: argparse.Namespace) -> int:
    import os

    from mamba_rl.agents import RecurrentPPO

    if args.episodes < 1:
        raise SystemExit(f"--episodes must be >= 1, got {args.episodes}")
    overrides: dict[str, Any] = {"track": False, "num_envs": 1, "num_minibatches": 1, "capture_video": False,
                                 "async_envs": False}
    if args.device:
        overrides["device"] = args.device
    agent = RecurrentPPO.load(args.checkpoint, restore_envs=False, **overrides)
    video_dir = None
    if args.video:
        video_dir = args.video_dir or os.path.join(str(RecurrentPPO.checkpoint_file(args.checkpoint).parent), "videos")
    res = agent.evaluate(args.episodes, deterministic=args.deterministic, seed=args.seed, video_dir=video_dir)
    agent.close()
    print(f"{agent.config.env_id}: mean return {res.mean:.2f} ± {res.std:.2f} over {len(res.returns)} episodes "
          f"(mean length {res.lengths.mean():.1f})")
    if video_dir:
        print(f"videos: {video_dir}")
    return 0


register_subcommand("train", "train recurrent PPO (defaults: mamba_rl/CartPoleNoVel-v1)", _train_arguments, _run_train)
register_subcommand("eval", "evaluate a checkpoint", _eval_arguments, _run_eval)


def build_parser() -> argparse.ArgumentParser:
    """The ``mamba-rl`` parser with one subparser per entry of ``SUBCOMMANDS``."""
    parser = argparse.ArgumentParser(prog="mamba-rl", description="Mamba backbone + recurrent PPO on gymnasium.")
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(SUBCOMMANDS) + "}")
    sub.required = True
    for name, (help_text, add_arguments, run) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text,
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        add_arguments(p)
        p.set_defaults(_run=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``mamba-rl`` and ``python -m mamba_rl``; returns the exit code."""
    import gymnasium as gym

    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except (ValueError, FileNotFoundError, TypeError, ImportError, gym.error.DependencyNotInstalled) as err:
        # DependencyNotInstalled: e.g. --video without moviepy (pip install "gymnasium[other]")
        print(f"mamba-rl {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
