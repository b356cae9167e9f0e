"""Counts and ranges of the committed generation-benchmark records, so the README's goal table
and run counts can be checked against the files instead of kept by hand.

Reads every `generate-*.json` under `ROOT/session-N/` (each call's own rows and its `again/`,
`xl/` and `ttft/` runs) for the sessions asked, and groups minillm's rows by what they measure:
gpt2 at batch 1, 8 and 64 with a 32-token prompt, gpt2-xl at batch 1, and the TTFT of a
1024-token prompt. For each group it prints how many runs there are and the lowest and highest
value (with its session) of minillm's tok/s, floor fraction and step, and of every baseline in
the same file with minillm's ratio against it. Then, for each goal of issue 5, how many runs
measured it and met it, as `minillm bench` marks them; a ratio against transformers also against
the fastest baseline host among those runs, which is how the README's goal table counts it.

Runs that reached no JSON (a call cut short, or files one stage overwrote) are not counted here;
the session's README says which they are. Nor are `bench-stream`'s records (a `stream/` folder):
they time minillm's streaming against its own `generate`, with no baseline, and are no goal run.

    python3 scripts/record_ranges.py --root bench/results/h100 --sessions 182-238
    python3 scripts/record_ranges.py --root bench/results/h200 --sessions 132-218
"""
import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minillm.targets import TARGETS, find_row, peer_engines, setting, target_rows  # noqa: E402

SESSION_DIR = re.compile(r"session-(\d+)$")
NOT_GOAL_RUNS = "stream"  # gpu_session.sh's bench-stream folder


def session_range(text):
    m = re.fullmatch(r"(\d+)(?:-(\d+))?", text)
    if m is None:
        raise argparse.ArgumentTypeError(f"expected a session number or a range like 182-238, got {text!r}")
    first = int(m.group(1))
    last = int(m.group(2)) if m.group(2) else first
    if last < first:
        raise argparse.ArgumentTypeError(f"the range {text!r} ends before it starts")
    return first, last


def group_of(row):
    """The goal-table group a minillm row belongs to, or None for shapes the table leaves out."""
    if row["prompt_len"] == 1024:
        return "TTFT, 1024-token prompt"
    if row["prompt_len"] != 32:
        return None
    return f"{row['model']} batch {row['batch']}"


def group_order(group):
    """gpt2 before gpt2-xl, batches in numeric order, TTFT last."""
    if group.startswith("TTFT"):
        return 1, "", 0
    model, _, batch = group.split()
    return 0, model, int(batch)


def load_runs(root, first, last):
    """[(session, rows)] for every goal run's `generate-*.json` of the sessions asked, in order."""
    runs = []
    for session_dir in sorted(root.iterdir()):
        m = SESSION_DIR.search(session_dir.name)
        if m is None or not session_dir.is_dir() or not first <= int(m.group(1)) <= last:
            continue
        for path in sorted(session_dir.rglob("generate-*.json")):
            if NOT_GOAL_RUNS in path.relative_to(session_dir).parts[:-1]:
                continue
            try:
                runs.append((int(m.group(1)), json.loads(path.read_text())))
            except json.JSONDecodeError as e:
                raise SystemExit(f"error: {path} is not valid JSON ({e})") from None
    return runs


def collect(runs):
    """{group: {measure: [(value, session), ...]}} and the GPU ids that ran them (None stands for
    rows written before the benchmark recorded the GPU's id)."""
    groups = defaultdict(lambda: defaultdict(list))
    gpus = set()
    for session, rows in runs:
        peers = peer_engines(rows)
        for row in rows:
            if row["engine"] != "minillm" or "error" in row or (group := group_of(row)) is None:
                continue
            gpus.add((row.get("gpu_uuid") or "")[:8] or None)
            measures = groups[group]
            if row["prompt_len"] == 1024:
                measures["minillm TTFT ms"].append((row["ttft_ms"], session))
            else:
                measures["minillm tok/s"].append((row["tok_s"], session))
                measures["floor fraction"].append((row["floor_fraction"], session))
                measures["step us"].append((row["step_ms"] * 1e3, session))
            for peer in peers:
                if (other := find_row(rows, peer, *setting(row))) is None:
                    continue
                if row["prompt_len"] == 1024:
                    measures[f"{peer} TTFT ms"].append((other["ttft_ms"], session))
                else:
                    measures[f"{peer} tok/s"].append((other["tok_s"], session))
                    measures[f"minillm / {peer}"].append((row["tok_s"] / other["tok_s"], session))
    return groups, gpus


