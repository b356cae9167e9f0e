"""The decode step's launch plan (minillm/decode_plan.py): the early roles by rows, GEMV kind and
width, the L2 requests' caps, and their environment switches."""
import pytest
import torch

import minillm.decode_plan
from kernels._l2_ahead import l2_ranges
from minillm.decode_plan import L2_WIDE_CAP, attention_tma_stages, early_roles, l2_part, mb_from_env, roles_from_env


def test_early_roles_rule_and_its_switch(monkeypatch):
    """The decode linears that launch the next kernel at their start, by rows, GEMV kind and
    model width (early_roles' docstring has the timings), and MINILLM_EARLY_ROLES's values: any of the four
    roles, or none; anything else is one error naming the variable."""
    monkeypatch.setattr(minillm.decode_plan, "EARLY_ROLES_ENV", None)
    assert early_roles(1, cuda_core=True, width=768) == {"fc", "qkv", "mlp-out"}
    assert early_roles(1, cuda_core=False, width=1600) == {"attn-out", "fc", "mlp-out"}
    assert early_roles(4, cuda_core=False, width=768) == {"attn-out", "mlp-out"}
    assert early_roles(8, cuda_core=False, width=1600) == {"qkv", "mlp-out"}
    assert early_roles(9, cuda_core=False, width=768) == early_roles(16, cuda_core=False, width=768) == {"mlp-out"}
    assert early_roles(16, cuda_core=False, width=1280) == {"mlp-out", "attn-out"}
    assert early_roles(16, cuda_core=False, width=1600) == {"attn-out"}
    assert early_roles(16, cuda_core=False, width=1024) == early_roles(16, cuda_core=False, width=64) == frozenset()
    assert early_roles(17, cuda_core=False, width=768) == early_roles(32, cuda_core=False, width=768) == {"qkv"}
    assert early_roles(33, cuda_core=False, width=768) == frozenset()
    assert early_roles(32, cuda_core=False, width=1024) == frozenset()  # gpt2-medium and wider
    assert early_roles(64, cuda_core=False, width=768) == frozenset()
    assert roles_from_env(None) is None
    assert roles_from_env("none") == frozenset() and roles_from_env("") == frozenset()
    assert roles_from_env("fc+qkv") == roles_from_env("qkv,fc") == {"fc", "qkv"}
    monkeypatch.setattr(minillm.decode_plan, "EARLY_ROLES_ENV", roles_from_env("attn-out,qkv"))
    assert early_roles(1, cuda_core=True, width=768) == {"attn-out", "qkv"}
    assert early_roles(64, cuda_core=False, width=1600) == {"attn-out", "qkv"}
    with pytest.raises(ValueError, match=r"^MINILLM_EARLY_ROLES: expected none or roles of qkv, attn-out, fc, "
                                         r"mlp-out split by commas or \+, got 'fc,gelu'$"):
        roles_from_env("fc,gelu")



def test_l2_screen_switch():
    """MINILLM_L2_SCREEN_MB: 4 MB unset, whole MB (0: none) when set, one error naming it otherwise."""
    assert mb_from_env(None) == mb_from_env("") == mb_from_env("4") == 4 << 20
    assert mb_from_env("0") == 0 and mb_from_env("12") == 12 << 20
    for bad in ("-1", "4.5", "four"):
        with pytest.raises(ValueError, match=r"^MINILLM_L2_SCREEN_MB: expected a whole number of MB"):
            mb_from_env(bad)



def test_l2_requests_capped_past_gpt2_width(monkeypatch):
    """Past gpt2's width a layer weight is asked for only up to its first L2_WIDE_CAP bytes (its
    first columns, a dense view: l2_ranges' requirement); at gpt2's width whole."""
    for K, N in [(1600, 6400), (6400, 1600)]:
        w = torch.randn(N, K, dtype=torch.float16).t()  # out-major (K, N)
        part = l2_part(w, 1600)
        assert part.data_ptr() == w.data_ptr() and part.shape[0] == K
        assert L2_WIDE_CAP - K * 2 < part.numel() * 2 <= L2_WIDE_CAP
        assert l2_ranges("t", (part,), part.device)[0][1] == part.numel() * 2
    w = torch.randn(3072, 768, dtype=torch.float16).t()
    assert l2_part(w, 768) is w
    monkeypatch.setattr(minillm.decode_plan, "L2_CAP_ENV", 0)  # MINILLM_L2_AHEAD_MB=0: nothing asked for
    assert l2_ranges("t", (l2_part(w, 768),), w.device)[0][1] == 0


def test_attention_tma_stages_rule():
    """gpt2-medium's width keeps 4 descriptor tiles in flight in the batch bucket of 64 (33-64
    rows); every other width and row count leaves the kernel's 3 (None)."""
    assert attention_tma_stages(33, 1024) == attention_tma_stages(64, 1024) == 4
    assert attention_tma_stages(32, 1024) is None and attention_tma_stages(65, 1024) is None
    assert all(attention_tma_stages(rows, width) is None for rows in (1, 24, 48, 64) for width in (768, 1280, 1600))
