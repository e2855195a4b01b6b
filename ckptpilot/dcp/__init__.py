"""ckptpilot as a ``torch.distributed.checkpoint`` (DCP) storage backend.

``dcp.save(state_dict, storage_writer=Writer(run_dir_or_policy, step=N))`` writes step N of a
run through its remote tier (``tiers.remote.url`` and ``storage_options`` of the policy): every
rank's items are hashed while written (SHA256 per item), each rank's part is recorded in the
run's metadata store (``pending``), and once every rank has written, the coordinator writes
DCP's ``.metadata``, then the commit file last, publishes the directory atomically and marks
the rows ``valid``. ``dcp.load(state_dict, storage_reader=Reader(run_dir_or_policy))`` loads
the newest valid step (or ``step=N``), verifying every item it reads, resharded or not.
``dcp.async_save`` takes the same writer. With codecs off (the default) the directory is a
plain DCP checkpoint: stock ``dcp.load`` with ``FileSystemReader`` reads it too.

Layout: ``{tiers.remote.url}/dcp_step_{N:08d}/`` holds ``__{rank}_0.distcp`` (one file per
rank that has items: ``torch.save`` of each tensor chunk and non-tensor value, as
``FileSystemWriter`` writes them, or codec blobs), ``.metadata`` (DCP's, codecs off only) and
``manifest.json`` (ckptpilot's commit file, ``dcp.format``, which also holds each non-tensor
value as JSON, ``dcp.values``). ckptpilot reads no pickle: not ``.metadata``, not a value's
``torch.save``; those are for stock readers. One metadata row per rank, all pointing at that
directory; ``ckptpilot ls``, ``validate``, ``prune`` and ``recover`` handle them
(``dcp.storage``).

Modules: ``format`` (names, commit file, item encodings; pure), ``values`` (the JSON form of
non-tensor values; pure), ``storage`` (listing, verification and rows of DCP checkpoints on a
tier), ``writer`` and ``reader``.
"""

from ckptpilot.dcp.format import dcp_name, parse_dcp_name
from ckptpilot.dcp.reader import Reader
from ckptpilot.dcp.writer import Writer

__all__ = ["Reader", "Writer", "dcp_name", "parse_dcp_name"]
