"""The `minillm` command: generate, download, bench.

Exit codes: 0 ok; 2 bad usage (argparse, invalid values); 1 runtime error, one line on stderr
(the traceback only with --verbose).
"""
import argparse
import math
import os
import sys

from .checks import UnappliedSettingsWarning, count
from .sampling import GENERATION_FIELDS, SEED_END, SEED_MIN, settings_text

EPILOG_MAIN = """examples:
  minillm generate --model gpt2 "The meaning of life is"
  minillm generate --model ./weights/gpt2 --greedy --max-new-tokens 50 "Once upon a time"
  echo "Hello" | minillm generate --model gpt2 -
  minillm download gpt2
  minillm bench --model gpt2 --batch 1 8 64
"""

EPILOG_GENERATE = """examples:
  minillm generate --model gpt2 "The meaning of life is"
  minillm generate --model gpt2 --temperature 0.8 --top-p 0.95 --seed 1 -n 4 "In a hole in the ground"
  minillm generate --model gpt2 --greedy --stop "." "Paris is" "Rome is"
  cat prompt.txt | minillm generate --model weights/gpt2-xl --dtype bfloat16 -

One prompt streams its text as it is generated; several prompts (or -n N samples) run as one
batch and print when done. A summary line goes to stderr: prompt tokens, new tokens, time to
first token, decode tokens/s. Settings not given on the command line are the model's, where its
generation_config.json names them (as transformers' generate takes them; do_sample false there
means greedy); stderr says which were taken from it, and names the file's settings that
transformers would apply and minillm does not (num_beams, no_repeat_ngram_size, ...).
"""


class UsageError(Exception):
    pass


def _int_at_least(lo, below=None, range_text=None):
    """argparse type: an int >= lo (and < below, said as range_text), argparse naming the option in
    its message."""
    def parse(s):
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
        if v < lo or (below is not None and v >= below):
            rng = f">= {lo}" if below is None else f"in {range_text}"
            raise argparse.ArgumentTypeError(f"expected an integer {rng}, got {v}")
        return v
    return parse


def _number(lo=None, hi=None, lo_open=False):
    """argparse type: a float in the given range (argparse names the option in its message)."""
    def parse(s):
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
        if not math.isfinite(v) or (lo is not None and (v <= lo if lo_open else v < lo)) or (hi is not None and v > hi):
            lo_s = f"> {lo}" if lo_open else f">= {lo}"
            rng = f"in ({lo}, {hi}]" if hi is not None else lo_s
            raise argparse.ArgumentTypeError(f"expected a number {rng}, got {s}")
        return v
    return parse


