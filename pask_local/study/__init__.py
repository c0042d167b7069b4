"""``pask-local study ...``: the method study as commands (run, table, compare, headroom, kv-bytes).

One small module per job; ``cli.py`` holds the typer sub-app that ``pask_local/cli.py`` mounts as
``study``. The merging, pairing and measuring live in ``pask_local.eval`` (``study``, ``paired``,
``headroom``, ``kvbytes``); imports go one way, study -> eval.
"""
