"""Compression ratio and per-core throughput of the ckptpilot codecs on real training states.

Issue 5, item 9. Each regime is a real short training run of the demo's byte-level
``CharTransformer`` on the standard library's source text (``ckptpilot.cli.demo.stdlib_text``):

(a) ``adamw``: AdamW (lr 3e-3, weight decay 0.01, one-cycle schedule) from scratch;
(b) ``frozen``: fine-tuning the model trained in (a) with the first ~90 % of its parameters
    (in ``named_parameters`` order: embeddings and the first blocks) frozen
    (``requires_grad=False``) and a fresh AdamW on the rest;
(c) ``sgd``: SGD with momentum 0.9, no weight decay, from scratch;
(d) ``bf16``: bf16 copies of the weights of (a) (the moments of a bf16 run stay fp32: see (a)).

Every regime trains ``--warmup`` steps, then snapshots the state at steps s, s+1, s+25 and
s+100. A "tensor class" is all tensors of one kind (weights, exp_avg, exp_avg_sq, or SGD's
momentum_buffer) flattened and concatenated into one tensor, so that throughput is measured on
megabytes, not on the model's many small tensors. Per class and codec:

- ratio = raw bytes / encoded bytes. Delta codecs (``xor_delta``, ``auto`` given a base, and
  the XOR baseline) encode the snapshot at s+k against the snapshot at s (columns Δ1, Δ25,
  Δ100); the others encode the snapshot at s+25 (one value, in the Δ25 column);
- encode and decode MB/s per core: codecs built with ``threads=1``, best of ``--repeats``
  timed runs on the s+25 snapshot (against s for delta codecs); MB = 1e6 raw bytes. Encode
  is ``encode_parts`` (the blob as buffers, what the container writer streams); column
  "encode() joined" is ``encode``, which also copies the parts into one ``bytes``;
- ``byteplane@50MB/s`` and ``xor_delta@50MB/s``: the codecs as ``auto`` and the pulse writer
  build them for a 50 MB/s tier (``min_plane_ratio = paying_plane_ratio(50e6)``, ~1.04: the
  mantissa-like planes of deltas, ratio 1.09-1.12, are coded too; the default, 1.2, leaves
  them raw);
- baselines in the same run, on the same bytes: zstd level 3 on the raw bytes
  (``zstd-3``), byte-shuffle + zstd-3 (NumPy view ``(n, itemsize)``, ``.T`` copy, then
  zstd-3) and, for the delta columns, the same byte shuffle of the XOR delta
  (``xor+shuffle+zstd-3``). Every decode is checked bit for bit. Column "vs baseline":
  the codec's Δ25 ratio over the best non-delta baseline (delta codecs: over
  ``xor+shuffle+zstd-3``).

Then, per regime (not (d)), the end-to-end time of the pilot's pulse write of the state at
s+25: ``stage_organ`` with a codec container (container, state.json and manifest written and
``os.fsync``'ed), the codecs chosen by the pilot's ``CodecSelector`` (policy defaults: weights
``xor_delta``, which without a base — a self-contained pulse — is ``byteplane``; the rest
``auto``, its choice per tensor remembered between saves) vs every tensor ``raw``, and the
organ layout (safetensors) for reference; codecs with their default threads (all cores).
Three cases: the pilot's tensors (one per parameter and class) to this disk with ``auto``
told the policy default of 2 GB/s; one flat tensor per class (the tensor sizes of a large
model) likewise; and one tensor per class to a tier whose writes are throttled to 250 MB/s
(``auto`` told so) — an object store or a busy NFS, where compression is meant to pay. The
first ``auto`` save, which pays the trials, is reported on its own; then medians over
max(9, ``--repeats``) saves each, interleaved in rotating order. Like the pilot, ``auto``
writes the plain safetensors layout when the codecs would save less transfer time than the
container's extra hash pass costs. A container is read back once and checked bit for bit.

Versus zipnn and blosc2 (issue 15; ``--versus`` runs this section alone, the default run ends
with it): one process, everything single-threaded (``torch.set_num_threads(1)``, our codecs
with ``threads=1``, zipnn ``threads=1``, blosc2 ``nthreads=1``), on the flattened weights and
AdamW ``exp_avg`` / ``exp_avg_sq`` of an MLP of 4 x ``Linear(1024, 1024)`` (16.8 MB per class in
fp32) trained ``--versus-steps`` steps on a synthetic regression, and their bf16 copies (8.4 MB).
Per class and method: ratio, ratio and decode speed over zipnn's, encode and decode MB/s from
the median process CPU time of ``--versus-repeats`` rounds (the methods interleaved in each
round, so load on a shared box falls on all of them alike; CPU time, because wall time on a
busy box measures the other processes too), and the best wall-clock time of the same rounds
(how the per-core figures of the regimes above were taken). Every decode is checked bit for
bit. Our encode is ``encode_parts`` (what the container streams); zipnn's ``compress``
overwrites its input, so it is given a fresh copy, made outside the timed call. A library that
is not installed (``pip install zipnn blosc2``; benchmark-only, not dependencies) has no rows
and the table says so.

Usage: ``.venv/bin/python bench/codecs.py [--quick] [--dim 256 --layers 4] [--dir DIR]``
(``--quick``: the demo-size model, 128 x 2, and fewer warm-up steps);
``.venv/bin/python bench/codecs.py --versus`` for the comparison alone.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.metadata
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import zstandard
from scratch import DEFAULT_DIR, REPO, scratch_dir

try:
    from compression import zstd as stdzstd  # type: ignore[import-not-found]  # Python 3.14+
except ImportError:
    from backports import zstd as stdzstd

from ckptpilot.capture.state import Snapshot
from ckptpilot.cli.demo import CONTEXT, CharTransformer, DemoJob, stdlib_text
from ckptpilot.codecs import (
    Codec,
    blob_info,
    byteplane,
    codec_names,
    decode_blob,
    get_codec,
    read_container,
    write_container,
)
from ckptpilot.codecs.byteplane import paying_plane_ratio
from ckptpilot.codecs.entropy import compressor, decompress_into, literal_compressor
from ckptpilot.codecs.selector import CodecSelector
from ckptpilot.sampler import ResumableSampler
from ckptpilot.tiers.remote.archive import StagedArchive, stage_organ
from ckptpilot.tiers.remote.store import HashingWriter, RemoteTier

DELTAS = (1, 25, 100)
CODECS = ("raw", "zstd", "byteplane", "xor_delta", "prefix_index", "auto", "byteplane@50MB/s",
          "xor_delta@50MB/s")
SLOW_TIER = 50e6  # the "@50MB/s" variants code the planes that pay at this bandwidth
BASELINES = ("zstd-3", "shuffle+zstd-3", "xor+shuffle+zstd-3")
DELTA_METHODS = {"xor_delta", "xor_delta@50MB/s", "auto", "xor+shuffle+zstd-3"}
FROZEN_FRACTION = 0.9
# Goals of issue 5 (ratios measured there on a 7.3 M-parameter transformer).
GOAL_RATIOS = {"weights": ("xor_delta", 1.35), "exp_avg": ("byteplane", 1.17),
               "exp_avg_sq": ("xor_delta", 1.29)}
GOAL_ENCODE_MBS, GOAL_DECODE_MBS, GOAL_FROZEN = 2000.0, 3000.0, 8.0

Snapshots = dict[int, dict[str, dict[str, torch.Tensor]]]  # step -> class -> name -> tensor


# -- training -------------------------------------------------------------------------------

def make_job(text: torch.Tensor, dim: int, layers: int, steps: int,
             opt_kind: str, model: CharTransformer | None = None) -> DemoJob:
    """A seeded demo job with a model of ``dim`` x ``layers`` and the given optimizer."""
    torch.manual_seed(0)
    if model is None:
        model = CharTransformer(dim=dim, layers=layers)
    params = [p for p in model.parameters() if p.requires_grad]
    if opt_kind == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(params, lr=0.05, momentum=0.9,
                                                     weight_decay=0.0)
        lr = 0.05
    else:
        opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)
        lr = 3e-3
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps,
                                                pct_start=0.1)
    return DemoJob(text, ResumableSampler(len(text) - CONTEXT - 1, seed=0), model, opt, sched,
                   torch.arange(CONTEXT + 1))


def capture(job: DemoJob) -> dict[str, dict[str, torch.Tensor]]:
    """Copies of the weights and every optimizer state tensor, by class and parameter name."""
    names = {id(p): n for n, p in job.model.named_parameters()}
    out: dict[str, dict[str, torch.Tensor]] = {"weights": {}}
    for name, p in job.model.named_parameters():
        out["weights"][name] = p.detach().clone()
    for p, state in job.opt.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.numel() > 1:
                out.setdefault(key, {})[names[id(p)]] = value.detach().clone()
    return out


def train(job: DemoJob, warmup: int) -> tuple[Snapshots, list[float], float]:
    """Train ``warmup + 100`` steps; snapshots at warmup + 0/1/25/100. Returns losses too."""
    wanted = {warmup + k for k in (0, *DELTAS)}
    snaps: Snapshots = {}
    losses = []
    start = time.perf_counter()
    for step in range(1, warmup + max(DELTAS) + 1):
        loss, _ = job.train_step()
        losses.append(loss.item())
        if step in wanted:
            snaps[step] = capture(job)
    return snaps, losses, time.perf_counter() - start


# -- measurement ----------------------------------------------------------------------------

def flat(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors.values()])


def shuffle(arr: np.ndarray, itemsize: int) -> np.ndarray:
    return np.ascontiguousarray(arr.reshape(-1, itemsize).T)


def unshuffle(arr: np.ndarray, itemsize: int) -> np.ndarray:
    return np.ascontiguousarray(arr.reshape(itemsize, -1).T).reshape(-1)


def as_bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def best_time(fn: Callable[[], object], repeats: int) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


@dataclass
class Row:
    cls: str
    method: str
    ratios: dict[int, float] = field(default_factory=dict)
    encode_mbs: float = 0.0
    decode_mbs: float = 0.0
    joined_mbs: float | None = None
    note: str = ""


def baseline_encode(method: str, data: np.ndarray, base: np.ndarray | None,
                    itemsize: int) -> bytes:
    zc = zstandard.ZstdCompressor(level=3)
    if method == "zstd-3":
        return zc.compress(data)
    if method == "shuffle+zstd-3":
        return zc.compress(shuffle(data, itemsize))
    assert base is not None
    delta = np.bitwise_xor(data, base)
    return zc.compress(shuffle(delta, itemsize))


def baseline_decode(method: str, blob: bytes, base: np.ndarray | None,
                    itemsize: int) -> np.ndarray:
    raw = np.frombuffer(zstandard.ZstdDecompressor().decompress(blob), np.uint8)
    if method == "zstd-3":
        return raw
    out = unshuffle(raw, itemsize)
    if method == "shuffle+zstd-3":
        return out
    assert base is not None
    return np.bitwise_xor(out, base)


PLANE_CODERS = {  # what one byte plane can go through; literals and matches are byteplane's
    "literals": literal_compressor,
    "matches": lambda: compressor(1),
    "zstd-1": lambda: zstandard.ZstdCompressor(level=1),
    "zstd-3": lambda: zstandard.ZstdCompressor(level=3),
    "zstd--1": lambda: zstandard.ZstdCompressor(level=-1),
}


def plane_table(state0: dict[str, torch.Tensor], state25: dict[str, torch.Tensor],
                repeats: int) -> str:
    """Ratio and encode/decode GB/s (per plane byte, one core) of each plane coder on the
    top two byte planes of every class, plain (s+25) and as the XOR delta against s."""
    lines = ["| class | plane | " + " | ".join(PLANE_CODERS) + " |",
             "|---|---|" + "---:|" * len(PLANE_CODERS)]
    chunk = byteplane.CHUNK_BYTES // 4
    for cls, now in state25.items():
        then = state0[cls]
        itemsize = now.element_size()
        plain = as_bytes(now).reshape(-1, itemsize)
        delta = plain ^ as_bytes(then).reshape(-1, itemsize)
        for kind, words in (("plain", plain), ("XOR Δ25", delta)):
            for p in (itemsize - 1, itemsize - 2):
                data = np.ascontiguousarray(words[:, p])
                cells = []
                for make in PLANE_CODERS.values():
                    coder = make()
                    chunks = [data[i:i + chunk] for i in range(0, data.size, chunk)]
                    enc_s, frames = best_time(lambda c=coder, ch=chunks: [c.compress(x)
                                                                          for x in ch], repeats)
                    out = np.empty(chunk, np.uint8)
                    dec_s, _ = best_time(lambda fr=frames, o=out, ch=chunks: [
                        decompress_into(f, o[:len(x)], "plane")
                        for f, x in zip(fr, ch, strict=True)], repeats)
                    ratio = data.size / sum(len(f) for f in frames)
                    cells.append(f"{ratio:.2f} @ {data.size / enc_s / 1e9:.2f}/"
                                 f"{data.size / dec_s / 1e9:.2f}")
                lines.append(f"| {cls} | {kind} plane {p} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def measure_class(cls: str, series: dict[int, torch.Tensor], s: int, repeats: int,
                  auto_bw: float) -> list[Row]:
    """Ratios and per-core throughput of every codec and baseline on one tensor class."""
    base_t, target_t = series[s], series[s + 25]
    nbytes = target_t.numel() * target_t.element_size()
    itemsize = target_t.element_size()
    rows = []
    for method in CODECS + BASELINES:
        delta = method in DELTA_METHODS
        row = Row(cls, method)
        if method in CODECS:
            name, _, tier = method.partition("@")
            params: dict[str, object] = {} if method == "raw" else {"threads": 1}
            if method == "auto":
                params["bandwidth_bytes_per_s"] = auto_bw
            if tier:
                params["min_plane_ratio"] = paying_plane_ratio(SLOW_TIER)
            codec = get_codec(name, **params)
            for k in DELTAS if delta else (25,):
                blob = codec.encode(series[s + k], series[s] if delta else None)
                row.ratios[k] = nbytes / len(blob)
                if method == "auto":
                    row.note += f"{'' if not row.note else ', '}Δ{k}: {blob_info(blob).codec}"
                back = decode_blob(blob, series[s] if delta else None, threads=1)
                if not np.array_equal(as_bytes(back), as_bytes(series[s + k])):
                    raise AssertionError(f"{cls} {method} Δ{k}: decode is not bit-exact")
            enc_s, _ = best_time(lambda c=codec, d=delta: c.encode_parts(
                target_t, base_t if d else None), repeats)
            joined_s, blob = best_time(lambda c=codec, d=delta: c.encode(
                target_t, base_t if d else None), repeats)
            row.joined_mbs = nbytes / joined_s / 1e6
            dec_s, _ = best_time(lambda b=blob, d=delta: decode_blob(
                b, base_t if d else None, threads=1), repeats)
        else:
            base_np = as_bytes(base_t)
            for k in DELTAS if delta else (25,):
                data = as_bytes(series[s + k])
                blob = baseline_encode(method, data, base_np, itemsize)
                row.ratios[k] = nbytes / len(blob)
                back = baseline_decode(method, blob, base_np, itemsize)
                if not np.array_equal(back, data):
                    raise AssertionError(f"{cls} {method} Δ{k}: decode is not bit-exact")
            data = as_bytes(target_t)
            enc_s, blob = best_time(lambda m=method, d=data, b=base_np: baseline_encode(
                m, d, b, itemsize), repeats)
            dec_s, _ = best_time(lambda m=method, e=blob, b=base_np: baseline_decode(
                m, e, b, itemsize), repeats)
        row.encode_mbs = nbytes / enc_s / 1e6
        row.decode_mbs = nbytes / dec_s / 1e6
        rows.append(row)
    return rows


@dataclass
class EndToEnd:
    raw_s: float
    auto_s: float
    organ_s: float
    first_auto_s: float
    raw_bytes: int
    auto_bytes: int
    bandwidth: float
    auto_codecs: dict[str, int]


class SlowTier(RemoteTier):
    """A local directory whose writes are held to ``bandwidth`` bytes/s: a stand-in for an
    object store or a busy NFS, where compression is meant to pay."""

    def __init__(self, url: str, bandwidth: float) -> None:
        super().__init__(url)
        self.bandwidth = bandwidth

    @contextmanager
    def open_write(self, relpath: str) -> Iterator[HashingWriter]:
        with super().open_write(relpath) as out:
            start, write = time.perf_counter(), out.write

            def throttled(data: bytes | memoryview) -> int:
                n = write(data)
                ahead = out.size / self.bandwidth - (time.perf_counter() - start)
                if ahead > 0:
                    time.sleep(ahead)
                return n
            out.write = throttled  # type: ignore[method-assign]
            yield out


def end_to_end(tensors: dict[str, torch.Tensor], step: int, tier: RemoteTier,
               bandwidth: float, repeats: int) -> EndToEnd:
    """The pilot's pulse write of one state (``stage_organ`` with a codec container: encode +
    write + fsync of the container, state.json and manifest), ``auto`` through the pilot's
    ``CodecSelector`` given ``bandwidth`` vs every tensor ``raw``; plus the organ layout."""
    snapshot = Snapshot(step=step, tensors=tensors,
                        meta={"step": step, "rank": 0, "world_size": 1})
    raw = get_codec("raw")

    def save(codec_for: object) -> tuple[float, StagedArchive]:
        os.sync()
        start = time.perf_counter()
        staged = stage_organ(tier, snapshot, level="pulse", codec_for=codec_for)  # type: ignore[arg-type]
        seconds = time.perf_counter() - start
        tier.remove(staged.staging)
        return seconds, staged

    save(lambda n, x: (raw, None))  # warm-up, untimed
    selector = CodecSelector({"weights": "xor_delta", "optimizer": "auto", "other": "auto"},
                             bandwidth_bytes_per_s=bandwidth)
    selector.new_save()
    first_auto_s, auto_staged = save(selector.codec_for)  # the first pulse pays the trials
    raw_times, auto_times, organ_times = [], [], []
    for i in range(3 * repeats):  # interleaved, order rotating
        kind = (i + i // 3) % 3
        if kind == 0:
            t, staged = save(lambda n, x: (raw, None))
            raw_times.append(t)
        elif kind == 1:  # as the pilot does: the plain layout when the codecs do not pay
            selector.new_save()
            t, auto_staged = save(None if selector.plain_pays(tensors) else selector.codec_for)
            auto_times.append(t)
        else:
            t, _ = save(None)
            organ_times.append(t)
    check = RemoteTier(tier.url)
    name = check.new_staging("check")
    with check.open_write(f"{name}/c") as out:
        write_container(out, tensors, snapshot.meta, selector.codec_for)
    with check.open_read(f"{name}/c") as f:
        back, _ = read_container(f)
    check.remove(name)
    for key, tensor in tensors.items():
        if not np.array_equal(as_bytes(back[key]), as_bytes(tensor)):
            raise AssertionError(f"container round trip of {key} is not bit-exact")
    assert staged.index is not None
    chosen: dict[str, int] = {}
    for codec_id in selector.choices().values():
        chosen[codec_id] = chosen.get(codec_id, 0) + 1
    if auto_staged.index is None:
        chosen["(so written as safetensors)"] = 1
    return EndToEnd(statistics.median(raw_times), statistics.median(auto_times),
                    statistics.median(organ_times), first_auto_s, staged.bytes,
                    auto_staged.bytes, bandwidth, chosen)


def pilot_state(state: dict[str, dict[str, torch.Tensor]], flat_classes: bool
                ) -> dict[str, torch.Tensor]:
    """The state as the pilot names it (model/..., optimizer/...): one tensor per parameter
    and class, or with ``flat_classes`` one tensor per class (the sizes of a big model's
    parameters: tens of MB each)."""
    tensors: dict[str, torch.Tensor] = {}
    for cls, group in state.items():
        if cls == "frozen weights":  # (b): a subset of the weights, not more tensors
            continue
        family = "model" if cls == "weights" else "optimizer"
        if flat_classes:
            tensors[f"{family}/{cls}"] = flat(group)
        else:
            tensors.update({f"{family}/{cls}/{name}": t.contiguous() for name, t in group.items()})
    return tensors


E2E_CASES = (  # (label, flat classes?, tier bandwidth in bytes/s or None = this disk)
    ("per-parameter tensors, local disk, auto told 2 GB/s (the policy default)", False, None),
    ("one tensor per class, local disk, auto told 2 GB/s", True, None),
    ("one tensor per class, a 250 MB/s tier (throttled writes)", True, 250e6),
)


def end_to_end_cases(snaps: Snapshots, s: int, workdir: Path, repeats: int
                     ) -> list[tuple[str, EndToEnd]]:
    out = []
    for label, flat_classes, slow in E2E_CASES:
        tensors = pilot_state(snaps[s + 25], flat_classes)
        tier = (RemoteTier(str(workdir / "e2e")) if slow is None
                else SlowTier(str(workdir / "e2e-slow"), slow))
        out.append((label, end_to_end(tensors, s + 25, tier, slow or 2e9, repeats)))
    return out


# -- versus zipnn and blosc2 (issue 15) -----------------------------------------------------

VERSUS_WIDTH, VERSUS_LAYERS = 1024, 4
OURS = ("byteplane", "expplane", "prefix_index", "zstd")  # ours that apply to float tensors
PLAIN_ZSTD_LEVELS = (1, 3)


def versus_state(steps: int) -> dict[str, torch.Tensor]:
    """Weights, ``exp_avg`` and ``exp_avg_sq`` (each flattened into one tensor) of a seeded MLP
    after ``steps`` AdamW steps on a synthetic regression (targets from a random teacher)."""
    torch.manual_seed(0)

    def mlp() -> torch.nn.Sequential:
        layers: list[torch.nn.Module] = []
        for i in range(VERSUS_LAYERS):
            layers.append(torch.nn.Linear(VERSUS_WIDTH, VERSUS_WIDTH))
            if i < VERSUS_LAYERS - 1:
                layers.append(torch.nn.GELU())
        return torch.nn.Sequential(*layers)

    model, teacher = mlp(), mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    for _ in range(steps):
        x = torch.randn(64, VERSUS_WIDTH)
        with torch.no_grad():
            y = teacher(x)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    params = list(model.parameters())
    state = {"weights": torch.cat([p.detach().reshape(-1) for p in params])}
    for key in ("exp_avg", "exp_avg_sq"):
        state[key] = torch.cat([opt.state[p][key].reshape(-1) for p in params])
    return state


@dataclass
class Method:
    """One way to compress a tensor: ``encode(t) -> blob``, ``decode(blob) -> raw bytes``."""

    name: str
    encode: Callable[[torch.Tensor], object]
    decode: Callable[[object], np.ndarray]
    size: Callable[[object], int]
    prepare: Callable[[torch.Tensor], torch.Tensor] = lambda t: t  # untimed, before encode
    stored: Callable[[object], object] = lambda blob: blob  # untimed: what decode is given


def _optional(module: str) -> tuple[object | None, str]:
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        return None, f"{module} not installed ({exc.__class__.__name__}); no {module} rows"
    return mod, f"{module} {importlib.metadata.version(module)}"


def _ours(name: str) -> Method:
    codec: Codec = get_codec(name, threads=1)
    return Method(
        name, codec.encode_parts,
        lambda blob: as_bytes(codec.decode(blob)),  # type: ignore[arg-type]
        lambda blob: len(memoryview(blob)),  # type: ignore[arg-type]
        stored=b"".join,  # type: ignore[arg-type]
    )


def versus_methods(itemsize: int) -> tuple[list[Method], list[str]]:
    """Our float codecs that are registered, then every baseline whose library is installed."""
    methods = [_ours(name) for name in OURS if name in codec_names()]
    notes = []
    zipnn, note = _optional("zipnn")
    notes.append(note)
    if zipnn is not None:
        def zipnn_encode(t: torch.Tensor) -> bytes:
            return zipnn.ZipNN(input_format="torch", threads=1).compress(t)  # type: ignore[attr-defined]

        def zipnn_decode(blob: object) -> np.ndarray:
            return as_bytes(zipnn.ZipNN(input_format="torch", threads=1).decompress(blob))  # type: ignore[attr-defined]

        methods.append(Method("zipnn", zipnn_encode, zipnn_decode, len,  # type: ignore[arg-type]
                              prepare=lambda t: t.clone()))  # compress overwrites its input
    blosc2, note = _optional("blosc2")
    notes.append(note)
    if blosc2 is not None:
        b2 = blosc2
        for codec, clevel in ((b2.Codec.LZ4, 5), (b2.Codec.ZSTD, 1)):  # type: ignore[attr-defined]
            cparams = b2.CParams(codec=codec, clevel=clevel, typesize=itemsize, nthreads=1,  # type: ignore[attr-defined]
                                 filters=[b2.Filter.BITSHUFFLE], filters_meta=[0])  # type: ignore[attr-defined]
            dparams = b2.DParams(nthreads=1)  # type: ignore[attr-defined]
            methods.append(Method(
                f"blosc2 bitshuffle+{codec.name.lower()}-{clevel}",
                lambda t, c=cparams: b2.compress2(as_bytes(t), cparams=c),  # type: ignore[attr-defined]
                lambda blob, d=dparams: np.frombuffer(b2.decompress2(blob, dparams=d), np.uint8),  # type: ignore[attr-defined]
                len))  # type: ignore[arg-type]
    for level in PLAIN_ZSTD_LEVELS:
        methods.append(Method(
            f"plain zstd -{level}",
            lambda t, lv=level: zstandard.ZstdCompressor(level=lv).compress(as_bytes(t)),
            lambda blob: np.frombuffer(zstandard.ZstdDecompressor().decompress(blob), np.uint8),  # type: ignore[arg-type]
            len))  # type: ignore[arg-type]
    return methods, notes


@dataclass
class VersusRow:
    name: str
    ratio: float
    encode_cpu: list[float] = field(default_factory=list)
    decode_cpu: list[float] = field(default_factory=list)
    encode_wall: list[float] = field(default_factory=list)
    decode_wall: list[float] = field(default_factory=list)


def _timed(fn: Callable[[], object]) -> tuple[float, float, object]:
    """(CPU seconds of this process, wall seconds, result) of one call."""
    cpu, wall = time.process_time(), time.perf_counter()
    result = fn()
    return time.process_time() - cpu, time.perf_counter() - wall, result


def versus_class(tensor: torch.Tensor, methods: list[Method], repeats: int) -> list[VersusRow]:
    """Ratios and timings of every method on one tensor; rounds interleave the methods."""
    expected = as_bytes(tensor)
    blobs, rows = {}, []
    for m in methods:
        blob = m.stored(m.encode(m.prepare(tensor)))
        if not np.array_equal(m.decode(blob), expected):
            raise AssertionError(f"{m.name}: decode is not bit-exact")
        blobs[m.name] = blob
        rows.append(VersusRow(m.name, expected.size / m.size(blob)))
    for _ in range(repeats):
        for m, row in zip(methods, rows, strict=True):
            data = m.prepare(tensor)
            cpu, wall, _ = _timed(lambda m=m, d=data: m.encode(d))
            row.encode_cpu.append(cpu)
            row.encode_wall.append(wall)
            cpu, wall, _ = _timed(lambda m=m: m.decode(blobs[m.name]))
            row.decode_cpu.append(cpu)
            row.decode_wall.append(wall)
    return rows


VERSUS_HEADER = ("| class | method | ratio | ratio vs zipnn | encode MB/s | decode MB/s "
                 "| decode vs zipnn | encode / decode MB/s, best wall |\n"
                 "|---|---|---:|---:|---:|---:|---:|---:|")


def versus_rows(cls: str, nbytes: int, rows: list[VersusRow]) -> str:
    """Table rows of one class; ratio and decode speed relative to zipnn's in the same run."""
    ref = next((r for r in rows if r.name == "zipnn"), None)

    def mbs(seconds: float) -> str:
        return f"{nbytes / seconds / 1e6:,.0f}"

    lines = []
    for r in rows:
        enc, dec = statistics.median(r.encode_cpu), statistics.median(r.decode_cpu)
        vs_ratio = vs_dec = "–"
        if ref is not None:
            vs_ratio = f"{r.ratio / ref.ratio:.3f}x"
            vs_dec = f"{statistics.median(ref.decode_cpu) / dec:.2f}x"
        lines.append(f"| {cls} | {r.name} | {r.ratio:.4f} | {vs_ratio} | {mbs(enc)} | {mbs(dec)} "
                     f"| {vs_dec} | {mbs(min(r.encode_wall))} / {mbs(min(r.decode_wall))} |")
    return "\n".join(lines)


