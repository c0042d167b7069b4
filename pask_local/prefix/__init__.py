"""Compress once, reuse every turn: prefix files (``pask-local compress``, ``run``/``serve --prefix``).

``state``: one sequence's K/V as bytes and back; ``file``: the prefix file format and its checks;
``build``: finding, compressing, saving and loading a prefix.
"""
