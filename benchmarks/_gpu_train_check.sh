# One device call for the trainer: GPU tests of the kernels its fp8 step runs (TESTS, a -k
# expression; empty to skip), then an interleaved bf16-vs-fp8 compare of a preset (PRESET,
# STEPS, CHUNK) with the GPU's clock, power, temperature and throttle reasons logged every
# second, and per-window step times. Outputs under $OUT (at most 8 files).
#   STEPS=400 CHUNK=50 bash benchmarks/_gpu_train_check.sh
export PYTHONPATH=$PWD/src:$PWD:$PWD/tests PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${MEM_FRACTION:-0.9}
PRESET=${PRESET:-1b}; STEPS=${STEPS:-400}; CHUNK=${CHUNK:-50}; EVAL=${EVAL:-100}
TESTS=${TESTS-gated_mlp_core and (swiglu or reglu) or fused_mlp_train_step or linear_train_step}
RUN=/tmp/fp8jax-run
python -c "import jax; print(jax.__version__, jax.devices()[0].device_kind)"
nvidia-smi -q -d PERFORMANCE,POWER,TEMPERATURE > $OUT/gpu_before.txt
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active,utilization.gpu \
  --format=csv,noheader -l 1 > $OUT/smi.csv &
SMI=$!
if [ -n "$TESTS" ]; then
  timeout ${TEST_TIMEOUT:-240} python -m pytest -q tests/test_gpu.py -k "$TESTS" -p no:cacheprovider 2>&1 | tail -12
fi
timeout ${TRAIN_TIMEOUT:-560} python -m fp8jax.train --preset $PRESET --compare --interleave $CHUNK --steps $STEPS \
  --eval-every $EVAL --eval-batches 4 --checkpoint-every 0 --quiet --out $RUN --record $OUT/train.jsonl ${TRAIN_ARGS} 2>&1 | tail -12
kill $SMI
nvidia-smi -q -d PERFORMANCE,POWER,TEMPERATURE > $OUT/gpu_after.txt
cp $RUN/metrics.csv $RUN/summary.md $OUT/ 2>/dev/null; cp $RUN/loss.png $OUT/ 2>/dev/null
python - "$RUN/metrics.csv" "$OUT/smi.csv" <<'PY'
import csv, statistics, sys
rows = [r for r in csv.DictReader(open(sys.argv[1])) if r["step_s"]]
win = max(int(r["step"]) for r in rows) // 5 or 1
print(f"median ms/step per window of {win} steps (interleaved, same GPU state)")
by = {}
for r in rows:
    by.setdefault((int(r["step"]) - 1) // win, {}).setdefault(r["precision"], []).append(1e3 * float(r["step_s"]))
for w, d in sorted(by.items()):
    m = {p: statistics.median(v) for p, v in d.items()}
    ratio = m["bf16"] / m["fp8"] if len(m) == 2 else float("nan")
    print(f"  steps {w * win + 1:>5}-{(w + 1) * win:<5} " + "  ".join(f"{p} {v:7.1f}" for p, v in m.items())
          + f"  ratio {ratio:.3f}x")
smi = [line.split(", ") for line in open(sys.argv[2]) if line.count(",") >= 5]
busy = [s for s in smi if s[5].strip().startswith(("9", "100"))]
if busy:
    clock = [float(s[1].split()[0]) for s in busy]; watts = [float(s[2].split()[0]) for s in busy]
    print(f"GPU busy seconds {len(busy)}: SM clock mean {statistics.mean(clock):.0f} MHz (min {min(clock):.0f}), "
          f"power mean {statistics.mean(watts):.0f} W (max {max(watts):.0f}), temp {busy[0][3]}->{busy[-1][3]} C")
PY
grep -A3 -i "SW Power Capping\|Clocks Event Reasons Counters\|Throttle" $OUT/gpu_after.txt | head -12
cat $RUN/summary.md
