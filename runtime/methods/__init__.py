"""The compression methods and what they target: one module per method, read by compress,
estimate, the planner and the CLI through one registry. Imports the ops and the models below
it; the floors above (apply, calibration, memory) read it.
"""
