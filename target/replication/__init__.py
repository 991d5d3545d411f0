"""Replicated volumes (issue 13): a namespace mirrored to NVMe-oF replicas, with a persistent
write-intent bitmap and DRBD-style generation identifiers. ``docs/replication.md`` describes it.

The engine talks to every copy (the local file, each replica namespace) through
:class:`target.replication.blockio.BlockIO` only, so it never imports the host library; the
composition root hands it a replica opener.
"""
