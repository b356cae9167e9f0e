#!/usr/bin/env bash
# One batch of GPU work for the device machine; everything lands in $OUT as one tarball
# (results.tgz: the device tool returns at most 8 files a call).
# Stage times on an H200 (session 174): bench-ttft ~37 s, profile-ttft ~19 s, bench-generate
# ~113 s, bench-xl ~158 s, bench-again ~85 s (the goal run, all five: ~412 s); kernel-tests ~300 s,
# rest-tests ~170 s (the whole suite, ~470-545 s, no longer fits one call beside anything else);
# checks ~385 s (116th), coldwarm ~50 s, profile ~95 s.
# A call holds at most 600 s: every stage's timeout is cut to what is left of CALL_CAP_S (585 s)
# since the script started, and a stage with under 30 s left is skipped.
#   MINILLM_GIT_REV=<commit> bash scripts/gpu_session.sh bench-ttft profile-ttft bench-generate bench-xl bench-again
#   MINILLM_GIT_REV=<commit> bash scripts/gpu_session.sh kernel-tests    # then, in a second call, rest-tests
set -u
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export MINILLM_TOKENIZER_DIR=$PWD/.gpu_assets/gpt2-tokenizer
STAGES="tests kernel-tests rest-tests runtime-tests compile bench-kernels checks sweeps stages
  bench-generate bench-xl bench-ttft bench-again bench-stream ab-read-lag profile-ttft quick profile coldwarm"
[ $# -gt 0 ] || { echo "usage: gpu_session.sh STAGE... (stages:" $STAGES")" >&2; exit 2; }
for stage in "$@"; do
  case " $(echo $STAGES) " in *" $stage "*) ;;
    *) echo "gpu_session.sh: unknown stage '$stage' (expected one of:" $STAGES")" >&2; exit 2 ;; esac
done
t0=$(date +%s); CAP=${CALL_CAP_S:-585}
cap() { local left=$(( CAP - $(date +%s) + t0 )); echo $(( $1 < left ? $1 : left )); }  # a stage's timeout
OUT=${OUT:-/tmp/minillm-gpu}
R=$(mktemp -d)/results
mkdir -p "$R" "$OUT"
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,uuid --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  python3 -c "from minillm.own_kernels import kernels_conflict; print('kernels package:', kernels_conflict() or 'minillm\'s')"
  echo "git ${MINILLM_GIT_REV:-$(git log -1 --format=%h 2>/dev/null)}"; } > "$R/env.txt" 2>&1
