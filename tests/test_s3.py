"""The remote tier on a real S3-compatible server: ``moto`` in server mode, a separate process
on 127.0.0.1, talked to over HTTP by ``s3fs`` — no in-process mock (issue 13, point 5).

Object stores have no rename: a checkpoint is committed by its manifest, written last. These
tests save, restore bit-exactly, list, validate and prune there; kill a writer between the
data and the manifest; and check that the credentials in ``storage_options`` reach neither
the logs nor the metadata store.
"""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml

from ckptpilot import CheckpointPilot, Policy, PolicyError, load_policy
from ckptpilot.cli import ops
from ckptpilot.errors import CheckpointWriteError, CkptPilotError
from ckptpilot.tiers.remote import archive
from ckptpilot.tiers.remote.store import RemoteTier

pytestmark = pytest.mark.integration
s3fs = pytest.importorskip("s3fs")

SECRET = "s3-secret-never-logged-7f3a"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = _free_port()
    log = (tmp_path_factory.mktemp("moto") / "server.log").open("wb")
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
                               "-p", str(port)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120  # a safety net: the server answers in seconds
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).close()
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise RuntimeError(f"moto server did not start (see {log.name})") from None
            time.sleep(0.2)
    try:
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


def _options(endpoint: str) -> dict[str, object]:
    return {"key": "testing", "secret": SECRET,
            "client_kwargs": {"endpoint_url": endpoint, "region_name": "eu-west-1"}}


@pytest.fixture
def bucket(s3_endpoint: str, request: pytest.FixtureRequest) -> str:
    fs = s3fs.S3FileSystem(**_options(s3_endpoint), skip_instance_cache=True)
    name = f"ckpt-{abs(hash(request.node.name)) % 10**8}-{os.getpid()}"
    fs.mkdir(name)
    return name


