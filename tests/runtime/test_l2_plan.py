"""The lm_head's L2 shares (minillm/l2_plan.py): the plan's syntax and the shares' columns."""
import pytest
import torch

from minillm.l2_plan import DEFAULT_PLAN, head_shares, parse_plan


def test_parse_plan():
    assert parse_plan(None) == DEFAULT_PLAN
    assert parse_plan("none") == ()
    assert parse_plan("attn@-1=16,mlp-out@-1=4") == (("attn", -1, 16.0), ("mlp-out", -1, 4.0))
    assert parse_plan("qkv@-2=0.5+attn@-1=8") == (("qkv", -2, 0.5), ("attn", -1, 8.0))


@pytest.mark.parametrize("value", ["fc@-1=4", "attn@1=4", "attn@0=4", "attn@-1=0", "attn@-1", "attn=4",
                                   "attn@-1=x", "attn@-1=4,attn@-1=2"])
def test_parse_plan_refuses(value):
    with pytest.raises(ValueError, match=r"^MINILLM_L2_LM_PLAN: "):
        parse_plan(value)


def test_head_shares_follow_the_heads_bytes():
    """Shares are consecutive column slices of the out-major head from column 0, in plan order;
    one past the head's end is cut there, and what lies beyond it or before the first layer is
    left out."""
    C, V = 96, 5000
    head = torch.randn(V, C, dtype=torch.float16).t()  # (C, V), out-major
    per_mb = (1 << 20) // (C * 2)  # 5461 columns a MB
    plan = (("attn", -2, 0.25), ("qkv", -1, 0.5), ("mlp-out", -1, 1.0), ("attn", -1, 1.0), ("qkv", -9, 0.1))
    shares = head_shares(head, 4, plan)
    assert list(shares) == [("attn", 2), ("qkv", 3), ("mlp-out", 3)]
    a, b = per_mb // 4, per_mb // 4 + per_mb // 2
    assert torch.equal(shares[("attn", 2)], head[:, :a])
    assert torch.equal(shares[("qkv", 3)], head[:, a:b])
    assert torch.equal(shares[("mlp-out", 3)], head[:, b:])
    for share in shares.values():
        assert share.t().is_contiguous()
