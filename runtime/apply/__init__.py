"""A policy applied to a model: its rules (`policy`), a probe of what reads what (`trace`),
the plan of edits and its report (`compress`), the bytes a step saves per module
(`accounting`). Imports the floors below it (ops, models), never the memory floor above.
"""
