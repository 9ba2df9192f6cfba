"""Helpers of the autograd layer (L3): grad modes, hooks, the backward engine, gradcheck.

Only :mod:`needle.autograd` imports these; users reach them through it.
"""
