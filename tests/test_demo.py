from fp8jax import _demo as demo


def test_demo_runs_and_fp8_tracks_bf16():
    results = demo.run(["--steps", "30", "--width", "64"])
    bf16, fp8 = results["bf16"][0], results["fp8"][0]
    assert bf16[-1] < bf16[0] and fp8[-1] < fp8[0]
    assert abs(fp8[-1] - bf16[-1]) / bf16[-1] < 0.05
