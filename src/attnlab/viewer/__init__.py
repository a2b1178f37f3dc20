"""The attention viewer: a local web page to look at every head and switch heads off live.

Li's slides end with "Visualising learned attentions: different heads show different patterns".
Here a person looks and intervenes in the same place: the page shows each layer's and head's
attention (a head view of lines between tokens and a model view of small heatmaps, under an
overview of every head of the model as a layers x heads grid of thumbnails) and the model's output;
clicking a head zeroes its entry of the head mask ξ (Michel §2.3) and re-runs the model.

Modules: :mod:`.requests` (parsing and checking what the page sends), :mod:`.importance` (the
``attnlab heads importance`` CSV), :mod:`.overview` (every head's map pooled to a thumbnail),
:mod:`.payload` (a run as JSON), :mod:`.server` (the Starlette
app), :mod:`.serve` (uvicorn on a socket). The JSON API is documented in ``API.md`` beside this file.
:mod:`.notebook` draws the same views inline in Jupyter, without a server (``attnlab.show``), and a
patterns view of one layer's heads on the tokens (``show_patterns``); the page and the notebook views
share their drawing code, ``static/draw.js``.
"""

from attnlab.viewer.server import create_app

__all__ = ["create_app"]
