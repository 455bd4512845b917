"""Command line: ``mamba-rl train | eval | envs | plot`` (also ``python -m mamba_rl``).

``mamba-rl train`` with no arguments trains recurrent PPO on ``mamba_rl/CartPoleNoVel-v1``
(device auto, dtype f32, CleanRL's PPO defaults), logs TensorBoard to
``runs/{env}__{exp_name}__{seed}__{unix_time}__{suffix}`` and checkpoints under
``checkpoints/{run name}/`` (periodically, at the end, and on Ctrl-C or SIGTERM, after which it prints
the steps done and the resume command, and exits with 130 after Ctrl-C, 143 after SIGTERM; a second
signal during that save waits for it, :mod:`mamba_rl.agents.interrupts`). Both folders are created exclusively, so concurrent runs never
share one (:mod:`mamba_rl.agents.runs`). Every PPOConfig field is a flag (``--num-envs 16``,
``--prev-action``, ``--no-anneal-lr``, ``--target-kl 0.02``, ``--threads 2``, ...), and so is every
field of its backbone MambaConfig (``--d-model 64``, ``--n-layers 2``, ``--dt-rank 8``, ...); their
help is the first line of the field's entry in the dataclass docstring (:func:`field_docs`).
``--resume PATH`` continues a run from a checkpoint folder: backbone, heads, both optimizers,
counters and RNG states; the envs are rebuilt and reset, unless ``--resume-envs`` also restores them
mid-episode from the checkpoint's ``envs.pkl`` (a pickle: trusted checkpoints only), which makes the
continuation identical to a run that never stopped.

``mamba-rl eval --checkpoint PATH --episodes N [--deterministic] [--video]`` runs N episodes,
resetting the memory at each, and prints the mean and std of the return.
``mamba-rl envs [--all]`` lists the env ids; ``mamba-rl plot RUN_DIR [--out PNG]`` draws a run's
learning curves from its TensorBoard events (matplotlib: the ``plot`` extra).

User mistakes end in one ``mamba-rl CMD: error: ...`` line and exit code 2 (see :func:`main`). An env that
fails while training (:class:`mamba_rl.envs.EnvFailure`: a NaN observation or reward, a dead async worker, an
exception from its step) ends in one such line too, exit code 1, after the state of the last whole update is
saved in ``checkpoints/{run name}/env_failed``. A write that fails while training (a full disk, permissions) ends
in one such line, exit code 1, the checkpoints saved before it intact.
Subcommands are argparse subparsers registered in ``SUBCOMMANDS``; add one with
``register_subcommand(name, help, add_arguments, run)``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import sys
import typing
from typing import Any, Callable, Iterator, Sequence

__all__ = ["main", "build_parser", "register_subcommand", "SUBCOMMANDS", "UsageError", "field_docs"]

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


def _bool_or_auto(text: str) -> bool | str:
    t = text.lower()
    if t in ("auto", "on", "off", "true", "false", "1", "0", "yes", "no"):
        return "auto" if t == "auto" else t in ("on", "true", "1", "yes")
    raise argparse.ArgumentTypeError(f"expected on, off or auto, got {text!r}")


def _optional_str(text: str) -> str | None:
    return None if text.lower() in ("none", "null", "default") else text


def field_docs(cls: type) -> dict[str, str]:
    """``{field: doc}`` from the ``Attributes:`` section of ``cls``'s docstring (Google style).

    The first sentence of each entry (its lines joined, up to the first ". " outside parentheses) is its
    ``--help`` text, so the dataclass docstring is the one source of a field's documentation; "(default ...)"
    parentheticals are dropped (argparse adds the default), and reST's double backticks become single quotes.
    """
    import inspect

    lines = (inspect.getdoc(cls) or "").splitlines()
    entries: dict[str, list[str]] = {}
    start = next((i for i, line in enumerate(lines) if re.match(r"^Attributes\b.*:\s*$", line.strip())), None)
    if start is None:
        return {}
    entry_indent, current = None, None
    for line in lines[start + 1:]:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent == 0:
            break  # the next section (Raises:, ...)
        entry_indent = indent if entry_indent is None else entry_indent
        m = re.match(r"^(\w+): (.*)$", line.strip())
        if indent == entry_indent and m:
            current = m.group(1)
            entries[current] = [m.group(2)]
        elif current is not None and indent > entry_indent:
            entries[current].append(line.strip())
    out = {}
    for name, parts in entries.items():
        text = re.sub(r"\s*\(default[^)]*\)", "", " ".join(parts)).replace("``", "'")
        out[name] = _first_sentence(text).strip()
    return out


def _first_sentence(text: str) -> str:
    """``text`` up to and including its first ". " (or final ".") outside parentheses; all of it if none."""
    depth = 0
    for i, ch in enumerate(text):
        depth += (ch == "(") - (ch == ")")
        if ch == "." and depth <= 0 and (i + 1 == len(text) or text[i + 1] == " "):
            return text[:i + 1]
    return text


def _field_help() -> dict[str, str]:
    from mamba_rl import MambaConfig
    from mamba_rl.agents.config import PPOConfig

    docs = {k: f"backbone {v}" for k, v in field_docs(MambaConfig).items()}
    docs.update(field_docs(PPOConfig))
    return docs


# argparse keywords per field type (PPOConfig's and MambaConfig's annotations)
_TYPE_KW: list[tuple[Any, dict[str, Any]]] = [
    (bool, dict(action=argparse.BooleanOptionalAction)),
    (int, dict(type=int, metavar="INT")),
    (float, dict(type=float, metavar="FLOAT")),
    (float | None, dict(type=_optional_float, metavar="FLOAT|none")),
    (int | str, dict(type=_int_or_auto, metavar="INT|auto")),
    (bool | str, dict(type=_bool_or_auto, nargs="?", const=True, metavar="on|off|auto")),
    (str | None, dict(type=_optional_str, metavar="STR|none")),
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
    docs = _field_help()
    for f, hint, group in _config_fields():
        flag = "--" + f.name.replace("_", "-")
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        # default=SUPPRESS: only the flags given on the command line override the config (or a
        # resumed checkpoint's config), so the default is written into the help here, once
        help_text = f"{docs.get(f.name, '')} (default: {default})".strip()
        kw: dict[str, Any] = dict(dest=f.name, default=argparse.SUPPRESS, help=help_text)
        kw.update(next((dict(k) for t, k in _TYPE_KW if hint == t), dict(type=str, metavar="STR")))
        if kw.get("metavar", "").endswith("|none"):  # the docstring's Python None is typed "none" on the command line
            kw["help"] = re.sub(r"\bNone\b", "none", help_text)
        flags = [flag, "--env"] if f.name == "env_id" else [flag]
        groups[group].add_argument(*flags, **kw)
        if hint == bool | str:  # --prev-action [on|off|auto]; --no-prev-action as for the plain bool flags
            groups[group].add_argument("--no-" + flag[2:], dest=f.name, action="store_const", const=False,
                                       default=argparse.SUPPRESS, help=f"same as {flag} off")


def _config_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The config flags given on the command line, flat (backbone fields by their own names)."""
    names = {f.name for f, _, _ in _config_fields()}
    return {k: v for k, v in vars(args).items() if k in names}


