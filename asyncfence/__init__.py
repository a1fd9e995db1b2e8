"""Await GPU and other device work without blocking the event loop.

A fence marks a point on a device stream; ``await fence`` resumes the coroutine
once the device has passed it. Waits run natively on asyncio (uvloop included)
and trio, and so under anyio, without a thread per wait.

Thread-safety: :func:`record`, :func:`configure`, and a fence's ``done()``,
``wait_sync()`` and ``enqueue_wait()`` may be called from any thread. Awaiting
happens on an event loop; several loops may await one fence at once.
"""

from importlib import metadata as _metadata

from ._backend import BackendStatistics as BackendStatistics
from ._backend import backend_statistics as backend_statistics
from ._backends import DeviceBuffer as DeviceBuffer  # and registers the device backends
from ._backends import PinnedBuffer as PinnedBuffer
from ._config import Config as Config
from ._config import configure as configure
from ._drop_queue import DropQueue as DropQueue
from ._drop_queue import DropQueueStatistics as DropQueueStatistics
from ._exceptions import ClosedResourceError as ClosedResourceError
from ._exceptions import DeviceError as DeviceError
from ._exceptions import DriverNotFoundError as DriverNotFoundError
from ._exceptions import FenceError as FenceError
from ._exceptions import FenceLostError as FenceLostError
from ._exceptions import TokenRefusedError as TokenRefusedError
from ._fence import Fence as Fence
from ._fence import from_event as from_event
from ._fence import record as record
from ._fence import warm_up as warm_up
from ._interprocess import FenceToken as FenceToken
from ._interprocess import ImportedFence as ImportedFence
from ._interprocess import import_fence as import_fence
from ._poller import PollerStatistics as PollerStatistics
from ._poller import current_statistics as current_statistics
from ._staging import StagingPool as StagingPool
from ._staging import StagingPoolStatistics as StagingPoolStatistics

__all__ = (
    "BackendStatistics",
    "ClosedResourceError",
    "Config",
    "DeviceBuffer",
    "DeviceError",
    "DriverNotFoundError",
    "DropQueue",
    "DropQueueStatistics",
    "Fence",
    "FenceError",
    "FenceLostError",
    "FenceToken",
    "ImportedFence",
    "PinnedBuffer",
    "PollerStatistics",
    "StagingPool",
    "StagingPoolStatistics",
    "TokenRefusedError",
    "backend_statistics",
    "configure",
    "current_statistics",
    "from_event",
    "import_fence",
    "record",
    "warm_up",
)

#: The installed distribution's version (pyproject.toml holds the one literal).
__version__: str = _metadata.version("asyncfence")

for _name in __all__:
    globals()[_name].__module__ = "asyncfence"
del _name
