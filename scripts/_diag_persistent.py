"""Where the persistent probe's NaN come from: every activation's NaN count and stale tags after one launch."""
import importlib.util, sys, torch
sys.path.insert(0, ".")
spec = importlib.util.spec_from_file_location("bp", "scripts/bench_persistent.py"); bp = importlib.util.module_from_spec(spec); spec.loader.exec_module(bp)
from minillm.config import PRESETS
for model, tn, tk, w, pf in [("gpt2", 16, 1024, 8, False), ("gpt2", 16, 1024, 8, True), ("gpt2-xl", 16, 1024, 8, True)]:
    cfg = PRESETS[model]
    s = bp.Step(cfg, 132, tn, tk, w, 96, "cuda", prefetch=pf)
    s(); torch.cuda.synchronize()
    widths = {"x": cfg.n_embd, "qkv": 3 * cfg.n_embd, "att": cfg.n_embd, "xm": cfg.n_embd, "h": 4 * cfg.n_embd, "logits": cfg.vocab_size}
    ph = {"qkv": 0, "att": 1, "xm": 2, "h": 3, "x": 4}
    shown = 0
    for name, at in sorted(s.acts.items(), key=lambda kv: kv[1]):
        words = s.act[at:at + widths[name[1]]]
        vals, tags = (words & 0xFFFFFFFF).int().view(torch.float32), words >> 32
        want = -1 if name == (0, "x") else (5 * cfg.n_layer + 1 if name[1] == "logits" else 5 * (name[0] - (name[1] == "x")) + ph[name[1]] + 1)
        bad_tag = int((tags != want).sum()) if want >= 0 else 0
        nan = int(vals.isnan().sum()); inf = int(vals.isinf().sum())
        if (nan or bad_tag or inf) and shown < 6:
            idx = torch.nonzero(vals.isnan() | (tags != want) if want >= 0 else vals.isnan()).flatten()[:8].tolist()
            print(model, "prefetch" if pf else "after", name, "nan", nan, "inf", inf, "stale tags", bad_tag, "of", words.numel(), "want tag", want, "first", idx, "maxabs", float(vals[~vals.isnan()].abs().max()) if (~vals.isnan()).any() else None)
            shown += 1
    print(model, "prefetch" if pf else "after", "done; max |x| per layer:", [f"{float(((s.act[s.acts[(i,'x')]:s.acts[(i,'x')]+cfg.n_embd] & 0xFFFFFFFF).int().view(torch.float32)).abs().max()):.2e}" for i in range(0, cfg.n_layer + 1, max(1, cfg.n_layer // 6))], flush=True)
    del s; torch.cuda.empty_cache()
