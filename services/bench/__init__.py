"""Benchmarks: `strata bench serve` (a running server over HTTP), `strata bench offline`
(the engine in-process) and `strata bench compare` (two results side by side). No torch here."""
