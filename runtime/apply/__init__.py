"""A policy applied to a model: its rules (`policy`), a probe of what reads what (`trace`),
the plan of edits and its report (`compress`), the bytes a step saves per module
(`accounting`), and the built-in models and batches everything above runs on. Imports the
ops below it, never the memory floor above.
"""
