# cython: language_level=3
"""Declarations of ``target/replication/_mirror_io.pyx`` (the compiled twin of
``ReplicatedBackend.write``'s steady case) for the target's compiled TCP path, which hands it
the in-capsule writes ``target._io_core.mirror_eligible`` accepts."""

from target._file_io cimport FastFile


cdef class MirrorLane:
    cdef readonly object mirror
    # The ReplicatedBackend it serves (its state is read there at every write: never copied).
    cdef readonly FastFile file
    # The local copy's descriptor (the inner FileBackend's: -1 once it closed).
    cdef readonly unsigned long long size
    # The data area's bytes: the namespace's range is checked against it by mirror_eligible.
    cdef int shift
    cdef object in_sync
    # link.IN_SYNC
    cdef public unsigned long long served
    # Writes it took that ended on every copy (the tests check that it ran).
    cdef public unsigned long long declined
    # Writes handed to the mirror's Python write before anything happened.

    cdef bint submit(self, unsigned long long offset, bytes data, object reply) except -1
