"""Calibration on the user's batches: ActNN's gradient statistics and exact bit allocation
(`bits`), and per-layer activation tables with those bits, written as one policy (`policy`).
Imports the floors below it (ops, models, apply); nothing imports it but the public API.
"""
