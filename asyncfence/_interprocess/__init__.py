"""Fences across processes: a token exported by one process's loop, awaited in another's.

* :mod:`._protocol`: the token, and what the two sides say to each other;
* :mod:`._exporting`: the exporting side, a loop's relay;
* :mod:`._importing`: the importing side, :class:`ImportedFence`;
* :mod:`._peer`: who is at each end of a connection.

The guide and its threat model: ``docs/processes.md``. Design:
``docs/design.md`` ("Fences across processes").
"""

from ._exporting import export_core
from ._importing import ImportedFence, import_fence
from ._protocol import FenceToken

__all__ = ["FenceToken", "ImportedFence", "export_core", "import_fence"]