def _policy_file(tmp_path: Path, endpoint: str, bucket: str) -> Path:
    cfg = tmp_path / "policy.yaml"
    cfg.write_text(yaml.safe_dump({
        "scheduler": {"base_interval": 3, "min_interval": 1, "max_interval": 100,
                      "young_daly": False, "weights": {"loss": 1.0, "grad": 0.0, "system": 0.0},
                      "loss": {"slope_threshold": 1000.0}, "organ_every": 2},
        "observability": {"tensorboard": False, "decision_log": False},
        "tiers": {"remote": {"url": f"s3://{bucket}/runs/exp1",
                             "storage_options": _options(endpoint)}},
        # auto off: every save stays until the test prunes by hand (the same executor).
        "retention": {"routine_keep": 1, "auto": False},
    }))
    return cfg


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(pilot: CheckpointPilot, model: torch.nn.Module, opt: torch.optim.Optimizer,
           steps: int) -> None:
    g = torch.Generator().manual_seed(pilot.step)
    for _ in range(steps):
        opt.zero_grad()
        loss = model(torch.randn(8, 16, generator=g)).pow(2).mean()
        loss.backward()
        opt.step()
        pilot.observe(loss)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def test_save_restore_list_validate_prune_on_s3(tmp_path: Path, s3_endpoint: str,
                                                bucket: str,
                                                caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    cfg = _policy_file(tmp_path, s3_endpoint, bucket)
    policy = load_policy(cfg, run_dir=tmp_path / "run")
    assert SECRET not in repr(policy)
    model, opt = _model()
    with CheckpointPilot(policy, model=model, optimizer=opt) as pilot:
        _train(pilot, model, opt, 10)
    saves = [(r.step, r.level, r.status.value) for r in pilot.saves]
    assert saves and all(status == "valid" for *_, status in saves)
    assert saves[-1][0] == 10  # close() saved the last step
    assert {level.value for _, level, _ in saves} >= {"pulse", "organ"}

    fs = s3fs.S3FileSystem(**_options(s3_endpoint), skip_instance_cache=True)
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{bucket}/runs/exp1"))
    assert names == [archive.checkpoint_name(step, 0) for step, *_ in saves]
    for name in names:  # every checkpoint committed, no staging left behind
        assert fs.exists(f"{bucket}/runs/exp1/{name}/{archive.MANIFEST_FILE}")

    fresh, fresh_opt = _model()
    torch.nn.init.zeros_(fresh[0].weight)
    with CheckpointPilot(policy, model=fresh, optimizer=fresh_opt) as again:
        assert again.restore() == 10
        assert again.last_recovery is not None
        assert again.last_recovery.location.startswith(f"{bucket}/runs/exp1/")
        again.close(save=False)
    for a, b in zip(fresh.state_dict().values(), model.state_dict().values(), strict=True):
        assert torch.equal(_bits(a), _bits(b))

    out = io.StringIO()
    assert ops.ls(policy, out) == 0
    listed = [line.split()[:5] for line in out.getvalue().splitlines()[1:]]
    assert sorted((int(step), status) for step, _, _, _, status in listed) == sorted(
        (step, "valid") for step, *_ in saves)
    out = io.StringIO()
    assert ops.validate(policy, rebuild=False, out=out) == 0
    assert f"{len(saves)} ok, 0 corrupted" in out.getvalue()
    out = io.StringIO()
    assert ops.prune(policy, dry_run=False, out=out) == 0
    kept = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{bucket}/runs/exp1", refresh=True))
    assert archive.checkpoint_name(10, 0) in kept and len(kept) < len(names)
    for name in kept:
        assert fs.exists(f"{bucket}/runs/exp1/{name}/{archive.MANIFEST_FILE}")

    # The credentials went to fsspec and nowhere else.
    assert SECRET not in caplog.text
    for file in (tmp_path / "run").rglob("*"):
        if file.is_file():
            assert SECRET.encode() not in file.read_bytes(), file


CHILD = textwrap.dedent("""\
    import os, signal, sys
    import torch
    from ckptpilot import CheckpointPilot, load_policy
    from ckptpilot.tiers.remote import archive
    from ckptpilot.tiers.remote import tier as tier_module

    def killed_before_the_manifest(tier, staged):
        if staged.manifest["step"] == int(sys.argv[3]):
            os.kill(os.getpid(), signal.SIGKILL)  # the data is written, the manifest is not
        real(tier, staged)

    real = archive.publish_organ
    tier_module.publish_organ = killed_before_the_manifest
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    pilot = CheckpointPilot(load_policy(sys.argv[1], run_dir=sys.argv[2]), model=model,
                            optimizer=opt)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        opt.zero_grad()
        loss = model(torch.randn(8, 16, generator=g)).pow(2).mean()
        loss.backward()
        opt.step()
        pilot.observe(loss)
        pilot.flush()
    """)


def test_a_writer_killed_between_data_and_manifest_leaves_no_checkpoint(
        tmp_path: Path, s3_endpoint: str, bucket: str) -> None:
    cfg = _policy_file(tmp_path, s3_endpoint, bucket)
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    run_dir = tmp_path / "run"
    child = subprocess.run([sys.executable, str(script), str(cfg), str(run_dir), "6"],
                           capture_output=True, timeout=600)
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()[-2000:]

    policy = load_policy(cfg, run_dir=run_dir)
    remote = RemoteTier(policy.tiers.remote.url, policy.tiers.remote.storage_options)
    unfinished = archive.checkpoint_name(6, 0)
    assert remote.exists(f"{unfinished}/{archive.STATE_FILE}")  # the data reached S3 …
    assert not remote.committed(unfinished)  # … but it is no checkpoint
    listing = archive.list_archives(remote, 0)
    assert unfinished in listing.staging
    assert [s for s, _ in listing.published] == [3]
    out = io.StringIO()
    assert ops.validate(policy, rebuild=False, out=out) == 0
    assert "1 unfinished save(s)" in out.getvalue() and "1 ok, 0 corrupted" in out.getvalue()

    model, opt = _model()
    with CheckpointPilot(policy, model=model, optimizer=opt) as pilot:
        assert pilot.restore() == 3
        assert not remote.exists(unfinished)  # the restore removed the debris
        assert _rows(policy)[6] == "corrupted"  # the killed save's row, never loaded
        _train(pilot, model, opt, 3)  # step 6 again, saved for real this time
    assert remote.committed(unfinished)
    assert _rows(policy) == {3: "valid", 6: "valid"}


def _rows(policy: Policy) -> dict[int, str]:
    run = ops.Run(policy)
    with run.store(read_only=True) as store:
        return {r.step: r.status.value for r in store.rows(run.run_id)}


def test_a_non_durable_remote_url_is_refused(tmp_path: Path) -> None:
    policy = load_policy(_write(tmp_path, {"tiers": {"remote": {"url": "memory://ckpt/x"}}}),
                         run_dir=tmp_path / "run")
    model, opt = _model()
    with pytest.raises(PolicyError, match=r"tiers.remote.url: memory://ckpt/x does not outlive"):
        CheckpointPilot(policy, model=model, optimizer=opt)


def _write(tmp_path: Path, data: dict[str, object]) -> Path:
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


# --- a network that fails: tests/flakyproxy.py between the pilot and the server (issue 28) ---

PROXY = Path(__file__).with_name("flakyproxy.py")
FAST_RETRIES = {"attempts": 4, "backoff_seconds": 0.01, "max_backoff_seconds": 0.05}


class _Proxy:
    def __init__(self, tmp_path: Path, upstream: str) -> None:
        self.port = _free_port()
        self.rules = tmp_path / "rules.json"
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp_path / "proxy.log"
        self._out = self.log.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, str(PROXY), str(self.port), upstream.rsplit(":", 1)[1],
             str(self.rules)], stdout=self._out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60  # a safety net: it listens at once
        while b"ready" not in self.log.read_bytes():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"flaky proxy did not start: {self.log.read_text()}")
            time.sleep(0.05)

    def set_rules(self, rules: list[dict[str, object]]) -> None:
        tmp = self.rules.with_suffix(".tmp")
        tmp.write_text(json.dumps(rules))
        os.replace(tmp, self.rules)  # the proxy re-reads it for every request

    def faults(self) -> list[str]:
        return [line for line in self.log.read_text().splitlines() if line != "ready"]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)
        self._out.close()


