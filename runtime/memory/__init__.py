"""Reasoning about a whole training step: a card's costs and margins (`cards`, `footprint`),
shape-only steps (`estimate`), measured steps (`profile`) and the planner built on them
(`planner`, `explain`). The top floor: imports the floors below, nothing imports it but the
package's public API.
"""
