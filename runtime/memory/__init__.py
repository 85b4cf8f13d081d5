"""Reasoning about a whole training step: a card's costs and margins (`cards`, `footprint`),
shape-only steps (`estimate`), measured steps (`profile`), gradient error measured on
batches (`calibrate`, `calibrate_policy`) and the planner built on all of them (`planner`,
`explain`). The top floor: imports `apply` and `ops`, nothing imports it but the package's
public API.
"""