class UsageError(Exception):
    """A mistake in what the user asked for: printed as one ``mamba-rl CMD: error: ...`` line, exit 2."""


@contextlib.contextmanager
def _user_input() -> Iterator[None]:
    """Turn the errors that mean "bad input" (flag values the config refuses, unknown env ids,
    missing or unfit checkpoints, missing optional packages) into :class:`UsageError`. Only the
    setup of a command runs under it: an error while training is a bug and keeps its traceback."""
    import gymnasium as gym

    from mamba_rl.envs import UnsupportedSpace

    try:
        yield
    except UnsupportedSpace as err:
        raise UsageError(f"the env's {err.kind} space: {err}") from err
    except (ValueError, FileNotFoundError, NotADirectoryError, PermissionError, ImportError,
            gym.error.Error) as err:  # mamba_rl.CheckpointError is a ValueError
        raise UsageError(_flag_names(str(err).strip() or type(err).__name__)) from err


def _flag_names(message: str) -> str:
    """Name a config field the way the user typed it: "PPOConfig.num_envs ..." -> "--num-envs (PPOConfig.num_envs)
    ...", so a refused value points at its flag."""
    return re.sub(r"\b(PPOConfig|MambaConfig)\.(\w+)",
                  lambda m: f"--{m.group(2).replace('_', '-')} ({m.group(0)})", message, count=1)


