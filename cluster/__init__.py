"""Composition root: the `pdserve` command line (later: YAML -> Ray placement -> actors -> router).

Nothing imports this package; it may import every other one.
"""
