"""The load test: decode a staged checkpoint in a separate process before it may become valid.

A checkpoint is only worth its name if it loads. Loading it in the training process would
expose training to whatever the file holds (a hostile header claiming a 1 TB tensor, a decoder
crash), so the test runs in a long-lived worker process (``python -m
ckptpilot.validation.loadcheck``) that receives jobs as JSON lines on stdin and answers on
stdout — no pickle crosses the pipe. Each job runs under an address-space limit
(``RLIMIT_AS``) and a wall-clock timeout; a worker that times out or dies is killed and the
checkpoint is reported as failing with the reason.

The worker starts without torch: the default mode reads headers, container indexes and JSON
(``format.safetensors_header``, ``format.container_index``), and a worker that imported torch
would cost every training run that import's CPU seconds beside its first steps and hundreds of
MB of memory. Only decoding (the paranoid mode) needs torch; the parent asks the worker to
import it (``{"prepare": "decoding"}``) before the first such job.

The timeout bounds the load, not the worker's start or its imports, which a busy machine can
make take longer than any load of a sane checkpoint and which say nothing about the
checkpoint. So the worker says ``{"ready": true}`` once it has started, and
``{"prepared": "decoding"}`` once it has imported torch; the parent waits for each under
``start_timeout_seconds`` (a generous bound against a worker that hangs), and only then sends
the job and starts the load's clock.

What the worker checks, in order: every file has the size the manifest says; the safetensors
header is sane (bounded size, offsets inside the file, byte counts matching shape × dtype) or
the codec container's header, trailer and index are; ``state.json`` parses, has the required
fields and refers only to tensors that exist; the model tensors' names, shapes and dtypes equal
the layout of the live model (the consistency check). That reads the headers, not the tensor
bytes: those were hashed as they were written, from the very buffers handed to the file, and
re-reading them right away mostly reads the page cache back. A job with ``reread`` (the
policy's paranoid mode) also re-hashes every file against the manifest (``sha256``) and
decodes every tensor (a container's to the SHA256 of its raw bytes recorded before encoding).

Threading: a ``LoadChecker`` is used by one thread at a time (the pilot's writer thread).
"""

from __future__ import annotations

import json
import logging
import os
import select
import struct
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

log = logging.getLogger("ckptpilot")

_REQUIRED_META = ("format_version", "step", "rank", "world_size", "model_keys", "rng")
_READY = b'{"ready": true}\n'
_PREPARE = b'{"prepare": "decoding"}\n'
_PREPARED = b'{"prepared": "decoding"}\n'

@dataclass(frozen=True)
class LoadCheckResult:
    ok: bool
    reason: str
    seconds: float
    tensors: int = 0


class _StartFailure(Exception):
    """The worker could not be started; the message says why."""


