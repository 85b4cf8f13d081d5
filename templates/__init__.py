"""Jinja templates (`*.py.jinja`) that codegen renders into Triton kernels and op modules."""
