"""``python -m nemo_gym.viewer`` is ``ng_viewer``."""

from nemo_gym.viewer.cli import main

main()
