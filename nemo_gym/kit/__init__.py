"""The environment author's kit: helpers a verifier or a model server uses, independent of HTTP.

The upstream paths of the kit sit at the package's top or beside it, on this layer: ``nemo_gym.kit.judge``,
``nemo_gym.kit.prompt``, ``nemo_gym.kit.reward_profile``, ``nemo_gym.kit.responses_converter`` and the sandbox
(``nemo_gym.sandbox``). Here: the pool that runs CPU-heavy verification off the event loop, in
processes or as Ray tasks (:mod:`~nemo_gym.kit.verify_pool`), Chat Completions <-> Responses conversion
for model servers (:mod:`~nemo_gym.kit.chat_conversion`), reward statistics (pass@k, reward profiles:
:mod:`~nemo_gym.kit.rollout_stats`) and the set-up of a process that runs Ray work
(:mod:`~nemo_gym.kit.ray_quiet`).

May import: the base modules, ``config`` and ``openai_utils`` only: the kit works the same in a
server, a test or a notebook.
"""