@contextlib.contextmanager
def _checkpoint_input() -> Iterator[None]:
    """Turn what only building the agent can find out about the user's input into :class:`UsageError`: a
    checkpoint the loader refuses (:class:`mamba_rl.CheckpointError`: a truncated, mixed or unfit file), an
    env whose optional dependency is missing (gymnasium's DependencyNotInstalled, e.g. Box2D), an env that
    fails on its first reset (:class:`mamba_rl.envs.EnvFailure`) and an env whose action or observation space
    the agent takes in no form (:class:`mamba_rl.envs.UnsupportedSpace`, e.g. a 2-D MultiDiscrete action, a Graph
    observation); every other error passes with its traceback."""
    import gymnasium as gym

    from mamba_rl.envs import EnvFailure, UnsupportedSpace

    from mamba_rl.train.checkpoint import CheckpointError

    try:
        yield
    except (CheckpointError, gym.error.DependencyNotInstalled, EnvFailure) as err:
        raise UsageError(str(err).strip()) from err
    except UnsupportedSpace as err:
        raise UsageError(f"the env's {err.kind} space: {err}") from err


def _train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--resume", metavar="PATH", default=None,
                   help="continue from a checkpoint folder (flags given here override its config)")
    p.add_argument("--resume-envs", action="store_true",
                   help="with --resume: also restore the envs mid-episode from the checkpoint's envs.pkl (a pickle: "
                        "only for checkpoints you trust); by default the envs are rebuilt and reset")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--nproc", type=int, default=1, metavar="N",
                   help="data-parallel over N processes on this machine (one GPU each on CUDA, gloo on CPU): "
                        "launches torchrun --nproc-per-node N -m mamba_rl train ...; --num-envs is per process")
    _add_config_flags(p)


def _steps(n: int) -> str:
    return f"{n:,}"


