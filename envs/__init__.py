"""Environments for mamba_rl: a gymnasium vector-env factory and POMDP (velocity-masked) tasks.

``make_vec_env`` builds a ``gymnasium.vector`` env from any id ``gymnasium.make`` accepts:
gymnasium's own, the ``mamba_rl/*NoVel*`` ids registered on import (:mod:`.pomdp`), ``module:EnvId``
ids (the module is imported first, in the main process and in every async worker) and POPGym's
``popgym-*`` ids (optional extra ``pip install -e ".[popgym]"``; imported on first use of such an id).
Modules: :mod:`.registry` (id checks, ``list_env_ids`` for ``mamba-rl envs``), :mod:`.vector` (the
factories), :mod:`.wrappers` (picklable flattening and joint-action wrappers, vector-stack helpers), :mod:`.guards`
(non-finite values and dead workers at the env boundary), :mod:`.stats` (vector episode statistics and
reward normalisation), :mod:`.envpool_backend` (the optional EnvPool backend), :mod:`.parts` (stepping in parts), :mod:`.pomdp`.
"""

from .envpool_backend import ENV_BACKENDS, EnvPoolVecEnv, envpool_available, envpool_task
from .guards import EnvFailure, EnvGuard, EnvStepError, EnvWorkerDied, NonFiniteEnvError, flatten_observation
from .pomdp import POMDP_ENV_IDS, MaskObservation, make_masked_env, register_pomdp_envs
from .registry import check_env_id, list_env_ids
from .parts import PartedStep, env_part_rows
from .stats import VecEpisodeStatistics, VecNormalizeObservation, VecNormalizeReward
from .vector import check_start_method, make_env, make_vec_env, resolve_env_backend
from .wrappers import (MAX_JOINT_ACTIONS, FlattenObs, FlattenVecObs, Float32Obs, JointAction,
                       UnsupportedActionSpace, UnsupportedObservationSpace, UnsupportedSpace, find_vector_wrapper,
                       joined_already, finished_episode_arrays,
                       finished_episodes, flatten_vec_obs, needs_flatten, raw_observation_space,
                       requires_prev_action)

__all__ = [
    "make_env", "make_vec_env", "check_start_method", "check_env_id", "list_env_ids", "finished_episodes",
    "finished_episode_arrays", "find_vector_wrapper", "flatten_vec_obs", "needs_flatten", "raw_observation_space", "requires_prev_action", "FlattenObs", "JointAction", "MAX_JOINT_ACTIONS", "joined_already", "FlattenVecObs", "Float32Obs", "UnsupportedSpace", "UnsupportedObservationSpace", "UnsupportedActionSpace",
    "MaskObservation", "POMDP_ENV_IDS", "make_masked_env", "register_pomdp_envs", "EnvGuard", "EnvFailure", "EnvStepError", "EnvWorkerDied",
    "NonFiniteEnvError", "flatten_observation", "ENV_BACKENDS", "EnvPoolVecEnv", "envpool_available", "envpool_task",
    "resolve_env_backend", "VecEpisodeStatistics", "VecNormalizeReward", "VecNormalizeObservation", "PartedStep",
    "env_part_rows",
]

register_pomdp_envs()
