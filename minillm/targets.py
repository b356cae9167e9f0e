"""Same-run speed ratios of a benchmark's rows, and the decode targets minillm is held to.

A ratio compares minillm with another engine on the rows of one run only (same device, weights,
prompt, token count and dtype): the transformers baselines are bound by Python on the host and
move between runs and machines, so ratios across runs mean little.
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    """One goal: minillm's tok/s at least `goal` times `against`'s (kind "ratio"), its floor
    fraction at least `goal` ("floor"), or its time to first token at most `goal` ms ("ttft"),
    for (model, batch) at `prompt_len` prompt tokens and `new_tokens` new ones, fp16."""
    name: str
    model: str
    batch: int
    kind: str
    goal: float
    against: str | None = None
    prompt_len: int = 32
    new_tokens: int = 128

    def value(self, mine, peer=None):
        """What the goal is about, from minillm's row (and the baseline's, for a ratio)."""
        if self.kind == "ratio":
            return mine["tok_s"] / peer["tok_s"]
        return mine["floor_fraction"] if self.kind == "floor" else mine["ttft_ms"]

    def met_by(self, value):
        return value <= self.goal if self.kind == "ttft" else value >= self.goal


# issue 5 (decode at the speed of memory): prompt 32, 128 new tokens, greedy, fp16, H100 or H200
TARGETS = (
    Target("gpt2 batch 1 >= 40x transformers eager", "gpt2", 1, "ratio", 40, "hf-eager"),
    Target("gpt2 batch 1 >= 4x torch-compile", "gpt2", 1, "ratio", 4, "torch-compile"),
    Target("gpt2 batch 1 floor fraction >= 0.5", "gpt2", 1, "floor", 0.5),
    Target("gpt2-xl batch 1 floor fraction >= 0.7", "gpt2-xl", 1, "floor", 0.7),
    Target("gpt2 batch 64 >= 15x transformers sdpa", "gpt2", 64, "ratio", 15, "hf-sdpa"),
    Target("gpt2 batch 64 >= 3x torch-compile", "gpt2", 64, "ratio", 3, "torch-compile"),
    Target("gpt2 batch 1 TTFT of a 1024-token prompt <= 2 ms", "gpt2", 1, "ttft", 2.0, prompt_len=1024,
           new_tokens=1),
)


def setting(r):
    """What makes two rows comparable: model, batch, prompt, new tokens, dtype, decoding."""
    return r["model"], r["batch"], r["prompt_len"], r["new_tokens"], r.get("dtype"), r.get("decoding", "greedy")


def find_row(rows, engine, model, batch, prompt_len, new_tokens, dtype="float16", decoding="greedy"):
    """The row of `engine` at that setting that measured what is asked (tok/s past one new
    token, TTFT otherwise), or None. The targets are for greedy decoding (rows of runs before
    the benchmark sampled have no "decoding": greedy)."""
    wanted = (model, batch, prompt_len, new_tokens, dtype, decoding)
    for r in rows:
        if "error" in r or r["engine"] != engine or setting(r) != wanted:
            continue
        if new_tokens == 1 or r.get("tok_s"):
            return r
    return None


def peer_engines(rows):
    """The engines other than minillm in the rows, in order of first appearance."""
    return list(dict.fromkeys(r["engine"] for r in rows if r["engine"] != "minillm"))


def target_rows(rows, t):
    """(minillm's row, the baseline's row) for target t (the baseline None for a target with
    none), or None where the run lacks a row the target needs."""
    mine = find_row(rows, "minillm", t.model, t.batch, t.prompt_len, t.new_tokens)
    peer = find_row(rows, t.against, t.model, t.batch, t.prompt_len, t.new_tokens) if t.against else None
    if mine is None or (t.against and peer is None):
        return None
    return mine, peer


def ratios(rows):
    """Markdown table: per setting where minillm decoded, its tok/s over each other engine's of
    the same run (a column per engine in the rows), and its floor fraction."""
    peers = peer_engines(rows)
    lines = ["| model | batch | prompt | new tokens | dtype | minillm tok/s | "
             + "".join(f"x {p} | " for p in peers) + "floor fraction |",
             "|---|---:|---:|---:|---|---:|" + "---:|" * len(peers) + "---:|"]
    for r in rows:
        if r["engine"] != "minillm" or "error" in r or not r.get("tok_s"):
            continue
        over_peers = []
        for peer in peers:
            other = find_row(rows, peer, *setting(r))
            over_peers.append(f"{r['tok_s'] / other['tok_s']:.1f}x" if other else "-")
        cells = [r["model"], r["batch"], r["prompt_len"], r["new_tokens"], r.get("dtype"), f"{r['tok_s']:,.0f}",
                 *over_peers, f"{r['floor_fraction']:.2f}"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) if len(lines) > 2 else ""


def _shown(value, t, digits):
    """value with `digits` decimals, or as many more (up to 6) as it takes for the text to sit on
    the same side of target t's goal as the value: a floor fraction of 0.49979 reads 0.4998, not
    0.500."""
    met = t.met_by(value)
    while digits < 6:
        text = f"{value:.{digits}f}"
        if t.met_by(float(text)) == met:
            break
        digits += 1
    return f"{value:.{digits}f}"


def check(rows, targets=TARGETS):
    """[(target, measured text, met: True / False, or None where this run lacks the rows)]. The
    text carries a digit more than the ratios table, and more where needed, so that a missed
    goal never reads as its goal (a floor fraction of 0.4954 is 0.495, not 0.50; 0.49979 is
    0.4998, not 0.500)."""
    out = []
    for t in targets:
        pair = target_rows(rows, t)
        if pair is None:
            out.append((t, "not in this run", None))
            continue
        mine, peer = pair
        value = t.value(mine, peer)
        met = t.met_by(value)
        if t.kind == "ratio":
            text = f"{_shown(value, t, 2)}x ({mine['tok_s']:,.0f} / {peer['tok_s']:,.0f} tok/s)"
        elif t.kind == "floor":
            text = f"{_shown(value, t, 3)} ({mine['step_ms']:.4f} ms a step)"
        else:
            text = f"{_shown(value, t, 2)} ms ({mine['prefill_tok_s']:,.0f} prefill tok/s)"
        out.append((t, text, met))
    return out


def report(rows):
    """The ratios table and the targets the rows measure, as markdown ("" if neither)."""
    parts = []
    table = ratios(rows)
    if table:
        parts.append("Same-run ratios (minillm tok/s over each engine's):\n\n" + table)
    measured = [(t, text, met) for t, text, met in check(rows) if met is not None]
    if measured:
        lines = ["| target | measured | met? |", "|---|---|---|"]
        lines += [f"| {t.name} | {text} | {'yes' if met else 'no'} |" for t, text, met in measured]
        parts.append("Targets, each against baselines of the same run (transformers' tok/s moves between hosts, "
                     "so a ratio met against a slow one may not hold against a faster one):\n\n" + "\n".join(lines))
    return "\n\n".join(parts)