def _run_train(args: argparse.Namespace) -> int:
    import time

    from mamba_rl.agents import PPOConfig, RecurrentPPO, distributed, train_ddp
    from mamba_rl.agents.checkpoint import read_agent_config
    import signal

    from mamba_rl.agents.interrupts import exit_code, ignore_until_exit, terminate_as_interrupt
    from mamba_rl.agents.policy import check_action_options
    from mamba_rl.agents.progress import apply_thread_policy
    from mamba_rl.agents.devices import resolve_device
    from mamba_rl.agents.runs import RunFolderError, claim_run
    from mamba_rl.agents.validation import check_int
    from mamba_rl.envs import EnvFailure, check_env_id, check_start_method, resolve_env_backend

    with _user_input():
        check_int("--nproc", args.nproc, lo=1)
    if args.resume_envs and not args.resume:
        raise UsageError("--resume-envs restores the envs of a checkpoint: it needs --resume PATH")
    overrides = _config_overrides(args)
    # the user-input scope covers reading and validating what the user asked for, nothing after it: an
    # error while building the model, capturing graphs or training is a bug and keeps its traceback
    with _user_input():
        config = read_agent_config(args.resume, **overrides)[1] if args.resume else PPOConfig(**overrides)
        resolve_device(config.device, config.backend)
        check_env_id(config.env_id)
        resolve_env_backend(config.env_backend, config.env_id, config.async_envs, config.capture_video)
        # under --nproc the ranks build the agent, so the parent checks the action space itself
        check_action_options(config.env_id, config.joint_action, config.action_set_coef,
                             check_space=args.nproc > 1)
        if config.async_envs:
            check_start_method(config.async_start_method)
    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:  # validated once here, not once per rank
        return train_ddp.launch(args.nproc, args._argv)
    threads = apply_thread_policy(config.threads)  # before anything builds a model
    if distributed.init_from_env(config.device):  # under torchrun: one rank of a data-parallel job
        return train_ddp.train_rank(args.resume, overrides, not args.no_progress, _checkpoint_input)
    with _checkpoint_input():
        agent = (RecurrentPPO.load(args.resume, restore_envs=args.resume_envs, **overrides) if args.resume
                 else RecurrentPPO(config=config))
    c = agent.config
    try:  # a total below the steps done would train nothing and overwrite `final`
        agent.check_total_timesteps()
    except ValueError:
        agent.close()
        raise UsageError(f"--total-timesteps {_steps(c.total_timesteps)} is below the {_steps(agent.global_step)} env "
                         f"steps this checkpoint has done: pass a larger one (or none, to keep the run's "
                         f"{_steps(read_agent_config(args.resume)[1].total_timesteps)})") from None
    if args.resume and agent.global_step >= c.planned_timesteps:
        print(f"note: this run has already done its {_steps(c.planned_timesteps)} env steps, so there is nothing "
              f"to train; pass a larger --total-timesteps to continue it", file=sys.stderr)
    try:  # the run's folders, created exclusively, before the name is printed
        claim_run(agent.run, agent.config)
    except (OSError, RunFolderError) as err:
        agent.close()
        raise UsageError(f"cannot create the run's folders under --runs-dir {agent.config.runs_dir!r} / "
                         f"--checkpoint-dir {agent.config.checkpoint_dir!r}: {err}") from err
    if args.resume:
        print(f"resuming {agent.run_name} after update {agent.update} of {agent.num_updates} "
              f"({_steps(agent.global_step)} of {_steps(c.planned_timesteps)} env steps done)", file=sys.stderr)
    rounded = "" if c.planned_timesteps == c.total_timesteps else \
        f" (--total-timesteps {_steps(c.total_timesteps)} rounded up to whole rollouts)"
    print(f"run {agent.run_name}: {c.env_id}, {c.backbone.layer}, device {agent.device}, dtype {c.dtype}, "
          f"backend {agent.policy.net.backend}, "
          f"{threads} CPU thread{'s' * (threads != 1)}; {agent.num_updates} updates of {c.num_envs}x{c.num_steps} "
          f"= {_steps(c.planned_timesteps)} env steps{rounded}", file=sys.stderr)
    if c.track:
        print(f"TensorBoard: tensorboard --logdir {c.runs_dir}", file=sys.stderr)
    start, start_step = time.perf_counter(), agent.global_step
    terminate_as_interrupt()  # SIGTERM (a scheduler stopping the job) saves `interrupted` like Ctrl-C
    try:
        agent.learn(progress=not args.no_progress)
    except EnvFailure as err:  # the env's fault, not a bug here: one error line, the last whole update saved
        ckpt = agent.failed_checkpoint
        agent.close()
        saved = (f"; the state after update {agent.update} ({_steps(agent.global_step)} env steps) is saved in "
                 f"{ckpt}, continue with: mamba-rl train --resume {ckpt}") if ckpt is not None else \
            f"; nothing was saved now (the checkpoints saved earlier are under {agent.checkpoint_root})"
        print(f"\nmamba-rl train: error: the env failed during update {agent.update + 1}: {err}{saved}",
              file=sys.stderr)
        return 1
    except OSError as err:  # a write failed (a full disk, permissions): one error line, the earlier saves intact
        agent.close()
        print(f"\nmamba-rl train: error: a write failed after update {agent.update}: {err}; the checkpoints saved "
              f"earlier are under {agent.checkpoint_root}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as err:
        ignore_until_exit()  # the run has stopped: a second signal must not raise while it closes down
        ckpt = agent.interrupted_checkpoint
        done = agent.global_step - start_step
        by = "" if exit_code(err) == 130 else f" by {signal.Signals(exit_code(err) - 128).name}"
        print(f"\ninterrupted{by} after update {agent.update} of {c.num_updates}: {_steps(agent.global_step)} "
              f"of {_steps(c.planned_timesteps)} env steps done ({_steps(done)} in this session, "
              f"{time.perf_counter() - start:.0f} s; a partial rollout is dropped)", file=sys.stderr)
        if ckpt is not None:
            print(f"checkpoint: {ckpt}\ncontinue with: mamba-rl train --resume {ckpt}", file=sys.stderr)
        elif agent.stop_save_error is not None:
            print("nothing was saved: the interrupted checkpoint could not be written (see above); the "
                  f"checkpoints saved earlier are under {agent.checkpoint_root}", file=sys.stderr)
        else:  # the signal came before the training loop began (e.g. while TensorBoard loaded): nothing to save
            print("nothing was saved: the run stopped before its training loop began; "
                  + (f"the checkpoints saved earlier are under {agent.checkpoint_root}" if agent.update else
                     "no update had run"), file=sys.stderr)
        agent.close()
        return exit_code(err)
    final = agent.checkpoint_root / "final"
    recent = list(agent.recent_returns)
    if recent:
        n = len(recent)
        print(f"mean return of the last {n} episode{'' if n == 1 else 's'}: {sum(recent) / n:.2f}", file=sys.stderr)
    session = "" if agent.global_step - start_step == agent.global_step else \
        f" ({_steps(agent.global_step - start_step)} of them in this session)"
    print(f"done: {_steps(agent.global_step)} env steps{session} in {time.perf_counter() - start:.0f} s",
          file=sys.stderr)
    print(f"checkpoint: {final}")
    agent.close()
    return 0


def _eval_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, metavar="PATH", help="checkpoint folder (or its agent.safetensors)")
    p.add_argument("--episodes", type=int, default=10, metavar="N", help="episodes to run")
    p.add_argument("--deterministic", action="store_true", help="take the mode of the policy")
    p.add_argument("--video", action="store_true", help="record videos (gymnasium RecordVideo; needs the video extra: pip install -e \".[video]\")")
    p.add_argument("--video-dir", default=None, help="video folder (default: {checkpoint}/videos)")
    p.add_argument("--seed", type=int, default=None, help="episode k resets with seed+k (default: config seed+10000)")
    p.add_argument("--device", default=None, help="auto | cpu | cuda (default: the checkpoint's)")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="torch CPU threads (default: the checkpoint's config, 0 = auto)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _run_eval(args: argparse.Namespace) -> int:
    import os

    from mamba_rl.agents import RecurrentPPO
    from mamba_rl.agents.checkpoint import read_agent_config
    from mamba_rl.agents.devices import resolve_device
    from mamba_rl.agents.progress import apply_thread_policy
    from mamba_rl.agents.validation import check_int

    with _user_input():
        check_int("--episodes", args.episodes, lo=1)
        if args.seed is not None:
            check_int("--seed", args.seed, lo=0, hi=2**32 - 1 - args.episodes)
    overrides: dict[str, Any] = {"track": False, "num_envs": 1, "num_minibatches": 1, "capture_video": False,
                                 "async_envs": False}
    if args.device:
        overrides["device"] = args.device
    if args.threads is not None:
        overrides["threads"] = args.threads
    with _user_input():
        config = read_agent_config(args.checkpoint, **overrides)[1]
        resolve_device(config.device, config.backend)
        apply_thread_policy(config.threads)
        agent = RecurrentPPO.load(args.checkpoint, restore_envs=False, **overrides)
    video_dir = None
    if args.video:
        import importlib.util
        missing = [m for m in ("moviepy", "pygame") if importlib.util.find_spec(m) is None]
        if missing:  # checked before anything writes a videos/ folder
            agent.close()
            raise UsageError(f"--video needs {' and '.join(missing)} (gymnasium's RecordVideo and the classic-control "
                             f"renderer): pip install -e \".[video]\"")
        video_dir = args.video_dir or os.path.join(str(RecurrentPPO.checkpoint_file(args.checkpoint).parent), "videos")
    import gymnasium as gym

    try:
        res = agent.evaluate(args.episodes, deterministic=args.deterministic, seed=args.seed, video_dir=video_dir,
                             progress=not args.no_progress)
    except gym.error.DependencyNotInstalled as err:  # --video without moviepy: pip install "gymnasium[other]"
        raise UsageError(str(err)) from err
    finally:
        agent.close()
    print(f"{agent.config.env_id}: mean return {res.mean:.2f} ± {res.std:.2f} over {len(res.returns)} episodes "
          f"(mean length {res.lengths.mean():.1f})")
    if video_dir:
        print(f"videos: {video_dir}")
    return 0