@pytest.fixture
def proxy(tmp_path: Path, s3_endpoint: str) -> Iterator[_Proxy]:
    p = _Proxy(tmp_path, s3_endpoint)
    try:
        yield p
    finally:
        if p.proc.poll() is None:
            p.kill()


def _flaky_policy(tmp_path: Path, endpoint: str, bucket: str, **options: object) -> Policy:
    """The s3 policy through ``endpoint`` with tiny back-off; ``options`` are added to the
    storage options (here: s3fs and botocore told not to retry, so that the resets reach
    ckptpilot's own retries and its log)."""
    cfg = _policy_file(tmp_path, endpoint, bucket)
    data = yaml.safe_load(cfg.read_text())
    data["tiers"]["remote"]["retries"] = FAST_RETRIES
    data["tiers"]["remote"]["storage_options"].update(options)
    cfg.write_text(yaml.safe_dump(data))
    return load_policy(cfg, run_dir=tmp_path / "run")


NO_LIBRARY_RETRIES = {"retries": 1, "config_kwargs": {"retries": {"total_max_attempts": 1}}}


def _saved(policy: Policy, steps: int) -> torch.nn.Module:
    model, opt = _model()
    with CheckpointPilot(policy, model=model, optimizer=opt) as pilot:
        _train(pilot, model, opt, steps)
    return model


def test_s3_connection_reset_during_restore_is_retried_and_succeeds(
        tmp_path: Path, s3_endpoint: str, bucket: str, proxy: _Proxy,
        caplog: pytest.LogCaptureFixture) -> None:
    policy = _flaky_policy(tmp_path, proxy.url, bucket, **NO_LIBRARY_RETRIES)
    model = _saved(policy, 6)
    newest = archive.checkpoint_name(6, 0)
    # The next 3 requests for the newest checkpoint's objects: connection reset.
    proxy.set_rules([{"method": "GET", "path": f"/{newest}/", "action": "reset", "times": 3}])
    caplog.set_level(logging.WARNING)
    fresh, fresh_opt = _model()
    torch.nn.init.zeros_(fresh[0].weight)
    with CheckpointPilot(policy, model=fresh, optimizer=fresh_opt) as again:
        assert again.restore() == 6
        again.close(save=False)
    for a, b in zip(fresh.state_dict().values(), model.state_dict().values(), strict=True):
        assert torch.equal(_bits(a), _bits(b))
    assert len([f for f in proxy.faults() if f.startswith("reset GET")]) == 3
    # One log line a retry (aiohttp itself may repeat a request on a dropped keep-alive
    # connection, so a reset is not always one retry of ours).
    retries = [r.getMessage() for r in caplog.records if "; retry " in r.getMessage()]
    assert retries, caplog.text
    assert retries[0].startswith(f"read s3://{bucket}/runs/exp1/{newest}/")
    assert "retry 1 of 3 in 0.01s" in retries[0]
    assert "skipping checkpoint" not in caplog.text


