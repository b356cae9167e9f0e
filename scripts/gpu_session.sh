#!/usr/bin/env bash
# One batch of GPU work for the device machine; everything lands in $OUT as a tarball + summary.
# Stage times on a fresh H200: tests ~330 s (59th session), checks ~385 s (four presets side by side, 116th),
# bench-generate ~120 s, bench-xl ~105 s, bench-ttft ~25 s, coldwarm ~50 s, profile ~95 s; on an
# H100: tests ~250 s, compile ~70 s, bench-generate ~165 s, bench-xl ~165 s, bench-ttft ~40 s.
# A call holds at most 600 s.
#   bash scripts/gpu_session.sh tests bench-kernels    # stages: see the case labels below
set -u
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export MINILLM_TOKENIZER_DIR=$PWD/.gpu_assets/gpt2-tokenizer
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
  case $stage in
    tests) timeout 480 python3 -m pytest tests -n 8 -q -p no:cacheprovider -rfE 2>&1 | tail -n 80 > "$R/gpu-tests.log"
           tail -n 5 "$R/gpu-tests.log" ;;
    kernel-tests) timeout 330 python3 -m pytest tests/kernels -n 8 -q -p no:cacheprovider -rfE 2>&1 | tail -n 80 > "$R/gpu-kernel-tests.log"
           tail -n 5 "$R/gpu-kernel-tests.log" ;;
    runtime-tests) timeout 200 python3 -m pytest tests/runtime -n 4 -q -p no:cacheprovider -rfE 2>&1 | tail -n 60 > "$R/gpu-runtime-tests.log"
           tail -n 5 "$R/gpu-runtime-tests.log" ;;
    compile) timeout 400 python3 scripts/check_compile.py --models gpt2 gpt2-xl --dtypes float16 --out "$R/compile-sm90a.md" 2>&1 | tail -n 4 ;;
    bench-kernels) timeout 400 python3 scripts/bench_kernels.py --out "$R" 2>&1 | tee "$R/bench-kernels.log" | tail -n 40 ;;
    checks)  # the four presets at full depth, side by side (one engine alive at a time in each)
      for m in gpt2 gpt2-medium gpt2-large gpt2-xl; do
        timeout 560 python3 scripts/gpu_checks.py --models "$m" --out "$R" > "$R/gpu-checks-run-$m.out" 2>&1 & done
      wait; cat "$R"/gpu-checks-gpt2*.md ;;
    sweeps) timeout 330 python3 scripts/bench_gemv.py --out "$R" 2>&1 | grep -v "^    " | tee "$R/bench-gemv.log"
            timeout 120 python3 scripts/bench_decode_attention.py --out "$R" 2>&1 | tee "$R/bench-decode-attention.log" ;;
    stages) timeout 300 python3 scripts/bench_gemv.py --stages 1 2 3 4 --shapes M=64 "lm_head M=1" --out "$R" 2>&1 | grep -v "^    " | tee "$R/bench-gemv-stages.log"
            timeout 150 python3 scripts/bench_decode_attention.py --out "$R" 2>&1 | tee "$R/bench-decode-attention.log" ;;
    bench-generate)
      timeout 300 python3 -m minillm bench --model gpt2 --batch 1 8 64 --out "$R" 2>&1 | tee "$R/bench-gpt2.log" | tail -n 20
      cp "$R"/generate-*.json "$R/gpt2-rows.json" 2>/dev/null ;;
    bench-xl)
      timeout 270 python3 -m minillm bench --model gpt2-xl --batch 1 --out "$R/xl" 2>&1 | tee "$R/bench-xl.log" | tail -n 12 ;;
    bench-ttft)
      timeout 200 python3 -m minillm bench --model gpt2 --batch 1 --prompt-len 1024 --new-tokens 1 --engines minillm hf-sdpa --out "$R/ttft" 2>&1 | tee "$R/bench-ttft.log" | tail -n 6 ;;
    quick)  # minillm alone, programmatic dependent launch on and off (A/B in one run)
      for pdl in 1 0; do
        MINILLM_PDL=$pdl timeout 200 python3 -m minillm bench --model gpt2 --batch 1 64 --engines minillm --repeats 3 --out "$R/quick-pdl$pdl" 2>&1 | tail -n 4
      done
      timeout 200 python3 -m minillm bench --model gpt2-xl --batch 1 --engines minillm --repeats 3 --out "$R/quick-xl" 2>&1 | tail -n 3 ;;
    profile)  # critical-path shares of CUDA-graph replays, as in the README's table
      for mb in "gpt2 1" "gpt2 64" "gpt2-xl 1"; do read -r m b <<< "$mb"
        timeout 120 python3 scripts/profile_decode.py --model "$m" --batch "$b" --graph --out "$R" 2>&1 | tail -n 14; done ;;
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
