"""``ng_viewer``: a local web page for reading rollouts files written by ``ng_collect_rollouts``.

Pieces
------
* :mod:`nemo_gym.tools.viewer.index` — the line-offset index: one streaming pass over the file records
  where each line starts and a compact summary of it (reward, indices, agent, turns, tool calls,
  tokens); the index is cached on disk keyed by the file's size and mtime, so a second open is
  instant, and rows are read from disk one at a time when the page asks for them; what it keeps of a
  row is :mod:`nemo_gym.tools.viewer.row_facts`'s.
* :mod:`nemo_gym.tools.viewer.dataset` — one opened file: background indexing, the rows of a query, the
  summary and per-task tables, all over the compact index; :mod:`nemo_gym.tools.viewer.query` its filters,
  sorts, pages and histograms; :mod:`nemo_gym.tools.viewer.search` full-text search (a bounded scan in a
  worker thread); :mod:`nemo_gym.tools.viewer.compare` two files side by side.
* :mod:`nemo_gym.tools.viewer.app` — the FastAPI app: JSON API plus the hand-written page in ``static/``.
* :mod:`nemo_gym.tools.viewer.cli` — ``ng_viewer +jsonl_fpath=<rollouts.jsonl> [+host=...] [+port=...]``.
* :mod:`nemo_gym.tools.bench.viewer` — ``python -m nemo_gym.tools.bench.viewer``: index time, time to first
  paint and server RSS on a generated 100,000-rollout (>= 1 GB) file.
"""
