"""Standalone scripts that another Python runs for ``attnlab bench`` (``bench tl --python PATH``).

Each file here imports only the standard library, the peer's own packages (torch, transformers,
transformer_lens) and its siblings, never attnlab, and this folder holds nothing else: run as a
script, a file's folder comes first on ``sys.path``, where its siblings are found and no module of
attnlab's may shadow one of the peer's (:mod:`attnlab.bench.peer` starts them).
"""
