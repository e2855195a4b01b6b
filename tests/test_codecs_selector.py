"""CodecSelector: which codec each tensor of a state gets, and when auto tries again."""

from __future__ import annotations

import pytest
import torch

from ckptpilot.codecs.auto import AutoCodec
from ckptpilot.codecs.byteplane import MIN_PLANE_RATIO, paying_plane_ratio
from ckptpilot.codecs.selector import CodecSelector, family


def test_families_follow_the_capture_paths() -> None:
    assert family("model/fc.weight") == "weights"
    assert family("optimizer/state/0/exp_avg") == "optimizer"
    assert family("rng/torch_cpu") == "other"


def test_unknown_family_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown tensor families"):
        CodecSelector({"moments": "raw"}, bandwidth_bytes_per_s=1e9)


def test_xor_delta_needs_a_fitting_base_else_auto_decides() -> None:
    sel = CodecSelector({"weights": "xor_delta", "optimizer": "zstd", "other": "raw"},
                        bandwidth_bytes_per_s=1e6)
    w = torch.randn(64, 64)
    codec, base = sel.codec_for("model/w", w, w + 1)
    assert codec.codec_id == "xor_delta" and base is not None
    codec, base = sel.codec_for("model/w", w, torch.randn(8))
    assert codec.codec_id != "xor_delta" and base is None
    codec, base = sel.codec_for("model/w", w)
    assert codec.codec_id in ("byteplane", "prefix_index", "raw") and base is None
    assert sel.codec_for("optimizer/x", w)[0].codec_id == "zstd"
    assert sel.codec_for("rng/x", w)[0].codec_id == "raw"


@pytest.mark.parametrize("bandwidth", [50e6, 2e9])
def test_byte_plane_codecs_code_the_planes_that_pay_at_the_tiers_bandwidth(
    bandwidth: float,
) -> None:
    sel = CodecSelector({"weights": "xor_delta", "optimizer": "byteplane"},
                        bandwidth_bytes_per_s=bandwidth)
    w = torch.randn(64, 64)
    for name, base in (("model/w", w + 1), ("optimizer/x", None)):
        codec, _ = sel.codec_for(name, w, base)
        assert codec.config["min_plane_ratio"] == paying_plane_ratio(bandwidth)
    planes = [c for c in AutoCodec(bandwidth_bytes_per_s=bandwidth).candidates(w, w + 1)
              if c.codec_id in ("byteplane", "xor_delta")]
    assert len(planes) == 2
    assert all(c.config["min_plane_ratio"] == paying_plane_ratio(bandwidth) for c in planes)
    assert paying_plane_ratio(50e6) < paying_plane_ratio(2e9) == MIN_PLANE_RATIO


def test_auto_choices_are_remembered_until_retry_every_saves(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    original = AutoCodec.trial

    def counting(self: AutoCodec, tensor: torch.Tensor, base: torch.Tensor | None = None
                 ) -> tuple[object, object, float]:
        calls.append("trial")
        return original(self, tensor, base)

    monkeypatch.setattr(AutoCodec, "trial", counting)
    sel = CodecSelector({}, bandwidth_bytes_per_s=1e6, retry_every=3)
    t = torch.randn(4096)
    for _ in range(3):
        sel.new_save()
        sel.codec_for("optimizer/a", t)
    assert len(calls) == 1
    sel.new_save()  # the 4th save: 3 saves after the choice, tried again
    sel.codec_for("optimizer/a", t)
    assert len(calls) == 2
    sel.codec_for("optimizer/a", torch.randn(8, 512))  # another shape: a new choice
    assert len(calls) == 3
    assert set(sel.choices()) == {"optimizer/a"}


def test_the_plain_layout_only_when_the_codecs_do_not_pay_for_the_container() -> None:
    big = {"model/w": torch.randn(1 << 20), "optimizer/m": torch.randn(1 << 20)}
    fast = CodecSelector({}, bandwidth_bytes_per_s=2e9, retry_every=2)
    assert not fast.plain_pays(big)  # nothing chosen yet: the first save tries
    fast.new_save()
    for name, t in big.items():
        fast.codec_for(name, t)
    # At 2 GB/s the ~15 % a codec saves on these floats is worth less than hashing 8 MB.
    assert fast.plain_pays(big)
    fast.new_save()
    fast.new_save()
    assert not fast.plain_pays(big)  # choices older than retry_every: tried again
    slow = CodecSelector({}, bandwidth_bytes_per_s=1e6)
    slow.new_save()
    for name, t in big.items():
        assert slow.codec_for(name, t)[0].codec_id != "raw"
    assert not slow.plain_pays(big)  # at 1 MB/s compression pays
    fixed = CodecSelector({"weights": "zstd"}, bandwidth_bytes_per_s=2e9)
    assert not fixed.plain_pays({"model/w": big["model/w"]})
