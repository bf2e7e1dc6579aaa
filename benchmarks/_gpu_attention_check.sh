# One device call: GPU tests of attention, then the attention benchmark (records to $OUT).
export PYTHONPATH=$PWD/src:$PWD:$PWD/tests PYTHONUNBUFFERED=1
python -c "import jax; print(jax.__version__, jax.devices()[0].device_kind)"
python -m pytest -q tests/test_gpu.py -k "attention or mha or cudnn" -p no:cacheprovider 2>&1 | tail -25
timeout ${BENCH_TIMEOUT:-420} python -m benchmarks.attention ${BENCH_ARGS:---iters 5 --reps 3} --out $OUT/attention.jsonl 2>&1 | tail -45
