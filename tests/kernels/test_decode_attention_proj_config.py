import pytest

from kernels.decode_attention_proj_config import (FORCED_EARLY_F32, FORCED_LAYOUT, FUSED, early_f32, forced_early_f32,
                                                  forced_layout, fused_layout)


@pytest.mark.skipif(FORCED_LAYOUT is not None or not FUSED,
                    reason="MINILLM_FUSED_LAYOUT is set or MINILLM_FUSED_ATTN=0")
def test_layout_policy():
    """On an H100's 132 SMs: gpt2 at one row reads its whole cache up front in 8 warps,
    gpt2-xl (175 programs) 128 positions in 8; short caches take a shorter tile (128 positions
    in 8 warps at gpt2's width, 4 at gpt2-medium's); 4 rows, 512-position caches and two rows
    of more than 16 heads (gpt2-large, gpt2-xl) run two kernels; gpt2-large's one row over a
    256-position tile takes 512-column blocks."""
    assert fused_layout(1, 768, 256, 64, 12, sms=132) == (256, 256, 8)
    assert fused_layout(2, 768, 128, 64, 12, sms=132) == (256, 128, 8)
    assert fused_layout(1, 768, 128, 64, 12, sms=132) == (256, 128, 8)
    assert fused_layout(1, 1024, 128, 64, 16, sms=132) == (256, 128, 4)
    assert fused_layout(1, 1600, 256, 64, 25, sms=132) == (256, 128, 8)  # gpt2-xl: WIDE_WARPS_AT_ONE_ROW
    assert fused_layout(1, 1600, 100, 64, 25, sms=132) == (256, 128, 8)
    assert fused_layout(1, 768, 40, 64, 12, sms=132) == (256, 64, 4)
    assert fused_layout(4, 768, 256, 64, 12, sms=132) is None
    assert fused_layout(1, 768, 512, 64, 12, sms=132) is None
    assert fused_layout(2, 1024, 256, 64, 16, sms=132) == (256, 128, 4)
    assert fused_layout(2, 1280, 256, 64, 20, sms=132) is None
    assert fused_layout(2, 1600, 256, 64, 25, sms=132) is None
    # gpt2-large's width at one row: 512 columns over a 256-position tile (WIDE_BLOCK_N), not shorter ones
    assert fused_layout(1, 1280, 256, 64, 20, sms=132) == (512, 256, 8)
    assert fused_layout(1, 1280, 200, 64, 20, sms=132) == (512, 256, 8)
    assert fused_layout(1, 1280, 128, 64, 20, sms=132) == (256, 128, 4)


@pytest.mark.skipif(FORCED_EARLY_F32 is not None, reason="MINILLM_ATTN_EARLY_F32 is set")
def test_early_f32_rule():
    """Keys and values in fp32 before the wait at gpt2's two rows only (EARLY_F32_AT_TWO_ROWS)."""
    assert early_f32(2, 768) == 3
    assert early_f32(1, 768) == 0
    assert early_f32(2, 1024) == 0
    assert early_f32(1, 1600) == 0


@pytest.mark.parametrize("text,expect", [(None, None), ("", None), ("0", 0), ("7", 7)])
def test_forced_early_f32(text, expect):
    assert forced_early_f32(text) == expect


@pytest.mark.parametrize("text", ["8", "-1", "kv", "3.0"])
def test_forced_early_f32_bad(text):
    with pytest.raises(ValueError, match="MINILLM_ATTN_EARLY_F32: expected 0 to 7"):
        forced_early_f32(text)


@pytest.mark.parametrize("text,expect", [(None, None), ("", None), ("512x256x8", (512, 256, 8))])
def test_forced_layout(text, expect):
    assert forced_layout(text) == expect


@pytest.mark.parametrize("text", ["512,256,8", "512x256", "512x256x6", "0x256x8", "ax256x8"])
def test_forced_layout_bad(text):
    with pytest.raises(ValueError, match="MINILLM_FUSED_LAYOUT: expected BLOCK_NxBLOCK_LxWARPS"):
        forced_layout(text)