def build_parser():
    p = argparse.ArgumentParser(prog="minillm", description="A small, fast LLM inference engine on fused Triton "
                                "kernels (GPT-2 family).", epilog=EPILOG_MAIN,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version="minillm 0.1.0")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    g = sub.add_parser("generate", help="generate text from prompts", description="Generate text from one or "
                       "more prompts.", epilog=EPILOG_GENERATE, formatter_class=argparse.RawDescriptionHelpFormatter)
    g.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompt text; '-' reads the prompt from stdin")
    g.add_argument("--model", "-m", default="gpt2", help="local folder, weights/NAME, or hub id (default: gpt2)")
    # default None: the model's generation_config.json, else SamplingParams' default (the help's)
    g.add_argument("--max-new-tokens", type=_int_at_least(1), default=None,
                   help="tokens to generate at most (default: the model's, else 64)")
    g.add_argument("--temperature", type=_number(lo=0), default=None,
                   help="sampling temperature; 0 = greedy (default: the model's, else 1.0)")
    g.add_argument("--top-k", type=_int_at_least(0), default=None, help="keep the k likeliest tokens; "
                   "0 disables (default: the model's, else 50)")
    g.add_argument("--top-p", type=_number(lo=0, hi=1, lo_open=True), default=None,
                   help="nucleus sampling mass in (0, 1] (default: the model's, else 1.0)")
    g.add_argument("--repetition-penalty", type=_number(lo=0, lo_open=True), default=None,
                   help="> 1 discourages repeats (default: the model's, else 1.0)")
    g.add_argument("--seed", type=_int_at_least(SEED_MIN, SEED_END, "[-2**63, 2**64)"), default=None,
                   help="random seed for reproducible samples")
    g.add_argument("--greedy", action="store_true", help="always take the likeliest token (temperature 0)")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT", type=_stop_text,
                   help="stop when TEXT appears (repeatable; not printed)")
    g.add_argument("-n", "--num-samples", type=_int_at_least(1), default=1,
                   help="samples per prompt, run as one batch (default: 1)")
    _add_runtime_args(g)

    d = sub.add_parser("download", help="download a hub model into weights/", description="Download a Hugging "
                       "Face model (config, safetensors, tokenizer) into weights/NAME.",
                       epilog="example:\n  minillm download gpt2\n  minillm download openai-community/gpt2-xl "
                       "--dir /data/models", formatter_class=argparse.RawDescriptionHelpFormatter)
    d.add_argument("name", help="hub id, e.g. gpt2, distilgpt2, openai-community/gpt2-medium")
    d.add_argument("--dir", default=None, help="target folder (default: weights/<name>)")
    d.add_argument("--verbose", action="store_true", help="show tracebacks on errors")

    b = sub.add_parser("bench", help="tokens/s against transformers and torch.compile",
                       description="Decode benchmark: minillm vs transformers (eager, sdpa) and a torch.compile "
                       "peer on the same weights; writes bench/results/generate-<device>.json, a PNG and a table.",
                       epilog="examples:\n  minillm bench --model gpt2 --batch 1 8 64\n"
                       "  minillm bench --model gpt2-xl --batch 1 --engines minillm torch-compile\n"
                       "  minillm bench --model gpt2 --batch 1 --prompt-len 1024 --new-tokens 1 --engines minillm\n"
                       "  minillm bench --model gpt2 --batch 1 64 --temperature 1 --top-k 50   # sampled, as generate's "
                       "default",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("--model", nargs="+", default=["gpt2"], help="preset names (random weights: gpt2, gpt2-medium, "
                   "gpt2-large, gpt2-xl, distilgpt2) or checkpoint folders (default: gpt2)")
    b.add_argument("--batch", nargs="+", type=_int_at_least(1), default=[1, 8, 64],
                   help="batch sizes (default: 1 8 64)")
    b.add_argument("--prompt-len", type=_int_at_least(1), default=32, help="prompt tokens (default: 32)")
    b.add_argument("--new-tokens", type=_int_at_least(1), default=128,
                   help="tokens generated per sequence (default: 128)")
    b.add_argument("--engines", nargs="+", default=["minillm", "hf-eager", "hf-sdpa", "torch-compile"],
                   choices=["minillm", "minillm-stream", "hf-eager", "hf-sdpa", "torch-compile"],
                   help="engines to run (default: all but minillm-stream, minillm reading each step's ids back "
                   "as streaming does)")
    b.add_argument("--repeats", type=_int_at_least(1), default=3, help="timed runs after the cold one (default: 3)")
    b.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"],
                   help="weights and activations dtype for every engine (default: float16)")
    b.add_argument("--temperature", type=_number(lo=0), default=0.0,
                   help="0: greedy decoding (default); > 0 samples, in every engine")
    b.add_argument("--top-k", type=_int_at_least(0), default=None,
                   help="with --temperature > 0: keep the k likeliest tokens, 0 disables (default: 50)")
    b.add_argument("--top-p", type=_number(lo=0, hi=1, lo_open=True), default=None,
                   help="with --temperature > 0: nucleus sampling mass in (0, 1] (default: 1.0)")
    b.add_argument("--out", default="bench/results", help="results folder (default: bench/results)")
    b.add_argument("--verbose", action="store_true", help="show tracebacks on errors")
    for sp in sub.choices.values():  # a command's usage errors print that command's usage
        sp.set_defaults(usage_error=sp.error)
    return p