def _envs_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--all", action="store_true", help="also list every id in gymnasium's registry")


def _run_envs(args: argparse.Namespace) -> int:
    from mamba_rl.envs import list_env_ids

    ids = list_env_ids(everything=args.all)
    titles = {"mamba_rl": "registered by mamba_rl (POMDP: velocities masked)",
              "popgym": "POPGym (the popgym extra)", "gymnasium": "gymnasium's registry"}
    for key, env_ids in ids.items():
        print(f"{titles[key]}:")
        for env_id in env_ids:
            print(f"  {env_id}")
    if "popgym" not in ids:
        print('POPGym ids: pip install -e ".[popgym]"')
    print("any other id gymnasium.make accepts works too, e.g. CartPole-v1 or module:EnvId "
          "(mamba-rl envs --all lists gymnasium's registry)")
    return 0


def _plot_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="a TensorBoard run folder, e.g. runs/<run name>")
    p.add_argument("--out", default=None, metavar="PNG", help="image to write (default: RUN_DIR/curves.png)")


def _run_plot(args: argparse.Namespace) -> int:
    from mamba_rl.agents.plot import plot_run

    with _user_input():
        out = plot_run(args.run_dir, args.out)
    print(f"plot: {out}")
    return 0


register_subcommand("train", "train recurrent PPO (defaults: mamba_rl/CartPoleNoVel-v1)", _train_arguments, _run_train)
register_subcommand("eval", "evaluate a checkpoint", _eval_arguments, _run_eval)
register_subcommand("envs", "list the env ids mamba_rl registers (and POPGym's, when installed)", _envs_arguments,
                    _run_envs)
