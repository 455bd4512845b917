"""Signals on a single-process `mamba-rl train` (agents/interrupts.py), each in a subprocess."""

import os
import re
import signal
import subprocess
import sys
import time

from mamba_rl.agents import RecurrentPPO

TINY = ["--env-id", "CartPole-v1", "--num-envs", "2", "--num-steps", "8", "--num-minibatches", "1",
        "--update-epochs", "1", "--d-model", "16", "--n-layers", "1", "--d-state", "4", "--device", "cpu",
        "--backend", "reference", "--no-progress", "--no-track", "--checkpoint-every", "0"]


def _resume_path(stderr: str) -> str:
    m = re.search(r"continue with: mamba-rl train --resume (\S+)", stderr)
    assert m, stderr
    return m.group(1)


def test_sigterm_saves_interrupted_like_ctrl_c(tmp_path):
    cmd = [sys.executable, "-m", "mamba_rl", "train", *TINY, "--total-timesteps", "10000000",
           "--checkpoint-dir", str(tmp_path / "ckpt")]
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        lines = []
        for line in p.stderr:  # the run line is printed right before learn() starts
            lines.append(line)
            if line.startswith("run "):
                break
        time.sleep(2.0)
        p.send_signal(signal.SIGTERM)
        _, rest = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    stderr = "".join(lines) + rest
    assert p.returncode == 143, stderr  # 128 + SIGTERM, documented (Ctrl-C: 130)
    path = _resume_path(stderr)
    assert path.endswith("interrupted") and os.path.isfile(os.path.join(path, "agent.safetensors"))
    agent = RecurrentPPO.load(path)
    assert agent.update >= 1 and agent.global_step == agent.update * 16
    agent.close()


# A child inherits an ignored SIGINT (a background job of a non-interactive shell starts so: `cmd &` in a
# script); these children restore the default so the test is about our handlers, however pytest was started.
_DOUBLE = """
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
import mamba_rl.agents.checkpoint as ck
from mamba_rl.agents import RecurrentPPO
from mamba_rl.agents.cli import main

real_update = RecurrentPPO.update_policy
def update_policy(self):                 # the first Ctrl-C, in the middle of update 2
    if self.update == 1:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.5)
    return real_update(self)
RecurrentPPO.update_policy = update_policy

real_save = ck.save_checkpoint
def save_checkpoint(*a, **k):            # the second Ctrl-C, while `interrupted` is being saved
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.5)
    return real_save(*a, **k)
ck.save_checkpoint = save_checkpoint
sys.exit(main(sys.argv[1:]))
"""


def test_a_second_ctrl_c_during_the_save_waits_for_it(tmp_path):
    r = subprocess.run([sys.executable, "-c", _DOUBLE, "train", *TINY, "--total-timesteps", "160",
                        "--checkpoint-dir", str(tmp_path / "ckpt")], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    assert r.returncode == 130, r.stderr
    assert "SIGINT received while saving" in r.stderr
    path = _resume_path(r.stderr)
    assert os.path.isfile(os.path.join(path, "agent.safetensors")), r.stderr  # was: an empty folder
    agent = RecurrentPPO.load(path)
    assert agent.update == 1 and agent.global_step == 16
    agent.close()


_SIMULTANEOUS = """
import os, signal, sys, threading
signal.signal(signal.SIGINT, signal.default_int_handler)
from mamba_rl.agents import RecurrentPPO
from mamba_rl.agents.cli import main

real_update = RecurrentPPO.update_policy
def update_policy(self):  # Ctrl-C and SIGTERM delivered together: Python runs the second handler at its next
    if self.update == 1:  # check, i.e. inside the `except KeyboardInterrupt` that saves (the race, made certain)
        both = {signal.SIGINT, signal.SIGTERM}
        signal.pthread_sigmask(signal.SIG_BLOCK, both)  # thread-directed: both stay pending on this thread
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # (a process-directed kill could go
        signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)  # to another thread at once)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, both)
    return real_update(self)
RecurrentPPO.update_policy = update_policy
sys.exit(main(sys.argv[1:]))
"""


def test_two_signals_at_once_still_save_interrupted(tmp_path):
    r = subprocess.run([sys.executable, "-c", _SIMULTANEOUS, "train", *TINY, "--total-timesteps", "160",
                        "--checkpoint-dir", str(tmp_path / "ckpt")], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    assert r.returncode == 130, r.stderr
    assert "SIGTERM received while saving" in r.stderr and "nothing was saved" not in r.stderr, r.stderr
    path = _resume_path(r.stderr)
    assert os.path.isfile(os.path.join(path, "agent.safetensors")), r.stderr


_AFTER_THE_SAVE = """
import os, signal, sys, time
from mamba_rl.agents import RecurrentPPO
from mamba_rl.agents.cli import main

real_update, real_close = RecurrentPPO.update_policy, RecurrentPPO.close
def update_policy(self):                 # the first SIGTERM, in the middle of update 2
    if self.update == 1:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)
    return real_update(self)
def close(self):                         # a second SIGTERM once `interrupted` is saved, while the run closes down
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.5)
    return real_close(self)
RecurrentPPO.update_policy, RecurrentPPO.close = update_policy, close
sys.exit(main(sys.argv[1:]))
"""


def test_a_signal_after_the_save_is_ignored_without_a_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-c", _AFTER_THE_SAVE, "train", *TINY, "--total-timesteps", "160",
                        "--checkpoint-dir", str(tmp_path / "ckpt")], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    assert r.returncode == 143, r.stderr  # the first signal's code
    assert "SIGTERM received while the run is already stopping: ignored" in r.stderr
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr
    assert os.path.isfile(os.path.join(_resume_path(r.stderr), "agent.safetensors"))
