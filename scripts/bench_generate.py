"""Tokens/s of minillm against transformers (eager, sdpa) and a torch.compile peer, on a GPU.

The same as `minillm bench` (see `minillm bench --help` for every option):

    python3 scripts/bench_generate.py --model gpt2 gpt2-xl --batch 1 8 64 --out bench/results
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minillm.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
