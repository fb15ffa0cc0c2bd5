#!/usr/bin/env python3
"""Host time per call of the public ops (GPU; diagnostic).

For each op, reports the host wall time per call of N calls issued back to back without a
synchronize while the GPU is held busy by a long sleep kernel queued first (so the launches
queue up behind it and the loop measures only the time the Python thread spends in each call:
validation, allocation, launches -- a call that synchronizes shows up as the sleep's length),
the number of CUDA kernels one call launches (torch.profiler), and with ``--cprofile K`` the K
functions with the most cumulative time (cProfile over the N calls).

  python tools/host_time.py [--ops fwd,attn_dist,bwd] [--n 50] [--cprofile 25] [--s-q 4096]
"""
import argparse, cProfile, io, os, pstats, sys, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import torch  # noqa: E402
import mla_kernels as mk  # noqa: E402


SLEEP_CYCLES = 1_500_000_000  # ~0.8-1 s of GPU time: longer than any timed loop of launches


class _Stages:
    """Wrap the host path's stages with wall-clock timers (inclusive, ns summed per stage)."""

    def __init__(self):
        from mla_kernels import api, dispatch, sm90
        from mla_kernels.common import bwd_host, host, kernel_backend, order_host
        self.targets = [(api, "check_inputs"), (api, "make_problem"), (api, "_fwd_through_decode"),
                        (api, "_pad_topk"), (api, "_lse_for"), (dispatch, "select"), (host, "alloc"),
                        (kernel_backend.CuteKernelBackend, "fwd"), (kernel_backend.CuteKernelBackend, "attn_dist"),
                        (kernel_backend.CuteKernelBackend, "bwd"), (sm90.Sm90Backend, "fwd_kernel"),
                        (sm90.Sm90Backend, "attn_dist_kernel"), (bwd_host, "run_bwd"), (bwd_host, "launch"),
                        (order_host, "kv_ordered"), (bwd_host, "natural_columns")]
        self.kernel_mods = [sm90]
        self.totals = {}
        self.saved = []

    def reset(self):
        for k in self.totals:
            self.totals[k] = 0

    def _wrap(self, name, f):
        tot = self.totals
        tot.setdefault(name, 0)

        def w(*args, **kw):
            t0 = time.perf_counter_ns()
            try:
                return f(*args, **kw)
            finally:
                tot[name] += time.perf_counter_ns() - t0
        return w

    def __enter__(self):
        for obj, attr in self.targets:
            f = obj.__dict__.get(attr)
            if f is None:
                continue
            self.saved.append((obj, attr, f))
            setattr(obj, attr, self._wrap(attr, f))
        for mod in self.kernel_mods:  # the compiled kernels' launches
            f = mod.__dict__.get("cached")
            if f is None:
                continue
            self.saved.append((mod, "cached", f))
            setattr(mod, "cached", (lambda f0: lambda key, build: self._wrap("launch", f0(key, build)))(f))
        return self

    def __exit__(self, *exc):
        for obj, attr, f in reversed(self.saved):
            setattr(obj, attr, f)
        self.saved.clear()


def make(s_q, h_q, s_kv, topk, d_qk, dev):
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(s_q, h_q, d_qk, device=dev, dtype=torch.bfloat16, generator=g)
    kv = torch.randn(s_kv, 1, d_qk, device=dev, dtype=torch.bfloat16, generator=g)
    idx = torch.randint(0, s_kv, (s_q, 1, topk), device=dev, dtype=torch.int32, generator=g)
    return q, kv, idx


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default="fwd,attn_dist,bwd")
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--s-q", type=int, default=4096)
    ap.add_argument("--h-q", type=int, default=128)
    ap.add_argument("--s-kv", type=int, default=32768)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--cprofile", type=int, default=0, metavar="K")
    ap.add_argument("--breakdown", action="store_true",
                    help="also time the host stages (inclusive wall time per call, wrappers add ~0.3 us each)")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_time: needs a GPU (the host path launches the kernels)")
        return 0
    dev = torch.device("cuda")
    q, kv, idx = make(a.s_q, a.h_q, a.s_kv, a.topk, 576, dev)
    scale = 576 ** -0.5
    out, _, lse = mk.sparse_mla_fwd(q, kv, idx, scale)
    dout = torch.randn_like(out)
    calls = {
        "fwd": lambda: mk.sparse_mla_fwd(q, kv, idx, scale),
        "attn_dist": lambda: mk.attn_dist(q, kv, idx, lse, scale),
        "bwd": lambda: mk.sparse_mla_bwd(q, kv, out, dout, idx, lse, scale),
    }
    print(f"GPU: {torch.cuda.get_device_name()}; s_q {a.s_q}, h_q {a.h_q}, s_kv {a.s_kv}, topk {a.topk}, d_qk 576")
    for op in [x for x in a.ops.split(",") if x]:
        fn = calls[op]
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        best = []
        for _ in range(3):
            torch.cuda.synchronize()
            torch.cuda._sleep(SLEEP_CYCLES)
            t0 = time.perf_counter()
            for _ in range(a.n):
                fn()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            best.append((t1 - t0) / a.n * 1e6)
        print(f"{op:10s} host {min(best):7.1f} us/call (median of 3 loops {sorted(best)[1]:.1f}); "
              f"{len(kernels)} kernels: {', '.join(k[:48] for k in kernels)}")
        if a.breakdown:
            stages = _Stages()
            with stages:
                torch.cuda.synchronize()
                torch.cuda._sleep(SLEEP_CYCLES)
                stages.reset()
                for _ in range(a.n):
                    fn()
            torch.cuda.synchronize()
            print("    " + "; ".join(f"{k} {v / a.n / 1e3:.1f}" for k, v in stages.totals.items()) + " (us/call)")
        if a.cprofile:
            torch.cuda.synchronize()
            torch.cuda._sleep(SLEEP_CYCLES)
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(a.n):
                fn()
            pr.disable()
            torch.cuda.synchronize()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(a.cprofile)
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(a.cprofile)
            print("\n".join(l for l in s.getvalue().splitlines() if l.strip())[:12000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
