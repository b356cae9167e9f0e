"""The decode GEMV's layout rules (kernels/gemv_config.py): host-side, no kernel runs."""
import pytest

from kernels import gemv_config


def test_decode_config_programs_per_sm():
    """Up to 16 rows and from K = 1024, column blocks narrow (128, 64, 32) until the split
    layout has a program per SM; the chunks (the arithmetic) stay; gpt2's K = 768 keeps 128."""
    def layout(M, N, K, sms=132):
        c = gemv_config.decode_config(M, N, K, 2, sms=sms)
        return c["BLOCK_N"], c["BLOCK_K"], c["CHUNKS"]
    assert layout(1, 1024, 1024) == (32, 256, 4)  # gpt2-medium attn-out: 32 -> 128 programs
    assert layout(1, 3072, 1024) == (64, 256, 4)  # medium qkv: 96 -> 192
    assert layout(16, 1600, 1600) == (64, 256, 7)  # gpt2-xl attn-out: 91 -> 175
    assert layout(1, 4800, 1600) == (128, 256, 7)  # xl qkv: 266 already
    assert layout(1, 768, 768) == (128, 128, 6)  # gpt2 attn-out: unchanged below K = 1024
    assert layout(1, 1024, 1024, sms=16) == (128, 256, 4)  # a small GPU: 32 programs suffice
    assert layout(17, 1024, 1024)[0] == 64  # past 16 rows: the looping layout, as before
    assert layout(64, 1024, 4096)[0] == 64  # gpt2-medium's (1024 wide) keep 64 columns


def test_decode_config_chunk_groups(monkeypatch):
    """gpt2's mlp-out (K >= 1024, narrow output, no layernorm) adds its chunk sums in four groups
    at every row count (the arithmetic), and past 16 rows runs a program a group: a 64-row slab a
    32-column block (MINILLM_GROUP_SLAB: from 17 rows), else a 16-row program a 64-column block
    in 4 pipeline stages (MINILLM_GROUP_STAGES forces others); every other layer keeps one group.
    MINILLM_GROUP_SPLIT=0: the 32-column loop."""
    def cfg(M, N, K, ln=False):
        return gemv_config.decode_config(M, N, K, 2, ln, sms=132)
    for M in (2, 16):
        assert cfg(M, 768, 3072)["SPLIT"] and cfg(M, 768, 3072)["CHUNK_GROUPS"] == 4
    for M in (17, 64):
        c = cfg(M, 768, 3072)
        assert (c.get("SLAB"), c["CHUNK_GROUPS"], c["BLOCK_N"], c["BLOCK_M"], c["BLOCK_K"], c["CHUNKS"]) == \
            (True, 4, 32, 64, 256, 12)
    monkeypatch.setattr(gemv_config, "GROUP_SLAB_MIN_ROWS", 33)
    assert cfg(33, 768, 3072).get("SLAB") and not cfg(32, 768, 3072).get("SLAB")
    monkeypatch.setattr(gemv_config, "GROUP_SLAB_MIN_ROWS", 0)
    for M in (17, 64):
        c = cfg(M, 768, 3072)
        assert (c["GROUP_SPLIT"], c["CHUNK_GROUPS"], c["BLOCK_N"], c["CHUNKS"]) == (True, 4, 64, 12)
        assert gemv_config.partial_count(c) == 4 and c["num_stages"] == 4
    monkeypatch.setattr(gemv_config, "GROUP_STAGES", 6)
    assert cfg(64, 768, 3072)["num_stages"] == 6
    monkeypatch.setattr(gemv_config, "CHUNK_GROUPS", 2)
    assert cfg(64, 768, 3072)["CHUNK_GROUPS"] == 2
    assert gemv_config.chunk_groups(768, 3072, ln=True) == 1 and gemv_config.chunk_groups(1024, 4096, False) == 1
    assert gemv_config.chunk_groups(768, 768, False) == 1  # K below 1024 (gpt2's attn-out)
    assert cfg(8, 2304, 768, ln=True).get("CHUNK_GROUPS", 1) == 1
    monkeypatch.setattr(gemv_config, "CHUNK_GROUPS_ON", False)
    c = cfg(64, 768, 3072)
    assert (c["BLOCK_N"], c["num_warps"], c.get("GROUP_SPLIT", False), gemv_config.chunk_groups(768, 3072, False)) == \
        (32, 2, False, 1)


def test_decode_config_32_row_tiles():
    """gpt2's qkv and fc (K below 1024, N >= 2K) take one 32-row tile a 64-column block at 17-32
    rows, and one 64-row tile a 32-column block past 32; attn-out keeps 16-row tiles there (and
    mlp-out's chunk groups their slabs: test_decode_config_chunk_groups)."""
    def cfg(M, N, K, ln=True):
        c = gemv_config.decode_config(M, N, K, 2, ln, sms=132)
        return c.get("BLOCK_M", gemv_config.BLOCK_M), c["BLOCK_N"], c["CHUNKS"]
    for N in (2304, 3072):
        assert cfg(17, N, 768) == cfg(32, N, 768) == (32, 64, 6)
        assert cfg(33, N, 768) == cfg(64, N, 768) == (64, 32, 6)
        assert cfg(16, N, 768)[0] == 16  # split programs up to 16 rows
    assert cfg(32, 768, 768, ln=False)[0] == 16
    for M in (32, 64):  # fp32 keeps 16-row tiles
        assert gemv_config.decode_config(M, 2304, 768, 4, True, sms=132).get("BLOCK_M", 16) == 16
    assert cfg(32, 200, 96)[0] == 16  # below ROWS32_MIN_K


