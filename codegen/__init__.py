"""Codegen: renders the templates in `actdesign.templates` into Triton kernels and op modules.

Reads only spec files produced by `actdesign.designer`; nothing from a spec is pasted into code
except validated numbers.
"""
