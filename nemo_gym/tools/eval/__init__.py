"""Evaluation workflow commands built on the core pieces: ``ng_e2e_collect_rollouts`` (:mod:`.e2e`) and
experiment tracking (:mod:`.tracking`). Nothing here is imported by the servers."""
