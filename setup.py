"""Declares kvoffload's optional native copy; everything else is in ``pyproject.toml``.

``kvoffload._streamcopy`` runs ThreadCopyEngine's large copies as one batch with streaming
stores. It is optional: where no C compiler is at hand the install goes on without it and
the copy engine falls back to one ``memmove`` per piece (``kvoffload.transfer.gather``'s
``STREAMING`` says which).
"""

from __future__ import annotations

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("kvoffload._streamcopy", sources=["kvoffload/_streamcopy.c"], optional=True)
    ]
)
