"""Builds the compiled data plane (the ``_*.pyx`` modules, Cython 3) beside the Python package.

The extensions are optional: where there is no C compiler or no Python headers the build warns
and the install goes on, and blockd runs its Python twins (``blockd/dataplane.py``).
``scripts/setup.sh`` installs gcc and python3-dev so that the README's set-up compiles them.
"""

import sys

from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


FALLBACK = {
    "initiator.fuse._loop": "FUSE mounts will run the Python request loop over /dev/fuse, without "
                            "io_uring (install liburing-dev, e.g. with scripts/setup.sh, then reinstall)",
    "target._uring_loop": "NVMe/TCP queue threads will make their own system calls, without io_uring "
                          "(install liburing-dev, e.g. with scripts/setup.sh, then reinstall)",
    "target._digest": "a Digest command and a verify will read and hash a plain file in Python, in pieces "
                      "(install libxxhash-dev, e.g. with scripts/setup.sh, then reinstall)",
    "blockd.rdma._fast_verbs": "RDMA will run its ctypes path (blockd/rdma/_fast.py; install "
                               "libibverbs-dev, e.g. with scripts/setup.sh, then reinstall)",
}
"""What a failed extension means, where it is not the whole pure-Python data plane."""


class OptionalBuildExt(build_ext):
    """A failed compile is a warning that says what it means, not a failed install; each
    extension is compiled on its own, so the others still build."""

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # the compiler's errors come as several distutils and OS types
            means = FALLBACK.get(ext.name, "blockd will run its pure-Python data plane (install gcc "
                                 "and python3-dev, e.g. with scripts/setup.sh, then reinstall)")
            print(f"WARNING: blockd: cannot compile {ext.name} ({exc}); {means}", file=sys.stderr)


EXTENSIONS = [
    Extension("blockd._pdu_reader", ["blockd/_pdu_reader.pyx"], extra_compile_args=["-O2"]),
    Extension("blockd._output", ["blockd/_output.pyx"], extra_compile_args=["-O2"]),
    Extension("blockd._iostats", ["blockd/_iostats.pyx"], extra_compile_args=["-O2"]),
    Extension("target._file_io", ["target/_file_io.pyx"], extra_compile_args=["-O2"]),
    Extension("target._io_core", ["target/_io_core.pyx"], extra_compile_args=["-O2"]),
    Extension("target._tcp_io", ["target/_tcp_io.pyx"], extra_compile_args=["-O2"]),
    Extension("target._tcp_thread", ["target/_tcp_thread.pyx"], extra_compile_args=["-O2"]),
    Extension("target._rdma_fast", ["target/_rdma_fast.pyx"], extra_compile_args=["-O2"]),
    Extension("target.replication._mirror_io", ["target/replication/_mirror_io.pyx"], extra_compile_args=["-O2"]),
    Extension("initiator._queue", ["initiator/_queue.pyx"], extra_compile_args=["-O2"]),
    Extension("initiator._lane", ["initiator/_lane.pyx"], extra_compile_args=["-O2"]),
    Extension("initiator._inline", ["initiator/_inline.pyx"], extra_compile_args=["-O2"]),
    Extension("initiator._tcp_host_io", ["initiator/_tcp_host_io.pyx"], extra_compile_args=["-O2"]),
    Extension("initiator.fuse._rangelock", ["initiator/fuse/_rangelock.pyx"], extra_compile_args=["-O2"]),
    # needs <liburing.h> (liburing-dev): FUSE over io_uring; without it the compiled FUSE loop is
    # skipped with the warning above and the Python one serves /dev/fuse
    Extension("initiator.fuse._loop", ["initiator/fuse/_loop.pyx"], extra_compile_args=["-O2"],
              libraries=["uring"]),
    # needs <liburing.h> too: the target's queue threads on io_uring (target/_uring_loop.pyx)
    Extension("target._uring_loop", ["target/_uring_loop.pyx"], extra_compile_args=["-O2"], libraries=["uring"]),
    # needs <xxhash.h> (libxxhash-dev): a plain file's digests read and hashed without the GIL;
    # without it this one is skipped with the warning above and target/digest.py hashes in Python
    Extension("target._digest", ["target/_digest.pyx"], extra_compile_args=["-O2"], libraries=["xxhash"]),
    # needs <infiniband/verbs.h> (libibverbs-dev); without it this one is skipped with the
    # warning above and blockd.rdma.verbs runs the ctypes path (blockd/rdma/_fast.py)
    Extension("blockd.rdma._fast_verbs", ["blockd/rdma/_fast_verbs.pyx"], extra_compile_args=["-O2"],
              libraries=["ibverbs"]),
]

compiled = cythonize(EXTENSIONS, language_level=3, quiet=True)
for ext in compiled:
    # cythonize drops Extension(optional=True); setuptools needs it to skip copying a module that
    # did not build (an editable install copies each one into the source tree)
    ext.optional = True

setup(ext_modules=compiled, cmdclass={"build_ext": OptionalBuildExt})