class LoadChecker:
    """Parent side: owns the worker process, restarts it after a timeout or a crash.

    ``timeout_seconds`` bounds one load once the worker is ready; ``start_timeout_seconds``
    bounds starting a worker (see the module docstring).
    """

    def __init__(self, *, timeout_seconds: float = 120.0,
                 memory_margin_bytes: int = 1 << 30,
                 start_timeout_seconds: float = 600.0) -> None:
        self.timeout_seconds = timeout_seconds
        self.start_timeout_seconds = start_timeout_seconds
        self.memory_margin_bytes = memory_margin_bytes
        self._proc: subprocess.Popen[bytes] | None = None
        self._ready = False  # the live worker said it is ready
        self._decoding = False  # the live worker has imported torch
        self._next_id = 0

    def start(self) -> None:
        """Start the worker now without waiting for it, so that it is ready by the first
        save."""
        if self._proc is None or self._proc.poll() is not None:
            self._spawn()

    def check(self, directory: str | os.PathLike[str], manifest: Mapping[str, Any],
              expected_layout: Mapping[str, tuple[str, list[int]]], *,
              sha256: bool = True, reread: bool = True) -> LoadCheckResult:
        """Load-test the checkpoint files in ``directory`` (a local path). ``reread`` (the
        paranoid mode): decode every tensor and, with ``sha256``, first re-hash every file
        against the digests recorded while writing; without, check headers and structure."""
        t0 = time.perf_counter()
        sizes = [int(f["bytes"]) for f in manifest["files"].values()]
        job = {"id": self._next_id, "dir": str(directory), "files": manifest["files"],
               "sha256": sha256 and reread, "decode": reread,
               "expected": {k: [d, list(s)] for k, (d, s) in expected_layout.items()},
               "memory_limit_bytes": sum(sizes) * 2 + self.memory_margin_bytes}
        self._next_id += 1
        try:
            proc = self._worker(decoding=reread)
        except _StartFailure as e:
            return LoadCheckResult(False, str(e), time.perf_counter() - t0)
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(json.dumps(job).encode() + b"\n")
            proc.stdin.flush()
            line = _readline(proc.stdout, self.timeout_seconds)
        except (BrokenPipeError, OSError) as e:
            self._kill()
            return LoadCheckResult(False, f"load-test worker failed: {e}",
                                   time.perf_counter() - t0)
        if line is None:
            self._kill()
            return LoadCheckResult(False, f"load test timed out after {self.timeout_seconds:g} s",
                                   time.perf_counter() - t0)
        if not line:
            code = self._kill()
            return LoadCheckResult(False, f"load-test worker died (exit code {code})",
                                   time.perf_counter() - t0)
        reply = json.loads(line)
        return LoadCheckResult(bool(reply["ok"]), str(reply["reason"]),
                               time.perf_counter() - t0, int(reply.get("tensors", 0)))

    def _spawn(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-c",
             "from ckptpilot.validation.loadcheck import worker_main; worker_main()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None)
        self._ready = False
        self._decoding = False  # it has imported torch

    def _worker(self, *, decoding: bool) -> subprocess.Popen[bytes]:
        """The live worker, started if there is none, and waited for until ready; with
        ``decoding``, also until it has imported torch (see the module docstring)."""
        if not (self._proc is not None and self._proc.poll() is None and self._ready):
            self._start_worker()
        if decoding and not self._decoding:
            self._prepare_decoding()
        assert self._proc is not None
        return self._proc

    def _prepare_decoding(self) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        assert self._proc.stdout is not None
        try:
            self._proc.stdin.write(_PREPARE)
            self._proc.stdin.flush()
            line = _readline(self._proc.stdout, self.start_timeout_seconds)
        except OSError as e:
            self._kill()
            raise _StartFailure(f"load-test worker failed to import torch: {e}") from e
        if line != _PREPARED:
            code = self._kill()
            raise _StartFailure(f"load-test worker did not import torch within "
                                f"{self.start_timeout_seconds:g} s" if line is None else
                                f"load-test worker died importing torch (exit code {code})")
        self._decoding = True

    def _start_worker(self) -> None:
        if self._proc is None or self._proc.poll() is not None:
            self._spawn()
        assert self._proc is not None and self._proc.stdout is not None
        try:
            line = _readline(self._proc.stdout, self.start_timeout_seconds)
        except OSError as e:
            self._kill()
            raise _StartFailure(f"load-test worker failed to start: {e}") from e
        if line is None:
            self._kill()
            raise _StartFailure(f"load-test worker did not start within "
                                f"{self.start_timeout_seconds:g} s")
        if line != _READY:
            code = self._kill()
            raise _StartFailure(f"load-test worker died while starting (exit code {code})"
                                if not line else
                                f"load-test worker started with {line[:200]!r}, not {_READY!r}")
        self._ready = True

    def _kill(self) -> int | None:
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.kill()
        return proc.wait()

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        assert proc.stdin is not None
        try:
            proc.stdin.close()
            proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()


def _readline(stream: IO[bytes], timeout: float) -> bytes | None:
    """One line from the worker, or None on timeout; b"" when the worker closed its end."""
    deadline = time.monotonic() + timeout
    buf = b""
    fd = stream.fileno()
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b""
        buf += chunk
    return buf


# -- worker side -----------------------------------------------------------------------------

class _Failure(Exception):
    pass


def _check_header(path: Path) -> dict[str, Any]:
    from ckptpilot.errors import CheckpointFormatError
    from ckptpilot.format.safetensors_header import MAX_HEADER_BYTES, check_safetensors_header

    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise _Failure(f"{path.name}: shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise _Failure(f"{path.name}: header claims {n} bytes, file has {size}")
        header = json.loads(f.read(n))
    try:
        check_safetensors_header(header, size - 8 - n, path.name)
    except CheckpointFormatError as e:
        raise _Failure(str(e)) from e
    return header


def _run_job(job: Mapping[str, Any]) -> dict[str, Any]:
    directory = Path(job["dir"])
    for fname, rec in job["files"].items():
        size = (directory / fname).stat().st_size
        if size != rec["bytes"]:
            raise _Failure(f"{fname}: {size} bytes, the manifest says {rec['bytes']}")
    for fname, rec in job["files"].items() if job.get("sha256", True) else ():
        _rehash(directory / fname, rec)
    decode = job.get("decode", True)
    if "tensors.ckpt" in job["files"]:
        layout = _load_container(directory / "tensors.ckpt", decode)
    else:
        layout = _load_safetensors(directory / "tensors.safetensors", decode)
    names = list(layout)
    meta = json.loads((directory / "state.json").read_text())
    missing = [k for k in _REQUIRED_META if k not in meta]
    if missing:
        raise _Failure(f"state.json lacks required fields {missing}")
    refs: list[str] = []
    _collect_refs(meta, refs)
    absent = sorted(set(refs) - set(names))
    if absent:
        raise _Failure(f"state.json refers to tensors absent from the file: {absent[:5]}")
    for key in meta["model_keys"]:
        if f"model/{key}" not in layout:
            raise _Failure(f"model/{key}: listed in state.json, absent from the tensors")
    for name, (dtype, shape) in job["expected"].items():
        info = layout.get(name)
        if info is None:
            raise _Failure(f"{name}: the live model has it, the checkpoint does not")
        if info != (dtype, list(shape)):
            raise _Failure(f"{name}: checkpoint has {info[0]} {info[1]}, the live "
                           f"model {dtype} {list(shape)}")
    return {"ok": True, "reason": "ok", "tensors": len(names)}


def _rehash(path: Path, rec: Mapping[str, Any]) -> None:
    """Re-read ``path`` and check it against its manifest record, chunk by chunk (version 2)
    or whole (version 1)."""
    import hashlib

    from ckptpilot.errors import CheckpointFormatError
    from ckptpilot.format.digest import check_chunk, chunk_ranges, is_chunked

    with open(path, "rb") as f:
        if not is_chunked(rec):
            h = hashlib.sha256()
            while chunk := f.read(16 << 20):
                h.update(chunk)
            if h.hexdigest() != rec["sha256"]:
                raise _Failure(f"{path.name}: SHA256 {h.hexdigest()} != written {rec['sha256']}")
            return
        try:
            for begin, end, sha in chunk_ranges(rec, path.name):
                check_chunk(memoryview(f.read(end - begin)), begin, end, sha, path.name)
        except CheckpointFormatError as e:
            raise _Failure(str(e)) from e


def _load_safetensors(path: Path, decode: bool) -> dict[str, tuple[str, list[int]]]:
    """Check the header and, with ``decode``, decode every tensor; returns name ->
    (safetensors dtype, shape)."""
    from safetensors import safe_open  # imported by _load_torch before any limit is set

    header = _check_header(path)
    names = [k for k in header if k != "__metadata__"]
    if decode:
        with safe_open(str(path), framework="pt") as f:
            for name in names:
                f.get_tensor(name)
    return {k: (header[k]["dtype"], list(header[k]["shape"])) for k in names}


def _load_container(path: Path, decode: bool) -> dict[str, tuple[str, list[int]]]:
    """Check the header, trailer and index and, with ``decode``, decode every tensor (blob
    checksums and each tensor's SHA256 are checked on the way)."""
    from ckptpilot.errors import CheckpointFormatError
    from ckptpilot.format.container_index import SAFETENSORS_NAMES, read_layout

    try:
        with open(path, "rb") as f:
            layout = read_layout(f)
            if decode:
                from ckptpilot.codecs.container import read_container

                read_container(f, threads=1)
    except CheckpointFormatError as e:
        raise _Failure(f"{path.name}: {e}") from e
    unstorable = [e.name for e in layout.entries if e.dtype not in SAFETENSORS_NAMES]
    if unstorable:
        raise _Failure(f"{path.name}: {unstorable[0]}: dtype cannot be stored")
    return {e.name: (SAFETENSORS_NAMES[e.dtype], list(e.shape)) for e in layout.entries}


def _collect_refs(value: Any, out: list[str]) -> None:
    if isinstance(value, dict):
        if "__tensor__" in value:
            out.append(value["__tensor__"])
        for v in value.values():
            _collect_refs(v, out)
    elif isinstance(value, list):
        for v in value:
            _collect_refs(v, out)


def _load_torch() -> None:
    """Import what decoding needs (the paranoid mode), before any job's memory limit is set:
    importing torch maps far more address space than a limit leaves."""
    import safetensors.torch  # noqa: F401
    import torch

    from ckptpilot.codecs import container  # noqa: F401
    from ckptpilot.tiers.remote import archive  # noqa: F401

    torch.set_num_threads(1)


def worker_main() -> None:
    """Entry point of the worker process: JSON-line jobs on stdin, replies on stdout."""
    import resource

    from ckptpilot.background import BACKGROUND_NICE
    from ckptpilot.format import container_index, digest, safetensors_header  # noqa: F401

    os.nice(max(0, BACKGROUND_NICE - os.nice(0)))  # the cores are training's first
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    sys.stdout.buffer.write(_READY)
    sys.stdout.flush()
    for line in sys.stdin.buffer:
        job = json.loads(line)
        if "prepare" in job:
            _load_torch()
            sys.stdout.buffer.write(_PREPARED)
            sys.stdout.flush()
            continue
        limit = _vm_size() + int(job["memory_limit_bytes"])
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
        try:
            reply = _run_job(job)
        except _Failure as e:
            reply = {"ok": False, "reason": str(e)}
        except MemoryError:
            reply = {"ok": False, "reason": "load test exceeded its memory bound"}
        except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
            reply = {"ok": False, "reason": f"{type(e).__name__}: {e}"}
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        reply["id"] = job["id"]
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0
