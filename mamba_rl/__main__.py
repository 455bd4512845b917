"""``python -m mamba_rl`` = the ``mamba-rl`` command (``mamba_rl.agents.cli``): an entry point, not a library
module, so the core's modules still never import the agent layer."""
import runpy

runpy.run_module("mamba_rl.agents.cli", run_name="__main__", alter_sys=True)