def _stop_text(s):
    """argparse type for --stop: text that can appear in the output (an empty one would stop at once)."""
    if not s:
        raise argparse.ArgumentTypeError("expected non-empty text")
    return s


def _add_runtime_args(p):
    p.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default=None,
                   help="weights dtype (default: float16 on CUDA, float32 on CPU)")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("--backend", choices=["triton", "torch"], default=None,
                   help="kernels: triton (default on CUDA) or torch (default on CPU)")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="launch every kernel of each decode step from Python instead of replaying a captured "
                        "CUDA graph: the same tokens, but host-bound and about 40x slower (gpt2 batch 1 on an "
                        "H200: 157-203 tok/s against 8,600); for debugging")
    p.add_argument("--verbose", action="store_true", help="show tracebacks and load details")


def _taken_text(taken):
    """'top-k 9, temperature 0 (greedy)': the settings taken from the model, as flags name them;
    15 figures, so a value prints as the file wrote it (1000000, 0.123456789), not rounded."""
    return ", ".join(f"{k.replace('_', '-')} {v:.15g}" + (" (greedy)" if k == "temperature" and v == 0 else "")
                     for k, v in taken.items())


def _read_stdin():
    """stdin's text, decoded as UTF-8 whatever the locale; bytes that are not UTF-8 are an error."""
    data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read()
    if isinstance(data, str):
        return data
    try:
        return data.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")  # as text mode reads it
    except UnicodeDecodeError as e:
        raise UsageError(f"PROMPT: expected UTF-8 text; stdin ('-') is not (byte {e.start})") from None


def cmd_generate(args):
    if args.prompts.count("-") > 1:
        raise UsageError("PROMPT: '-' (read from stdin) may appear once")
    if "-" in args.prompts and sys.stdin.isatty():
        print("[minillm] reading the prompt from stdin; end it with Ctrl-D", file=sys.stderr)
    prompts = [_read_stdin() if p == "-" else p for p in args.prompts]
    for i, (arg, p) in enumerate(zip(args.prompts, prompts)):
        where = "stdin ('-')" if arg == "-" else f"prompt {i + 1}"
        if not p.strip():
            raise UsageError(f"PROMPT: expected non-empty text; {where} is empty")
        try:
            p.encode("utf-8")  # undecodable argv bytes arrive as lone surrogates
        except UnicodeEncodeError as e:
            raise UsageError(f"PROMPT: expected UTF-8 text; {where} is not (character {e.start})") from None
    import warnings  # torch and the engine load only once the arguments are known to be good

    from .api import LLM

    given = {name: getattr(args, name) for name in GENERATION_FIELDS if getattr(args, name) is not None}
    if args.greedy:
        given["temperature"] = 0.0
    with warnings.catch_warnings():
        if not args.verbose:
            warnings.simplefilter("ignore")
        # the unapplied generation_config.json settings get their own stderr line below
        warnings.simplefilter("ignore", UnappliedSettingsWarning)
        llm = LLM(args.model, device=args.device, dtype=args.dtype, backend=args.backend,
                  cuda_graphs=False if args.no_cuda_graphs else None)
    if llm.tokenizer is None:
        raise RuntimeError(f"{llm.model_dir}: no tokenizer files (tokenizer.json, or vocab.json and merges.txt), "
                           "so text prompts cannot be encoded")
    print(f"[minillm] {llm!r}", file=sys.stderr)
    taken = {k: v for k, v in llm.sampling_defaults.items() if k not in given}
    if taken:
        print(f"[minillm] from the model's generation_config.json: {_taken_text(taken)}", file=sys.stderr)
    if llm.unapplied_settings:
        print(f"[minillm] not applied from the model's generation_config.json (transformers' generate would): "
              f"{settings_text(llm.unapplied_settings)}", file=sys.stderr)
    params = llm.default_params(**given, seed=args.seed, stop=args.stop)
    batch = [p for p in prompts for _ in range(args.num_samples)]
    if len(batch) == 1:
        for piece in llm.stream(batch[0], params):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        results = [llm.last_result]
    else:
        results = llm.generate(batch, params)
        for i, r in enumerate(results):
            head = f"--- prompt {i // args.num_samples + 1}" + (f", sample {i % args.num_samples + 1}"
                                                                 if args.num_samples > 1 else "")
            print(f"{head} ({r.finish_reason}) ---\n{batch[i]}{r.text}")
        sys.stdout.flush()  # here, where a reader that left is handled (main), not at exit
    m = results[0].metrics
    n_prompt = sum(r.metrics["prompt_tokens"] for r in results)
    n_new = sum(r.metrics["new_tokens"] for r in results)
    rate = m["decode_tok_s"] * len(results)
    decode = "no decode step" if math.isnan(rate) else f"decode {rate:,.1f} tokens/s"
    print(f"[minillm] {count(n_prompt, 'prompt token')}, {count(n_new, 'new token')}, time to first token "
          f"{m['ttft_s'] * 1e3:.1f} ms, {decode} ({llm.backend} on {llm.device})", file=sys.stderr)
    return 0


