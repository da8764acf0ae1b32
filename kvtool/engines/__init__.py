"""Engines as oracles and as implementations under test.

Nothing from an engine is vendored: `wheels` fetches an engine's published wheel without dependencies into a cache
folder, extracts only the members asked for, and the modules beside it load those files through small import shims
of kvtool's own.
"""
