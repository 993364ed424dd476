"""The environment author's kit: helpers a verifier or a model server uses, independent of HTTP.

LLM-as-judge calls with bounded retries (:mod:`~nemo_gym.kit.judge`), prompt templates
(:mod:`~nemo_gym.kit.prompt`), reward statistics and profiles (:mod:`~nemo_gym.kit.rollout_stats`,
:mod:`~nemo_gym.kit.reward_profile`, ``ng_reward_profile``), the pool that runs CPU-heavy verification
off the event loop, in processes or as Ray tasks (:mod:`~nemo_gym.kit.verify_pool`), Chat Completions
<-> Responses conversion for model servers (:mod:`~nemo_gym.kit.chat_conversion`,
:mod:`~nemo_gym.kit.responses_converter`) and the set-up of a process that runs Ray work
(:mod:`~nemo_gym.kit.ray_quiet`); an external sort and a lookup table on disk, for statistics whose
memory must not grow with the rows (:mod:`~nemo_gym.kit.spill`); the command line of an environment's
seeded dataset generator (:mod:`~nemo_gym.kit.dataset_cli`); a long tool output cut to
its head and tail for the model, and the fenced code blocks of a model's answer found in linear time
(:mod:`~nemo_gym.kit.text`). The sandbox for untrusted code is on
this layer at upstream's path, ``nemo_gym.sandbox``; ``nemo_gym.judge``, ``nemo_gym.prompt``,
``nemo_gym.reward_profile`` and ``nemo_gym.responses_converter`` are upstream's paths, thin faces.

May import: the base modules, ``config`` and ``openai_utils`` only: the kit works the same in a
server, a test or a notebook.
"""