def git_head() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                          capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "ckptpilot/codecs"],
                           cwd=REPO, capture_output=True, text=True)
    changed = ", ".join(line[3:] for line in dirty.stdout.splitlines()) or "none"
    return f"git HEAD {done.stdout.strip() or '?'}; uncommitted in ckptpilot/codecs: {changed}"


def versus(steps: int, repeats: int) -> None:
    """The comparison with zipnn and blosc2, single-threaded, printed as one table."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        print(f"\n## versus zipnn and blosc2 (issue 15)\n\n{git_head()}; load average at start "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        state = versus_state(steps)
        _, notes = versus_methods(4)
        print(f"libraries: {'; '.join(notes)}; zstandard {zstandard.__version__}; numpy "
              f"{np.__version__}")
        print(f"MLP {VERSUS_LAYERS} x Linear({VERSUS_WIDTH}, {VERSUS_WIDTH}), "
              f"{state['weights'].numel():,} params, {steps} AdamW steps; single-threaded: torch "
              "threads 1, our codecs threads=1, zipnn threads=1, blosc2 nthreads=1; MB/s = 1e6 "
              f"raw bytes per second of process CPU time, median of {repeats} interleaved rounds; "
              "best wall = the fastest wall-clock round\n")
        print(VERSUS_HEADER)
        for dtype in (torch.float32, torch.bfloat16):
            methods, _ = versus_methods(dtype.itemsize)
            for cls, tensor in state.items():
                t = tensor.to(dtype).contiguous()
                nbytes = t.numel() * t.element_size()
                label = f"{cls} {str(dtype).removeprefix('torch.')} ({nbytes / 1e6:.1f} MB)"
                print(versus_rows(label, nbytes, versus_class(t, methods, repeats)))
        print(f"\nload average at end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    finally:
        torch.set_num_threads(threads)


# -- output ---------------------------------------------------------------------------------

def best_baseline(rows: list[Row], cls: str, k: int,
                  delta: bool | None = None) -> tuple[str, float]:
    """The best baseline ratio at Δk: of all, or only the delta (non-delta) ones."""
    cands = [(r.method, r.ratios[k]) for r in rows
             if r.cls == cls and r.method in BASELINES and k in r.ratios
             and (delta is None or (r.method in DELTA_METHODS) == delta)]
    return max(cands, key=lambda c: c[1])


def e2e_table(cases: list[tuple[str, EndToEnd]]) -> str:
    lines = ["| case | raw ms (MB) | auto ms (MB) | auto/raw | first auto ms | organ ms "
             "| auto chose |", "|---|---|---|---|---|---|---|"]
    for label, e in cases:
        chose = ", ".join(f"{k} {v}" for k, v in sorted(e.auto_codecs.items()))
        lines.append(f"| {label} | {e.raw_s * 1e3:.1f} ({e.raw_bytes / 1e6:.2f}) | "
                     f"{e.auto_s * 1e3:.1f} ({e.auto_bytes / 1e6:.2f}) | "
                     f"{e.auto_s / e.raw_s:.2f}x | {e.first_auto_s * 1e3:.1f} | "
                     f"{e.organ_s * 1e3:.1f} | {chose} |")
    return "\n".join(lines)


def table(rows: list[Row]) -> str:
    out = ["| class | codec | ratio Δ1 | ratio Δ25 | ratio Δ100 | vs baseline (Δ25) "
           "| encode MB/s/core | decode MB/s/core | encode() joined MB/s | note |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        cells = [f"{r.ratios[k]:.3f}" if k in r.ratios else "–" for k in DELTAS]
        _, best = best_baseline(rows, r.cls, 25, r.method in DELTA_METHODS)
        rel = f"{r.ratios[25] / best:.3f}x" if r.method in CODECS else "–"
        method = f"*{r.method}*" if r.method in BASELINES else r.method
        out.append(f"| {r.cls} | {method} | {' | '.join(cells)} | {rel} | "
                   f"{r.encode_mbs:,.0f} | {r.decode_mbs:,.0f} | "
                   f"{'–' if r.joined_mbs is None else f'{r.joined_mbs:,.0f}'} | {r.note} |")
    return "\n".join(out)


def row(rows: list[Row], cls: str, method: str) -> Row:
    return next(r for r in rows if r.cls == cls and r.method == method)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="demo-size model (128 x 2) and 40 warm-up steps")
    p.add_argument("--dim", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    p.add_argument("--versus", action="store_true",
                   help="only the single-threaded comparison with zipnn and blosc2")
    p.add_argument("--versus-steps", type=int, default=50)
    p.add_argument("--versus-repeats", type=int, default=9)
    a = p.parse_args()
    if a.versus:
        print(f"command: {shlex.join([sys.executable.replace(str(REPO) + '/', ''), *sys.argv])}")
        print(f"date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}")
        print(f"torch {torch.__version__}, python {platform.python_version()}, "
              f"{os.cpu_count()} CPUs, {platform.processor() or platform.machine()}")
        versus(a.versus_steps, a.versus_repeats)
        return
    dim = a.dim or (128 if a.quick else 256)
    layers = a.layers or (2 if a.quick else 4)
    warmup = a.warmup or (40 if a.quick else 60)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    t_start = time.perf_counter()
    print(f"command: {shlex.join([sys.executable.replace(str(REPO) + '/', ''), *sys.argv])}")
    print(f"date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}")
    print(f"torch {torch.__version__}, python {platform.python_version()}, zstandard "
          f"{zstandard.__version__} (libzstd {zstandard.ZSTD_VERSION}), "
          f"{stdzstd.__name__} (libzstd {stdzstd.zstd_version_info}), "
          f"{os.cpu_count()} CPUs (torch threads "
          f"{torch.get_num_threads()}), {platform.processor() or platform.machine()}")
    with scratch_dir(a.dir, "codecs-") as workdir:
        print(f"disk dir: {workdir}")
        text = stdlib_text()
        n_params = sum(p.numel() for p in CharTransformer(dim=dim, layers=layers).parameters())
        print(f"model: CharTransformer(dim={dim}, layers={layers}), {n_params:,} params "
              f"({n_params * 4 / 1e6:.1f} MB fp32 per tensor class); batch 32 x context {CONTEXT}; "
              f"snapshots at s = warmup ({warmup}) and s+1, s+25, s+100")
        print("ratio = raw bytes / encoded bytes; MB/s per core = 1e6 raw bytes per second, codecs "
              f"with threads=1, best of {a.repeats}; auto is told 2 GB/s")
        total = warmup + max(DELTAS)
        regimes: dict[str, tuple[Snapshots, str]] = {}

        job = make_job(text, dim, layers, total, "adamw")
        snaps, losses, secs = train(job, warmup)
        regimes["(a) AdamW full training"] = (snaps, f"loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
                                              f"{total} steps in {secs:.1f} s")
        trained = job.model

        bf16: Snapshots = {step: {"weights": {n: t.to(torch.bfloat16) for n, t in
                                              st["weights"].items()}} for step, st in snaps.items()}
        # (b) fine-tune from (a)'s end with the first ~90 % of the parameters frozen.
        frozen_names, seen = set(), 0
        for name, param in trained.named_parameters():
            if seen + param.numel() <= FROZEN_FRACTION * n_params:
                param.requires_grad_(False)
                frozen_names.add(name)
                seen += param.numel()
        ft = make_job(text, dim, layers, total, "adamw", model=trained)
        ft.sampler = ResumableSampler(len(text) - CONTEXT - 1, seed=1)
        snaps_b, losses_b, secs_b = train(ft, warmup)
        frozen_note = (f"{seen / n_params:.1%} of the params frozen ({len(frozen_names)} tensors: "
                       f"embeddings + first blocks); loss {losses_b[0]:.3f} -> {losses_b[-1]:.3f}, "
                       f"{total} steps in {secs_b:.1f} s")
        for st in snaps_b.values():
            st["frozen weights"] = {n: t for n, t in st["weights"].items() if n in frozen_names}
        regimes["(b) fine-tuning, ~90 % frozen"] = (snaps_b, frozen_note)

        sgd = make_job(text, dim, layers, total, "sgd")
        snaps_c, losses_c, secs_c = train(sgd, warmup)
        regimes["(c) SGD + momentum 0.9, no weight decay"] = (
            snaps_c, f"lr 0.05 one-cycle; loss {losses_c[0]:.3f} -> {losses_c[-1]:.3f}, "
            f"{total} steps in {secs_c:.1f} s")
        regimes["(d) bf16 weights (bf16 copies of (a)'s weights)"] = (bf16, "same steps as (a)")

        results: dict[str, tuple[list[Row], list[tuple[str, EndToEnd]]]] = {}
        for title, (rsnaps, note) in regimes.items():
            e2e = []
            if not title.startswith("(d)"):
                e2e = end_to_end_cases(rsnaps, warmup, workdir, max(9, a.repeats))
            bw = 2e9
            rows = []
            for cls in rsnaps[warmup]:
                series = {step: flat(st[cls]) for step, st in rsnaps.items()}
                rows += measure_class(cls, series, warmup, a.repeats, bw)
            results[title] = (rows, e2e)
            print(f"\n### {title}\n\n{note}\n\n{table(rows)}")
            if title.startswith("(a)"):
                print("\nper byte plane (the top two of each class; ratio @ encode/decode GB/s "
                      "per plane byte, one core; 1 MiB frames as byteplane writes them):\n")
                print(plane_table({c: flat(t) for c, t in rsnaps[warmup].items()},
                                  {c: flat(t) for c, t in rsnaps[warmup + 25].items()},
                                  a.repeats))
            if e2e:
                print(f"\nend to end: the pilot's pulse write of the state at s+25 to {workdir} "
                      f"(encode + write + fsync; median of {max(9, a.repeats)}; MB encoded)\n")
                print(e2e_table(e2e))

    print("\n### goals (issue 5)\n")
    rows_a = results["(a) AdamW full training"][0]
    for cls, (method, goal) in GOAL_RATIOS.items():
        r = row(rows_a, cls, method)
        best_codec = max((x for x in rows_a if x.cls == cls and x.method in CODECS
                          and x.method != "auto"), key=lambda x: x.ratios[25])
        name, best = best_baseline(rows_a, cls, 25)
        ok_abs = r.ratios[25] >= goal
        ok_rel = best_codec.ratios[25] >= 0.98 * best
        print(f"- (a) {cls}: {method} Δ25 {r.ratios[25]:.3f} (goal ≥ {goal}: "
              f"{'met' if ok_abs else 'NOT met'}); best codec {best_codec.method} "
              f"{best_codec.ratios[25]:.3f} vs best baseline {name} {best:.3f} = "
              f"{best_codec.ratios[25] / best:.3f}x (within 2 %: "
              f"{'met' if ok_rel else 'NOT met'})")
    rows_b = results["(b) fine-tuning, ~90 % frozen"][0]
    for cls in ("frozen weights", "weights"):
        r = row(rows_b, cls, "xor_delta")
        print(f"- (b) {cls}: xor_delta Δ25 {r.ratios[25]:.1f}x (goal ≥ {GOAL_FROZEN:.0f}x: "
              f"{'met' if r.ratios[25] >= GOAL_FROZEN else 'NOT met'})")
    speeds = [(t, r) for t, (rows, _) in results.items() for r in rows
              if r.method in ("byteplane", "xor_delta")]
    enc = min(speeds, key=lambda x: x[1].encode_mbs)
    dec = min(speeds, key=lambda x: x[1].decode_mbs)
    print(f"- byteplane/xor_delta encode ≥ {GOAL_ENCODE_MBS:,.0f} MB/s per core: slowest "
          f"{enc[1].encode_mbs:,.0f} MB/s ({enc[1].method}, {enc[1].cls}, {enc[0][:3]}) — "
          f"{'met' if enc[1].encode_mbs >= GOAL_ENCODE_MBS else 'NOT met'}; met in "
          f"{sum(r.encode_mbs >= GOAL_ENCODE_MBS for _, r in speeds)}/{len(speeds)} rows")
    print(f"- byteplane/xor_delta decode ≥ {GOAL_DECODE_MBS:,.0f} MB/s per core: slowest "
          f"{dec[1].decode_mbs:,.0f} MB/s ({dec[1].method}, {dec[1].cls}, {dec[0][:3]}) — "
          f"{'met' if dec[1].decode_mbs >= GOAL_DECODE_MBS else 'NOT met'}; met in "
          f"{sum(r.decode_mbs >= GOAL_DECODE_MBS for _, r in speeds)}/{len(speeds)} rows")
    short = [f"{r.method} {r.cls} {t[:3]} {r.encode_mbs:,.0f}/{r.decode_mbs:,.0f}"
             for t, r in speeds
             if r.encode_mbs < GOAL_ENCODE_MBS or r.decode_mbs < GOAL_DECODE_MBS]
    print(f"  rows short of a throughput goal (encode/decode MB/s): {'; '.join(short) or 'none'}")
    e2es = [(f"{t[:3]} {label.split(',')[0]}, {label.split(',')[1].strip()}", e)
            for t, (_, cases) in results.items() for label, e in cases]
    worst = max(e2es, key=lambda x: x[1].auto_s / x[1].raw_s)
    worst_ratio = worst[1].auto_s / worst[1].raw_s
    print(f"- auto never slower than raw end to end: worst auto/raw {worst_ratio:.2f}x "
          f"({worst[0]}) — {'met' if worst_ratio <= 1.0 else 'NOT met'}; "
          f"best {min(e.auto_s / e.raw_s for _, e in e2es):.2f}x")
    versus(a.versus_steps, a.versus_repeats)
    print(f"\nwall time {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
