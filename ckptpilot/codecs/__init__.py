"""Lossless tensor codecs and the container format (SPEC §5).

Public surface: :func:`get_codec` (``raw``, ``zstd``, ``byteplane``, ``expplane``,
``xor_delta``, ``prefix_index``, ``auto``), the :class:`Codec` interface, :func:`decode_blob` /
:func:`blob_info` for blobs of any codec, and the container functions. Importing this package
registers every codec. Must not: import the pilot, tiers or storage (the data path goes
codecs -> tiers, never back).
"""

from ckptpilot.codecs import (  # noqa: F401  (importing a codec module registers it)
    auto,
    byteplane,
    expplane,
    prefix_index,
    raw,
    xor_delta,
    zstd,
)
from ckptpilot.codecs.base import Codec, CodecParamError
from ckptpilot.codecs.blob import BlobHeader
from ckptpilot.codecs.container import (
    ContainerIndex,
    TensorEntry,
    read_container,
    read_index,
    write_container,
)
from ckptpilot.codecs.registry import (
    UnknownCodecError,
    blob_info,
    codec_names,
    decode_blob,
    get_codec,
    register_codec,
)

__all__ = [
    "BlobHeader",
    "Codec",
    "CodecParamError",
    "ContainerIndex",
    "TensorEntry",
    "UnknownCodecError",
    "blob_info",
    "codec_names",
    "decode_blob",
    "get_codec",
    "read_container",
    "read_index",
    "register_codec",
    "write_container",
]
