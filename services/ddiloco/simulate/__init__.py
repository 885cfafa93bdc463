"""Goodput simulator: how much provisioned chip-time reaches the model under failures,
for synchronous data-parallel, elastic data-parallel and Decoupled DiLoCo training.

Modules: :mod:`.params` (inputs), :mod:`.closed_form` (long-run expectations),
:mod:`.model` (seeded, vectorised stochastic simulation), :mod:`.published` (the
paper's figures), :mod:`.calibrate` (one fitted constant per method family),
:mod:`.report` (table, JSON, plot), :mod:`.cli` (``ddiloco simulate``).
"""