def test_partial_count_errors():
    base = {"BLOCK_N": 32, "BLOCK_K": 32, "CHUNKS": 4, "SPLIT": False, "GROUP_SPLIT": False, "CHUNK_GROUPS": 2}
    with pytest.raises(ValueError, match="CHUNK_GROUPS 2 needs SPLIT or GROUP_SPLIT"):
        gemv_config.partial_count(base)
    with pytest.raises(ValueError, match="SPLIT or GROUP_SPLIT, not both"):
        gemv_config.partial_count({**base, "SPLIT": True, "GROUP_SPLIT": True})
    assert gemv_config.partial_count({**base, "GROUP_SPLIT": True, "CHUNKS": 5, "CHUNK_GROUPS": 4}) == 3  # 2 + 2 + 1


def test_stage_first_rule():
    """Which split launches stage their first weight tile before the wait (H100 timings)."""
    def staged(M, N, K, ln=False):
        return gemv_config.stage_first(gemv_config.decode_config(M, N, K, 2, ln, sms=132), M, K, ln)
    assert not staged(4, 2304, 768, ln=True) and staged(8, 2304, 768, ln=True)  # gpt2 qkv at 5-8 rows
    assert staged(8, 768, 3072) and staged(16, 768, 3072)  # gpt2 mlp-out at 5-16 rows
    assert not staged(16, 2304, 768, ln=True)  # past 8 rows only the wide layers without a layernorm
    assert not staged(8, 3072, 1024, ln=True) and not staged(8, 1600, 6400)  # wide tiles: 64 x 256 at most
    assert not staged(1, 768, 3072) and not staged(32, 768, 3072)  # one row; group programs


def test_tma_weights_follow_the_compiler_and_layout(monkeypatch):
    """Split programs take their weight tile by tensor descriptor under Tritons after 3.6 (which
    would hold a pointer-loaded tile in registers across the wait), by pointers under 3.6;
    looping layouts past 32 rows under either, not at 17-32 rows (nor the vocabulary head's
    16-row loop); MINILLM_TMA_WEIGHTS forces either way."""
    def cfg(M, N, K):
        return gemv_config.decode_config(M, N, K, 2, True, sms=132)
    split = cfg(1, 4800, 1600)
    rows = {M: cfg(M, 2304, 768) for M in (32, 33, 64)}
    head = cfg(16, 50257, 768)
    assert split["SPLIT"] and not any(c["SPLIT"] for c in (*rows.values(), head))
    assert gemv_config.tma_weights(split, 1, (3, 9)) and not gemv_config.tma_weights(split, 1, (3, 6))
    for version in ((3, 6), (3, 9)):
        assert [gemv_config.tma_weights(c, M, version) for M, c in rows.items()] == [False, True, True]
        assert not gemv_config.tma_weights(head, 16, version)
    for forced, expect in (("1", True), ("0", False)):
        monkeypatch.setattr(gemv_config, "TMA_WEIGHTS", forced)
        for version in ((3, 6), (3, 9)):
            on = gemv_config.tma_weights
            assert on(split, 1, version) == on(rows[32], 32, version) == expect


def test_split_maxnreg_three_programs_an_sm():
    """The 64 KB tiles of gpt2-xl's split programs (4 warps) are capped at 168 registers, so
    three fit an SM's 65,536; smaller tiles, fp32's (which spill either way) and other layouts
    are not capped."""
    def cap(M, N, K, itemsize=2):
        c = gemv_config.decode_config(M, N, K, itemsize, True, sms=132)
        return gemv_config.split_maxnreg({"BLOCK_M": gemv_config.BLOCK_M, **c}, itemsize)
    assert cap(1, 4800, 1600) == cap(2, 6400, 1600) == 168
    assert 168 * 128 * 3 <= 65536 < 176 * 128 * 3
    assert cap(1, 4800, 1600, itemsize=4) is None  # 128 x 128 fp32: 64 KB as well
    assert cap(8, 2304, 768) is None  # gpt2: 32 KB tiles
    assert cap(1, 1600, 1600) is None  # 64-column blocks


def test_fixed_split_rule(monkeypatch):
    """The one-atomic merge runs at one row, where the partials of 2 to 63 programs meet and no
    statistics or argmax need whole column blocks; MINILLM_GEMV_FIXED=1 or 0 forces it on or off
    (never past the word's 63 arrivals or where tiles must be whole)."""
    monkeypatch.setattr(gemv_config, "GEMV_FIXED", "auto")
    assert gemv_config.fixed_split(7, False, 1)  # gpt2-xl's qkv and fc
    assert gemv_config.fixed_split(63, False, 1)
    assert not gemv_config.fixed_split(64, False, 1)  # past the arrival count's 6 bits
    assert not gemv_config.fixed_split(1, False, 1)  # one program: nothing to merge
    assert not gemv_config.fixed_split(7, True, 1)  # statistics out (attn-out, mlp-out)
    assert not gemv_config.fixed_split(7, False, 2)  # gpt2 batch 2 -6.0% on the H200
    monkeypatch.setattr(gemv_config, "GEMV_FIXED", "1")
    assert gemv_config.fixed_split(7, False, 16) and not gemv_config.fixed_split(7, True, 16)
    assert not gemv_config.fixed_split(64, False, 1)
    monkeypatch.setattr(gemv_config, "GEMV_FIXED", "0")
    assert not gemv_config.fixed_split(7, False, 1)
