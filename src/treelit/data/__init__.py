"""Data: reading records (:mod:`.records`, :mod:`.sources`), tokenizers, synthetic data, and the
streams and statistics that run the tree builders over them (:mod:`.stream`, :mod:`.stats`).

Reading sits below :mod:`treelit.builders`; streams and statistics sit above it (see the
layers in ``pyproject.toml``). This face imports nothing.
"""
