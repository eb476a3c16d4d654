"""A pickle payload for the tests that prove no file this library reads runs code."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


class Payload:
    """Unpickling this creates ``marker``: proof that code from the file ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))
