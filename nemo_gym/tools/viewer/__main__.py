"""``python -m nemo_gym.tools.viewer`` is ``ng_viewer``."""

from nemo_gym.tools.viewer.cli import main

main()
