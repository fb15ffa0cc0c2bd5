#!/usr/bin/env python3
"""Issue 14 (GPU, diagnostic only): is the FlashMLA-vs-ours forward gap in the kernel or in the
timing method / clocks?  Alternates, per shape and round, in one process:

  ours-call : tools/bench.py's method (events around each API call, synchronize after each)
  ours-b2b  : the same kernel launched N times back to back between one event pair (no host gap)
  flashmla  : FlashMLA's anchor binary (mean and median of its own N launches)

and samples the SM clock and power with nvidia-smi during each segment.

The same input set is used for every launch (as the binary does).  Measured with it on an H200
(docs/PERF.md, forward section): timed back-to-back, ours is at parity with the binary at h128;
tools/bench.py's per-call method costs ours 2-5%.  ``--sustain S`` first runs each side for S
seconds (ours: untimed calls; the binary: that many seconds of its own warm-up launches), so that
both are timed at the GPU's sustained (power-capped) clock; ``--values small_int`` replaces q / kv
by small integers (operand values change the power, hence the sustained clock).

  python tools/fwd_method_check.py --bin .gpu/anchors/flashmla/bench_sm90 [--rounds 3] [--n 50]
      [--sustain 1.5 --n 250] [--values randn|small_int]
"""
import argparse, math, os, statistics, subprocess, sys, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
sys.path.insert(0, ROOT)
import torch  # noqa: E402
import bench  # noqa: E402
import mla_kernels as mk  # noqa: E402


class Clock:
    def __enter__(self):
        self.p = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                                   "-lms", "20", "-i", "0"], stdout=subprocess.PIPE, text=True)
        return self

    def __exit__(self, *a):
        self.p.terminate()
        out = self.p.communicate()[0]
        vals = [tuple(float(x) for x in l.split(",")) for l in out.splitlines() if l.count(",") == 1]
        vals = [v for v in vals if v[0] > 0]
        if vals:  # the busy samples only (the binary's process start idles the GPU)
            top = max(v[1] for v in vals)
            vals = [v for v in vals if v[1] >= 0.6 * top]
        self.mhz = statistics.median(v[0] for v in vals) if vals else float("nan")
        self.watt = statistics.median(v[1] for v in vals) if vals else float("nan")


def main(argv=None):
    ap = argparse.ArgumentParser(description="Ours per call vs back-to-back vs FlashMLA's sparse prefill binary (GPU).")
    ap.add_argument("--bin", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--shapes", default="128:32768,64:32768,128:8192")
    ap.add_argument("--sustain", type=float, default=0.0, metavar="S",
                    help="seconds of untimed launches before each segment (both sides; default 0)")
    ap.add_argument("--values", choices=("randn", "small_int"), default="randn",
                    help="operand values of q / kv (default randn, as tools/bench.py)")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("fwd_method_check: needs a CUDA GPU (it times the kernels and FlashMLA's binary)")
    dev = torch.device("cuda")
    s_q, topk, d_qk, d_v = 4096, 2048, 576, 512
    print(f"# {torch.cuda.get_device_name(dev)}; n={a.n} launches per segment")
    print("# shape round method ms TFLOPS sm_MHz W")
    for shape in a.shapes.split(","):
        h_q, s_kv = (int(x) for x in shape.split(":"))
        fl = 2 * s_q * h_q * topk * (d_qk + d_v)
        st = bench.make_sets(1, s_q, h_q, topk, d_qk, d_v, s_kv, dev, torch.bfloat16)[0]
        if a.values == "small_int":
            for k in ("q", "kv"):
                st[k] = torch.randint(-3, 4, st[k].shape, device=dev).to(torch.bfloat16)
        sm_scale = 1.0 / math.sqrt(d_qk)
        f = lambda: mk.sparse_mla_fwd(st["q"], st["kv"], st["idx"], sm_scale, d_v)  # noqa: E731
        for _ in range(5):
            f()
        torch.cuda.synchronize()

        def sustain():
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < a.sustain:
                for _ in range(5):
                    f()
                torch.cuda.synchronize()

        b2b_ms = None
        for r in range(a.rounds):
            sustain()
            with Clock() as c:
                ts = []
                for _ in range(a.n):
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record(); f(); e.record(); e.synchronize()
                    ts.append(s.elapsed_time(e))
            ms = statistics.median(ts)
            print(f"h{h_q}-kv{s_kv} {r} ours-call {ms:.4f} {fl / ms / 1e9:.1f} {c.mhz:.0f} {c.watt:.0f}", flush=True)
            sustain()
            with Clock() as c:
                for _ in range(10):
                    f()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                for _ in range(a.n):
                    f()
                e.record(); e.synchronize()
            ms = b2b_ms = s.elapsed_time(e) / a.n
            print(f"h{h_q}-kv{s_kv} {r} ours-b2b {ms:.4f} {fl / ms / 1e9:.1f} {c.mhz:.0f} {c.watt:.0f}", flush=True)
            warm = max(10, math.ceil(a.sustain * 1e3 / b2b_ms)) if a.sustain > 0 else 10
            env = dict(os.environ, BENCH_WARMUP=str(warm), BENCH_ITERS=str(a.n))
            with Clock() as c:
                out = subprocess.run([a.bin, f"{s_q}:{s_kv}:{topk}:{h_q}"], capture_output=True, text=True,
                                     env=env).stdout
            line = [l for l in out.splitlines() if l.startswith(f"{s_q} {s_kv} {topk} {h_q} ")]
            if r == 0:
                print("# binary: " + " | ".join(l for l in out.splitlines() if l.startswith("#"))[:400])
            if line:
                mean_ms, _, med_ms = (float(x) for x in line[0].split()[4:7])
                print(f"h{h_q}-kv{s_kv} {r} flashmla-mean {mean_ms:.4f} {fl / mean_ms / 1e9:.1f} {c.mhz:.0f} "
                      f"{c.watt:.0f}\nh{h_q}-kv{s_kv} {r} flashmla-median {med_ms:.4f} {fl / med_ms / 1e9:.1f}",
                      flush=True)
            else:
                print(f"h{h_q}-kv{s_kv} {r} flashmla FAILED: {out[-300:]}", flush=True)


if __name__ == "__main__":
    main()