def goal_tally(runs, targets=TARGETS):
    """[(target, runs that measured it, runs that met it, fastest)]: met by the rule `minillm
    bench` marks it with (`Target.met_by`), against the run's own rows. For a ratio against
    transformers, whose speed is its host's, fastest is (baseline tok/s, session, runs that meet
    the goal against it) for the fastest baseline host among these runs, the README's yardstick;
    None for the other goals."""
    tally = []
    for t in targets:
        measured = []  # (session, met, minillm tok/s, baseline tok/s)
        for session, rows in runs:
            if (pair := target_rows(rows, t)) is None:
                continue
            mine, peer = pair
            met = t.met_by(t.value(mine, peer))
            measured.append((session, met, mine["tok_s"], peer["tok_s"] if peer else None))
        if not measured:
            continue
        fastest = None
        if t.kind == "ratio" and t.against.startswith("hf-"):
            top, top_session = max((peer, session) for session, _, _, peer in measured)
            fastest = top, top_session, sum(t.met_by(mine / top) for _, _, mine, _ in measured)
        tally.append((t, len(measured), sum(met for _, met, _, _ in measured), fastest))
    return tally


def fmt(value):
    if value >= 1000:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.4g}" if value < 1 else f"{value:.3f}"


def report(groups, gpus, first, last, tally=()):
    named = len(gpus - {None})
    unnamed = ", and rows that name no GPU" if None in gpus else ""
    lines = [f"Sessions {first}-{last}: {named} GPU{'s' * (named != 1)}{unnamed}", ""]
    for group in sorted(groups, key=group_order):
        measures = groups[group]
        runs = len(next(iter(measures.values())))
        lines += [f"## {group}: {runs} run{'s' * (runs != 1)}", "",
                  "| measure | low (session) | high (session) | rows |", "|---|---|---|---|"]
        for name, values in measures.items():
            (lo, s_lo), (hi, s_hi) = min(values), max(values)
            lines.append(f"| {name} | {fmt(lo)} ({s_lo}) | {fmt(hi)} ({s_hi}) | {len(values)} |")
        lines.append("")
    if tally:
        lines += ["## Goals of issue 5 (`minillm/targets.py`)", "",
                  "| goal | runs | met | met against the fastest baseline host among them |", "|---|---|---|---|"]
        for t, runs, met, fastest in tally:
            against = "-"
            if fastest is not None:
                top, top_session, top_met = fastest
                against = f"{top_met} ({t.against} {fmt(top)} tok/s, session {top_session})"
            lines.append(f"| {t.name} | {runs} | {met} | {against} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", type=Path, default=Path("bench/results/h100"),
                   help="folder holding session-N/ record folders (default: bench/results/h100)")
    p.add_argument("--sessions", type=session_range, default=(0, 10**9),
                   help="one session or an inclusive range, e.g. 182-238 (default: all)")
    args = p.parse_args(argv)
    if not args.root.is_dir():
        p.error(f"--root: {args.root} is not a folder")
    first, last = args.sessions
    runs = load_runs(args.root, first, last)
    groups, gpus = collect(runs)
    if not groups:
        p.error(f"--sessions: no generate-*.json records under {args.root} for sessions {first}-{last}")
    print(report(groups, gpus, first, last, goal_tally(runs)))


if __name__ == "__main__":
    sys.exit(main())
