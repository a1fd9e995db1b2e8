"""asyncfence's lab: the benchmark, the soak run and their measurements, run from a checkout.

Not part of the installed package: nothing in :mod:`asyncfence` imports it,
and it uses the library as a user would (its public API and
:mod:`asyncfence.testing`, which offers a few hooks for it on purpose, such as
:meth:`asyncfence.testing.CudaDevice.launch_wake_signal`). Run it from the
repository's root: ``python -m benchmarks bench`` (or
``python -m asyncfence bench``, which hands over to it there).

* :mod:`.bench`: every waiting strategy beside what users do today.
* :mod:`.soak`: a long run that checks memory and loop lag stay flat.
* :mod:`.measure`: percentiles, CPU, threads and memory, for both.
* ``results/``: the reference runs and every GPU run the docs cite.
"""
