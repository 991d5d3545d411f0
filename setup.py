"""Builds the compiled data plane (``blockd/_*.pyx``, Cython 3) beside the Python package.

The extensions are optional: where there is no C compiler or no Python headers the build warns
and the install goes on, and blockd runs its Python twins (``blockd/dataplane.py``).
``scripts/setup.sh`` installs gcc and python3-dev so that the README's set-up compiles them.
"""

from Cython.Build import cythonize
from setuptools import Extension, setup

EXTENSIONS = [
    # optional=True: a failed compile is a warning, not a failed install
    Extension("blockd._pdu_reader", ["blockd/_pdu_reader.pyx"], optional=True,
              extra_compile_args=["-O2"]),
]

setup(ext_modules=cythonize(EXTENSIONS, language_level=3, quiet=True))