def test_s3_down_during_restore_walks_back_or_names_the_url(
        tmp_path: Path, s3_endpoint: str, bucket: str, proxy: _Proxy,
        caplog: pytest.LogCaptureFixture) -> None:
    policy = _flaky_policy(tmp_path, proxy.url, bucket, **NO_LIBRARY_RETRIES)
    _saved(policy, 6)
    newest = archive.checkpoint_name(6, 0)
    # Every connection for the newest checkpoint's objects is reset: after its retries the
    # restore skips it with the URL and the cause and walks back to step 3.
    proxy.set_rules([{"method": "GET", "path": f"/{newest}/", "action": "reset"}])
    caplog.set_level(logging.WARNING)
    model, opt = _model()
    with CheckpointPilot(policy, model=model, optimizer=opt) as pilot:
        assert pilot.restore() == 3
        assert pilot.last_recovery is not None
        skipped = {s.location: s.reason for s in pilot.last_recovery.skipped}
        pilot.close(save=False)
    reason = skipped[f"{bucket}/runs/exp1/{newest}"]
    assert reason.startswith(f"cannot read s3://{bucket}/runs/exp1/{newest}/")
    assert "after 4 attempt(s) (tiers.remote.retries)" in reason
    assert "EndpointConnectionError" in reason or "ConnectionResetError" in reason, reason
    # An I/O error condemns nothing (the restore to step 3 retires step 6 as ``expired``:
    # the run goes on from 3).
    rows = _rows(policy)
    assert rows[3] == "valid" and rows[6] != "corrupted", rows

    # The server gone altogether: one ckptpilot error naming the URL and the cause.
    proxy.kill()
    model, opt = _model()
    with CheckpointPilot(policy, model=model, optimizer=opt) as pilot:
        with pytest.raises(CkptPilotError) as raised:
            pilot.restore()
        pilot.close(save=False)
    text = str(raised.value)
    assert f"cannot list s3://{bucket}/runs/exp1" in text, text
    assert "after 4 attempt(s)" in text and "EndpointConnectionError" in text, text
    assert not isinstance(raised.value, BrokenPipeError)
    assert _rows(policy) == rows


def test_s3_killed_mid_upload_reports_checkpoint_write_error_and_publishes_nothing(
        tmp_path: Path, s3_endpoint: str, bucket: str, proxy: _Proxy) -> None:
    policy = _flaky_policy(tmp_path, proxy.url, bucket, **NO_LIBRARY_RETRIES)
    unfinished = archive.checkpoint_name(6, 0)
    # The data of step 6 goes up, then the server is gone for its manifest (the commit).
    proxy.set_rules([{"method": "PUT", "path": f"/{unfinished}/{archive.MANIFEST_FILE}",
                      "action": "reset"}])
    model, opt = _model()
    pilot = CheckpointPilot(policy, model=model, optimizer=opt)
    with pytest.raises(CheckpointWriteError) as raised:
        for _ in range(3):
            _train(pilot, model, opt, 3)
            pilot.flush()
    text = str(raised.value)
    assert "of step 6" in text, text
    assert f"cannot write s3://{bucket}/runs/exp1/{unfinished}/{archive.MANIFEST_FILE}" in text
    assert "after 4 attempt(s)" in text, text
    pilot.close(save=False)
    # Each of our 4 attempts reached the proxy (aiohttp may add one on a kept-alive socket).
    assert len([f for f in proxy.faults() if f.startswith("reset PUT")]) >= 4

    proxy.set_rules([])
    remote = RemoteTier(policy.tiers.remote.url, policy.tiers.remote.storage_options)
    assert remote.exists(f"{unfinished}/{archive.STATE_FILE}")  # the data reached S3 …
    listing = archive.list_archives(remote, 0)
    assert [s for s, _ in listing.published] == [3]  # … but nothing half-written is published
    assert unfinished in listing.staging
    model, opt = _model()
    with CheckpointPilot(policy, model=model, optimizer=opt) as again:
        assert again.restore() == 3
        assert not remote.exists(unfinished)  # the restore removed the debris
        again.close(save=False)


def test_s3_retry_settings_reach_s3fs_and_botocore(tmp_path: Path, s3_endpoint: str,
                                                   bucket: str) -> None:
    policy = _flaky_policy(tmp_path, s3_endpoint, bucket)
    assert policy.tiers.remote.retries.attempts == 4
    remote = RemoteTier(policy.tiers.remote.url, policy.tiers.remote.storage_options,
                        retries=policy.tiers.remote.retries)
    assert isinstance(remote.fs, s3fs.S3FileSystem)
    assert remote.fs.retries == 4
    remote.list()  # connects: the botocore client exists from here on
    assert remote.fs.s3.meta.config.retries == {"total_max_attempts": 4, "mode": "standard"}

    # What the user's storage_options say wins.
    mine = _flaky_policy(tmp_path, s3_endpoint, bucket, **NO_LIBRARY_RETRIES)
    remote = RemoteTier(mine.tiers.remote.url, mine.tiers.remote.storage_options,
                        retries=mine.tiers.remote.retries)
    remote.list()
    assert remote.fs.retries == 1
    assert remote.fs.s3.meta.config.retries["total_max_attempts"] == 1
