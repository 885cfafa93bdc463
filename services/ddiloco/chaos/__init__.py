"""Chaos: inject faults into a running system and account for what they cost.

- ``faults``: what a fault is (kill, freeze, partition) and schedules of them, periodic or
  random with a seed.
- ``controller``: plays a schedule against a backend and logs every fault into the run's
  ``metrics.jsonl`` (event ``fault``).
- ``local``: the backend for services running as local processes (``launcher.processes``).
- ``dockerbackend``: the backend for containers, through the Docker SDK for Python.
- ``run``: a local run with a chaos schedule (used by ``ddiloco chaos`` and ``bench/chaos.py``).
- ``goodput``: goodput and waste by cause, a pure function of the event log.
- ``audit``: invariants read back from the event log (acknowledged deltas lost, deltas
  applied twice, global versions only increasing).
"""
