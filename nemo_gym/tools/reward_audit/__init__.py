"""``ng_reward_audit``: an adversarial battery played against environments' verifiers (docs/rewards.md).

:mod:`~nemo_gym.tools.reward_audit.spec` reads an environment's ``exploits.yaml``;
:mod:`~nemo_gym.tools.reward_audit.battery` builds the plays (the control, the generic exploits, the
environment's own); :mod:`~nemo_gym.tools.reward_audit.play` starts the environment with the scripted model
and plays them through the agent; :mod:`~nemo_gym.tools.reward_audit.cli` is the command.
"""
