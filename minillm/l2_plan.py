"""Which decode kernels of the last layers ask L2 for which share of the lm_head's weights, at
one row of gpt2's size (the kernels' l2_ahead, kernels/_l2_ahead.py).

At one row the layers leave the memory bus idle most of the time (gpt2: about 40 us of weight
bytes in 116 us of layers), while the lm_head is a 77 MB stream that nothing overlaps. A kernel
of the last layers may ask L2 for the head's first columns, which the head's first programs
read; the shares follow one another in the head's byte order.

A plan is a list of (role, layer, MB): role one of ROLES, layer counted from the end (-1: the
last), MB the share's size. MINILLM_L2_LM_PLAN='attn@-1=16,mlp-out@-1=4' sets one (A/B
timing); 'none' asks for nothing.
"""
import os

ROLES = ("qkv", "attn", "mlp-out")  # qkv, the fused attention launch, mlp-out
# the last mlp-out asks for the head's first 4 MB: +1.2% at gpt2 batch 1, 16 MB -0.3%, none +0.9%
# (H200, one call; bench/results/h200/session-72/)
DEFAULT_PLAN = (("mlp-out", -1, 4.0),)


def parse_plan(value, name="MINILLM_L2_LM_PLAN"):
    """'attn@-1=16,mlp-out@-1=4' (or 'none') -> ((role, layer, MB), ...); None -> DEFAULT_PLAN."""
    if value is None:
        return DEFAULT_PLAN
    plan = []
    for item in filter(None, value.replace("+", ",").split(",")):
        if item == "none":
            continue
        try:
            where, mb = item.split("=")
            role, layer = where.split("@")
            layer, mb = int(layer), float(mb)
        except ValueError:
            role = None
        if role not in ROLES or layer >= 0 or mb <= 0:
            raise ValueError(f"{name}: expected none or items role@layer=MB split by commas (role one of "
                             f"{', '.join(ROLES)}, layer < 0 from the end, MB > 0), got {value!r}")
        if any(p[:2] == (role, layer) for p in plan):
            raise ValueError(f"{name}: {role}@{layer} given twice in {value!r}")
        plan.append((role, layer, mb))
    return tuple(plan)


PLAN = parse_plan(os.environ.get("MINILLM_L2_LM_PLAN"))


def head_shares(head, n_layer, plan=None):
    """{(role, layer index): share} for an out-major lm_head view (C, V): each share a slice of
    its columns, dense (l2_ahead's requirement), the shares in plan order from column 0. A plan's
    layers before the first are left out; a share past the head's end is empty and left out."""
    C, V = head.shape
    shares, col = {}, 0
    for role, layer, mb in PLAN if plan is None else plan:
        cols = max(1, int(mb * (1 << 20)) // (C * head.element_size()))
        end = min(V, col + cols)
        if n_layer + layer >= 0 and end > col:
            shares[(role, n_layer + layer)] = head[:, col:end]
        col = end
    return shares