cat "$R/env.txt"
for stage in "$@"; do
  start=$(date +%s)
  if [ "$(cap 600)" -lt 30 ]; then echo "[stage $stage: skipped, under 30 s left of ${CAP} s]"; continue; fi
  case $stage in
    tests|kernel-tests|rest-tests|runtime-tests)  # the whole suite, its two halves for two calls, or runtime/
      case $stage in tests) sel="tests" ;; kernel-tests) sel="tests/kernels" ;; runtime-tests) sel="tests/runtime" ;;
        *) sel="tests --ignore=tests/kernels" ;; esac
      timeout "$(cap 585)" python3 -m pytest $sel -n 12 -q -p no:cacheprovider -rfEs --durations=25 > "$R/gpu-$stage.log" 2>&1
      echo "pytest exit $?"; tail -n 3 "$R/gpu-$stage.log" ;;
    compile) timeout "$(cap 400)" python3 scripts/check_compile.py --models gpt2 gpt2-xl --dtypes float16 --out "$R/compile-sm90a.md" 2>&1 | tail -n 4 ;;
    bench-kernels) timeout "$(cap 400)" python3 scripts/bench_kernels.py --out "$R" 2>&1 | tee "$R/bench-kernels.log" | tail -n 40 ;;
    checks)  # the four presets at full depth, side by side (one engine alive at a time in each)
      for m in gpt2 gpt2-medium gpt2-large gpt2-xl; do
        timeout "$(cap 560)" python3 scripts/gpu_checks.py --models "$m" --out "$R" > "$R/gpu-checks-run-$m.out" 2>&1 & done
      wait; cat "$R"/gpu-checks-gpt2*.md ;;
    sweeps) timeout "$(cap 330)" python3 scripts/bench_gemv.py --out "$R" 2>&1 | grep -v "^    " | tee "$R/bench-gemv.log"
            timeout "$(cap 120)" python3 scripts/bench_decode_attention.py --out "$R" 2>&1 | tee "$R/bench-decode-attention.log" ;;
    stages) timeout "$(cap 300)" python3 scripts/bench_gemv.py --stages 1 2 3 4 --shapes M=64 "lm_head M=1" --out "$R" 2>&1 | grep -v "^    " | tee "$R/bench-gemv-stages.log"
            timeout "$(cap 150)" python3 scripts/bench_decode_attention.py --out "$R" 2>&1 | tee "$R/bench-decode-attention.log" ;;
    bench-generate)
      timeout "$(cap 300)" python3 -m minillm bench --model gpt2 --batch 1 8 64 --out "$R" 2>&1 | tee "$R/bench-gpt2.log" | tail -n 20
      cp "$R"/generate-*.json "$R/gpt2-rows.json" 2>/dev/null ;;
    bench-xl)
      timeout "$(cap 270)" python3 -m minillm bench --model gpt2-xl --batch 1 --out "$R/xl" 2>&1 | tee "$R/bench-xl.log" | tail -n 12 ;;
    bench-ttft)
      timeout "$(cap 200)" python3 -m minillm bench --model gpt2 --batch 1 --prompt-len 1024 --new-tokens 1 --engines minillm hf-sdpa --out "$R/ttft" 2>&1 | tee "$R/bench-ttft.log" | tail -n 6 ;;
    bench-again)  # gpt2 batch 1 and 64 once more: a second sample on the same machine
      timeout "$(cap 200)" python3 -m minillm bench --model gpt2 --batch 1 64 --out "$R/again" 2>&1 | tee "$R/bench-again.log" | tail -n 16 ;;
    bench-stream)  # what reading every step back costs: minillm's generate against its streaming
      timeout "$(cap 150)" python3 -m minillm bench --model gpt2 --batch 1 8 --engines minillm minillm-stream --out "$R/stream" 2>&1 | tee "$R/bench-stream.log" | tail -n 12 ;;
    ab-read-lag)  # the host reading each step's ids as it ends against READ_LAG steps behind
      timeout "$(cap 200)" python3 scripts/ab_read_lag.py --rounds 5 2>&1 | tee "$R/ab-read-lag.log" | tail -n 16 ;;
    profile-ttft)
      timeout "$(cap 100)" python3 scripts/profile_ttft.py --model gpt2 --prompt-len 1024 --repeats 50 --out "$R/prof" > "$R/profile-ttft.log" 2>&1
      tail -n 5 "$R/profile-ttft.log" ;;
    quick)  # minillm alone, programmatic dependent launch on and off (A/B in one run)
      for pdl in 1 0; do
        MINILLM_PDL=$pdl timeout "$(cap 200)" python3 -m minillm bench --model gpt2 --batch 1 64 --engines minillm --repeats 3 --out "$R/quick-pdl$pdl" 2>&1 | tail -n 4
      done
      timeout "$(cap 200)" python3 -m minillm bench --model gpt2-xl --batch 1 --engines minillm --repeats 3 --out "$R/quick-xl" 2>&1 | tail -n 3 ;;
    profile)  # critical-path shares of CUDA-graph replays, as in the README's table
      for mb in "gpt2 1" "gpt2 64" "gpt2-xl 1"; do read -r m b <<< "$mb"
        timeout "$(cap 120)" python3 scripts/profile_decode.py --model "$m" --batch "$b" --graph --out "$R" 2>&1 | tail -n 14; done ;;
    coldwarm)
      mkdir -p /tmp/cw && python3 -c "
import sys; sys.path.insert(0, '.')
from tests.models import build_checkpoint; build_checkpoint('/tmp/cw/m', n_layer=12, n_head=12, n_embd=768, vocab_size=50257, n_positions=1024, with_tokenizer=False)" >/dev/null 2>&1
      cp .gpu_assets/gpt2-tokenizer/* /tmp/cw/m/ 2>/dev/null || true
      rm -rf ~/.triton/cache  # cold: no compiled kernels, no autotune results
      for run in cold warm; do
        s=$(date +%s%N); python3 -m minillm generate --model /tmp/cw/m --greedy --max-new-tokens 32 "Hello" > /dev/null 2>> "$R/coldwarm.log"
        echo "$run process start-to-finish: $(( ($(date +%s%N) - s) / 1000000 )) ms" | tee -a "$R/coldwarm.log"
      done ;;
  esac
  echo "[stage $stage: $(( $(date +%s) - start )) s]"
done
tar czf "$OUT/results.tgz" -C "$(dirname "$R")" results
