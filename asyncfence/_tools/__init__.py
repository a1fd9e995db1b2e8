"""The lab: the commands that exercise asyncfence from the outside.

``python -m asyncfence demo``, ``bench`` and ``soak`` live here, apart from the
library: nothing in :mod:`asyncfence` imports this package, and it uses the
library as a user would (its public API, :func:`asyncfence.current_statistics`,
and :mod:`asyncfence.testing`), plus the few documented package-internal
pieces the CUDA signal-hold measurement needs.

* :mod:`~asyncfence._tools.demo`: record fences on the default device and await them.
* :mod:`~asyncfence._tools.soak`: a long run that checks memory and loop lag stay flat.
* :mod:`~asyncfence._tools.bench`: every waiting strategy beside what users do today.
* :mod:`~asyncfence._tools.measure`: percentiles, CPU, threads and memory, for all three.
"""
