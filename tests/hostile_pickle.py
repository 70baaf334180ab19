"""A pickle that runs code when it is loaded with full pickle: the payload of the hostile-input
tests. What it runs is harmless and visible: it creates a marker file, so a test proves that no
code ran by the marker's absence."""

from __future__ import annotations

import pathlib


class TouchesMarker:
    """Pickles as a call of ``Path.touch``: unpickling it with full pickle creates ``marker``."""

    def __init__(self, marker: "str | pathlib.Path") -> None:
        self.marker = pathlib.Path(marker)

    def __reduce__(self):
        return pathlib.Path.touch, (self.marker,)