def cmd_download(args):
    from .loader import WEIGHTS_DIR, download

    target = args.dir or str(WEIGHTS_DIR / args.name.split("/")[-1])
    path = download(args.name, local_dir=target)
    print(f"downloaded {args.name} to {path}")
    return 0


def cmd_bench(args):
    from .sampling import SamplingParams  # (no torch): its defaults are generate's

    sampling = None
    if args.temperature > 0:
        sampling = dict(temperature=args.temperature,
                        top_k=SamplingParams.top_k if args.top_k is None else args.top_k,
                        top_p=SamplingParams.top_p if args.top_p is None else args.top_p)
    elif args.top_k is not None or args.top_p is not None:
        raise UsageError("--top-k/--top-p: expected --temperature > 0 with them (temperature 0 is greedy)")
    import torch

    from .bench import bench, check_models, summary, write

    check_models(args.model, args.prompt_len, args.new_tokens)  # argument errors first, GPU or not
    if not torch.cuda.is_available():
        raise RuntimeError("bench: needs a CUDA GPU (none is available)")
    rows = bench(models=args.model, batches=args.batch, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                 engines=args.engines, repeats=args.repeats, dtype=getattr(torch, args.dtype), sampling=sampling,
                 log=lambda s: print(s, file=sys.stderr))
    path = write(rows, args.out)
    print(summary(rows))
    print(f"wrote {path}", file=sys.stderr)
    return 0


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        return {"generate": cmd_generate, "download": cmd_download, "bench": cmd_bench}[args.command](args)
    except UsageError as e:
        args.usage_error(str(e))
    except KeyboardInterrupt:
        print("\n[minillm] interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader left (`| head`): stop quietly, as other Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 141  # 128 + SIGPIPE, what a shell reports for a tool the signal ended
    except Exception as e:  # one clear line; the traceback only when asked for
        if getattr(args, "verbose", False):
            raise
        msg = _friendly(e)
        print(f"minillm: error: {msg}", file=sys.stderr)
        return 2 if isinstance(e, ValueError) and not _is_runtime_value_error(e) else 1


def _is_runtime_value_error(e):
    from .checks import ContextLengthError

    return isinstance(e, ContextLengthError)


def _friendly(e):
    import torch

    if isinstance(e, torch.cuda.OutOfMemoryError):
        return "CUDA out of memory: " + str(e).splitlines()[0]
    return str(e).splitlines()[0] if str(e) else type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
