"""Every byte layout ckptpilot persists outside the codecs, one module per format.

- ``image.py``: the peer image meta (``IMAGE_FORMAT``, its version the trailing number), the
  JSON beside an arena on the peers;
- ``manifest.py``: the remote archive's manifest (``MANIFEST_FORMAT``, ``MANIFEST_VERSION``);
- ``digest.py``: a file's record in that manifest, the SHA256 of every 8 MiB chunk;
- ``heartbeat_ring.py``: the heartbeat ring file's header and slots (``RING_VERSION``);
- ``ledger_line.py``: one failure-ledger record per line (``LEDGER_VERSION``).

The codec blobs and their container are ``ckptpilot.codecs``'s. Each format has one version
constant and a golden file per version in ``tests/fixtures/`` (``tests/test_format_golden.py``):
a change to the bytes today's code writes is a new version, and old versions stay readable.
These modules encode and decode bytes only; files, sockets and their durability belong to the
storage and tier modules that import them.
"""
