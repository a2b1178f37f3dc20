"""``attnlab heads ablate | importance | prune | detect``: which heads matter, how many can go
(Michel et al.), and what each head does."""

from __future__ import annotations

# The commands: each module registers its own on heads_app when imported, in the order of the help page.
# isort: off
from attnlab.cli import heads_ablate, heads_prune, heads_detect  # noqa: F401
# isort: on