register_subcommand("plot", "learning curves of a run (episodic return and losses vs env steps) as a PNG; "
                    'needs matplotlib: pip install -e ".[plot]"', _plot_arguments, _run_plot)


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter plus " (default: X)" for flags whose help does not state its default
    already and whose default says something (not None, not a store_true's False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose parse errors (a flag value of the wrong type, an unknown flag, a missing
    subcommand) are the one ``PROG: error: ...`` line and exit 2 of every other user mistake, not the error
    after the whole usage block (some 30 lines for ``train``); ``--help`` still prints the usage."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``mamba-rl`` parser with one subparser per entry of ``SUBCOMMANDS``."""
    parser = _Parser(prog="mamba-rl", description="Mamba backbone + recurrent PPO on gymnasium.")
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(SUBCOMMANDS) + "}", parser_class=_Parser)
    sub.required = True
    for name, (help_text, add_arguments, run) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=_HelpFormatter)
        add_arguments(p)
        p.set_defaults(_run=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``mamba-rl`` and ``python -m mamba_rl``; returns the exit code.

    A user mistake (a flag value the config refuses, an unknown env id, a missing or unfit
    checkpoint, CUDA asked for but absent, a missing optional package) prints one
    ``mamba-rl CMD: error: ...`` line on stderr and returns 2, as argparse does for a bad flag; a
    stdout closed by its reader (``mamba-rl envs | head``) returns 141 quietly (128 + SIGPIPE);
    anything else (a bug) keeps its traceback.
    """
    args = build_parser().parse_args(argv)
    args._argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return int(args._run(args) or 0)
    except UsageError as err:
        print(f"mamba-rl {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before training started (imports, env and model setup): nothing to save
        print(f"\nmamba-rl {args.command}: interrupted before anything was saved", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout closed by its reader (``mamba-rl envs | head``): stop quietly, as a shell tool
        # does; stdout goes to /dev/null so that the interpreter's final flush does not raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a writer whose reader went away


if __name__ == "__main__":  # also ``python -m mamba_rl``, which torchrun runs on every rank
    code = main()
    if os.environ.get("WORLD_SIZE", "1").strip() not in ("", "1"):
        from mamba_rl.agents.train_ddp import exit_rank

        exit_rank(code)
    sys.exit(code)
