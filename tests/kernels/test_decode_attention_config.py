"""The split-K decode attention's layout rules (kernels/decode_attention_config.py): host-side,
no kernel runs (test_decode_attention.py runs each layout)."""
import os
import subprocess
import sys

import pytest
import torch

from kernels import decode_attention_config
from kernels.decode_attention_config import (NARROW, ONE_WARP, PIPELINE_MIN_L, _programs_wanted, default_layout,
                                             launch_layout, loop_stages, new_row_apart, prefetch_tiles, tma_tiles)
from tests.kernels.helpers import without_env_switches


def test_default_layout_by_rows(device, monkeypatch):
    """A short cache: one whole-cache tile per (row, head) for few pairs; from a third of the
    programs wanted, the narrow unsplit tiles of many rows (as at batch 64)."""
    without_env_switches(monkeypatch)
    dev = torch.device(device)
    many = _programs_wanted(dev) // 3
    assert default_layout(dev, many - 1, 256, 64)[:2] == (1, 256)
    assert default_layout(dev, many, 256, 64) == (1, 32, 2)
    assert default_layout(dev, _programs_wanted(dev) // 2 - 1, 256, 64) == (1, 32, 2)
    # tiles read before the wait: four in that layout below half the programs wanted, at most the chunk
    half = _programs_wanted(dev) // 2
    assert prefetch_tiles(dev, half - 1, 32, 2, 256) == 4 and prefetch_tiles(dev, half, 32, 2, 256) == 1
    assert prefetch_tiles(dev, half - 1, 32, 2, 96) == 2 and prefetch_tiles(dev, half - 1, 32, 2, 32) == 1
    assert prefetch_tiles(dev, 1, 256, 8, 256) == 1
    monkeypatch.setattr(decode_attention_config, "PREFETCH_TILES_ENV", 0)  # none, forced (A/B timing)
    assert prefetch_tiles(dev, half, 32, 2, 256) == 0 and launch_layout(dev, half, 256, 64)[2]["PREFETCH_TILES"] == 0


def test_one_warp_from_half_the_programs_wanted(device, monkeypatch):
    """From half the programs wanted (one tile before the wait) over a cache shorter than
    PIPELINE_MIN_L: the narrow tiles in one-warp programs, with the narrow layout's tile before
    the wait and new row apart, the loop unpipelined, or where the caches allow tensor
    descriptors (tma_ok) reading them 3 stages ahead; over longer caches the two-warp layout and
    its pipelined loop. MINILLM_ATTN_ONE_WARP=0 (ONE_WARP_ON) or a forced MINILLM_ATTN_NARROW
    (NARROW_ENV) turn it off."""
    without_env_switches(monkeypatch)
    dev = torch.device(device)
    wanted = _programs_wanted(dev)
    for bh, L in ((wanted, 256), (8 * wanted, 256), (wanted, PIPELINE_MIN_L - 1), (wanted // 2, 256)):
        assert default_layout(dev, bh, L, 64) == (1, 32, 1)
    assert prefetch_tiles(dev, wanted // 2, 32, 1, 256) == 1
    assert default_layout(dev, wanted, PIPELINE_MIN_L, 64) == (1, 32, 2)
    assert default_layout(dev, wanted, 256, 128)[1:] == (32, 8)  # wide heads keep their tiles
    _, _, meta = launch_layout(dev, wanted, 256, 64)
    assert meta == {"BLOCK_N": 32, "num_warps": 1, "PREFETCH_TILES": 1, "TMA": False, "LOOP_STAGES": 1,
                    "NEW_APART": True}
    _, _, meta = launch_layout(dev, wanted, 256, 64, tma_ok=True)
    assert meta == {"BLOCK_N": 32, "num_warps": 1, "PREFETCH_TILES": 1, "TMA": True, "LOOP_STAGES": 3,
                    "NEW_APART": True}
    monkeypatch.setattr(decode_attention_config, "ONE_WARP_ON", False)
    assert default_layout(dev, wanted, 256, 64) == (1, 32, 2)
    monkeypatch.setattr(decode_attention_config, "ONE_WARP_ON", True)
    monkeypatch.setattr(decode_attention_config, "NARROW_ENV", (64, 2))
    monkeypatch.setattr(decode_attention_config, "NARROW", (64, 2))
    assert default_layout(dev, wanted, 256, 64) == (1, 64, 2)


def test_default_layout_long_cache_splits(device, monkeypatch):
    """Three quarters of the programs wanted or more, but fewer than all, over a cache of 1024
    positions or more: 8 splits of narrow tiles, not pipelined (that is for unsplit programs).
    MINILLM_ATTN_LONG_SPLITS=0 (LONG_SPLITS) turns it off."""
    without_env_switches(monkeypatch)
    dev = torch.device(device)
    wanted = _programs_wanted(dev)
    low = wanted * 3 // 4
    for bh in (low, wanted - 1):
        assert default_layout(dev, bh, 1024, 64) == (8, 32, 2)
    assert default_layout(dev, low - 1, 1024, 64)[1:] == (64, 4)
    assert default_layout(dev, wanted, 1024, 64) == (1, 32, 2)
    assert default_layout(dev, low, 512, 64)[1:] == (64, 4)
    assert default_layout(dev, low, 1024, 128)[1:] == (32, 8)  # wide heads keep their tiles
    assert loop_stages(1024, 32, 2, splits=8) == 1
    monkeypatch.setattr(decode_attention_config, "LONG_SPLITS", 0)
    assert default_layout(dev, low, 1024, 64)[1:] == (64, 4)


def test_env_switches_checked_at_import():
    """A switch out of range would reach the launcher as a value it refuses under another name
    (MINILLM_ATTN_LONG_SPLITS=6, a split count) or be read as another (MINILLM_ATTN_NEW_APART=2):
    the import says which variable is wrong."""
    for name, value, message in (("MINILLM_ATTN_LONG_SPLITS", "6", "expected 0 or a power of two, got 6"),
                                 ("MINILLM_ATTN_NEW_APART", "2", "expected 0 or 1, got 2"),
                                 ("MINILLM_ATTN_ONE_WARP", "2", "expected 0 or 1, got 2"),
                                 ("MINILLM_ATTN_TMA", "2", "expected 0 or 1, got 2")):
        env = {**os.environ, name: value}
        run = subprocess.run([sys.executable, "-c", "import kernels"], env=env, capture_output=True, text=True)
        assert run.returncode != 0
        assert f"{name}: {message}" in run.stderr


def test_tma_tiles_rule(monkeypatch):
    """Tensor-descriptor tiles in the one-warp programs over short unsplit caches only, and only
    where the caches allow them; MINILLM_ATTN_TMA (TMA_ENV) forces them on or off where allowed."""
    without_env_switches(monkeypatch)
    assert tma_tiles(256, *ONE_WARP) and tma_tiles(PIPELINE_MIN_L - 1, *ONE_WARP)
    assert not tma_tiles(256, *ONE_WARP, tma_ok=False) and not tma_tiles(PIPELINE_MIN_L, *ONE_WARP)
    assert not tma_tiles(256, *NARROW) and not tma_tiles(256, 64, 4) and not tma_tiles(256, *ONE_WARP, splits=2)
    monkeypatch.setattr(decode_attention_config, "ONE_WARP_ON", False)
    assert not tma_tiles(256, *ONE_WARP)
    monkeypatch.setattr(decode_attention_config, "TMA_ENV", 1)
    assert tma_tiles(1024, 64, 4) and not tma_tiles(1024, 64, 4, tma_ok=False)
    monkeypatch.setattr(decode_attention_config, "TMA_ENV", 0)
    monkeypatch.setattr(decode_attention_config, "ONE_WARP_ON", True)
    assert not tma_tiles(256, *ONE_WARP)


def test_new_row_apart_rule(monkeypatch):
    """The new row starts the softmax in the narrow layout's unpipelined loop or its loop of
    tensor-descriptor tiles, unless MINILLM_ATTN_NEW_APART (NEW_APART_ENV) forces it."""
    without_env_switches(monkeypatch)
    assert new_row_apart(*NARROW, 1)
    assert not new_row_apart(*NARROW, 3) and new_row_apart(*ONE_WARP, 3, tma=True)
    assert not new_row_apart(256, 8, 1) and not new_row_apart(64, 4, 1)
    monkeypatch.setattr(decode_attention_config, "NEW_APART_ENV", 0)
    assert not new_row_apart(*NARROW, 1)
    monkeypatch.setattr(decode_attention_config, "NEW_APART_ENV", 1)
    assert new_row_apart(256, 8, 1)


def test_loop_stages_rule(monkeypatch):
    """The cache loop is pipelined in the narrow unsplit layout over long caches, or where its
    tiles come by tensor descriptors."""
    without_env_switches(monkeypatch)
    assert loop_stages(PIPELINE_MIN_L, 32, 2) == 3 and loop_stages(1024, 32, 2) == 3
    assert loop_stages(PIPELINE_MIN_L // 2, 32, 2) == 1 and loop_stages(PIPELINE_MIN_L // 2, *ONE_WARP, tma=True) == 3
    assert loop_stages(1024, 64, 4) == 1 and loop_stages(1024, 32, 8) == 1
    # a caller's tma_stages (decode_attention's) sets the descriptor loop's stages, and no other
    assert loop_stages(PIPELINE_MIN_L // 2, *ONE_WARP, tma=True, tma_stages=4) == 4
    assert loop_stages(1024, 32, 2, tma_stages=4) == 3 and loop_stages(PIPELINE_MIN_L // 2, 32, 2, tma_stages=4) == 1
    monkeypatch.setattr(decode_attention_config, "LOOP_STAGES_ENV", 2)  # MINILLM_ATTN_STAGES wins (A/B timing)
    assert loop_stages(PIPELINE_MIN_L // 2, *ONE_WARP, tma=True, tma_stages=4) == 2


def test_launch_layout_resolves_config_and_rules(monkeypatch):
    """launch_layout: the rules fill what _config leaves out, and what it names wins; num_splits
    forces the split count with the base tiles; the chunk is whole tiles."""
    without_env_switches(monkeypatch)
    dev = torch.device("cpu")
    many = _programs_wanted(dev)
    splits, chunk, meta = launch_layout(dev, many, 256, 64)
    assert (splits, chunk) == (1, 256)
    assert meta == {"BLOCK_N": 32, "num_warps": 1, "PREFETCH_TILES": 1, "TMA": False, "LOOP_STAGES": 1,
                    "NEW_APART": True}
    _, _, meta = launch_layout(dev, many, 1024, 64)  # pipelined: the new row stays in the tiles
    assert (meta["LOOP_STAGES"], meta["NEW_APART"]) == (3, False)
    _, _, meta = launch_layout(dev, many, 256, 64, config={"LOOP_STAGES": 2, "NEW_APART": True, "num_warps": 4})
    assert meta == {"BLOCK_N": 32, "num_warps": 4, "PREFETCH_TILES": 1, "TMA": False, "LOOP_STAGES": 2,
                    "NEW_APART": True}
    _, _, meta = launch_layout(dev, many, 256, 64, tma_ok=True, tma_stages=4)  # descriptor tiles: the caller's stages
    assert (meta["TMA"], meta["LOOP_STAGES"]) == (True, 4)
    _, _, meta = launch_layout(dev, many, 256, 64, tma_stages=4)  # pointer loads: the rule's
    assert (meta["TMA"], meta["LOOP_STAGES"]) == (False, 1)
    # a config asking for descriptors the caches do not allow gets pointer loads, and their stages
    _, _, meta = launch_layout(dev, many, 256, 64, config={"TMA": True}, tma_stages=4)
    assert (meta["TMA"], meta["LOOP_STAGES"], meta["NEW_APART"]) == (False, 1, True)
    splits, chunk, meta = launch_layout(dev, 1, 200, 64, num_splits=4)
    assert (splits, chunk, meta["BLOCK_N"], meta["num_warps"]) == (4, 64, 64, 4)  # cdiv(200, 4) = 50 -> a 64-row tile
    for bad, name in (({"num_splits": 3}, "num_splits"), ({"config": {"PREFETCH_TILES": 3}}, "PREFETCH_TILES"),
                      ({"config": {"LOOP_STAGES": 0}}, "LOOP_STAGES"), ({"tma_stages": 0}, "tma_stages"),
                      ({"tma_stages": 2.0}, "tma_stages")):
        with pytest.raises(ValueError, match=f"^{name}"):
            launch_layout(dev, 1, 200, 64, **bad)
