#!/usr/bin/env python3
"""Host time per call of the public ops (GPU; diagnostic).

For each op, reports the host wall time per call of N calls issued back to back without a
synchronize while the GPU is held busy by a long sleep kernel queued first (so the launches
queue up behind it and the loop measures only the time the Python thread spends in each call:
validation, allocation, launches -- a call that synchronizes shows up as the sleep's length),
the number of CUDA kernels one call launches (torch.profiler), and with ``--cprofile K`` the K
functions with the most cumulative time (cProfile over the N calls).

  python tools/host_time.py [--ops fwd,attn_dist,bwd] [--n 50] [--cprofile 25] [--s-q 4096]
                            [--paths full,fast]
"""
import argparse, cProfile, os, pstats, sys, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import torch  # noqa: E402
import mla_kernels as mk  # noqa: E402


SLEEP_CYCLES = 1_500_000_000  # ~0.8-1 s of GPU time: longer than any timed loop of launches


class _Stages:
    """Wrap the host path's stages with wall-clock timers (inclusive, ns summed per stage)."""

    def __init__(self):
        from mla_kernels import api, dispatch, sm90
        from mla_kernels.common import bwd_host, fastpath, host, kernel_backend, order_host
        self.targets = [(api, "_fast_key"), (fastpath, "lookup"), (api, "check_inputs"), (api, "make_problem"),
                        (api, "_fwd_through_decode"),
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
    ap.add_argument("--paths", default="",
                    help="comma list of 'fast' / 'full': time each op with the host fast path on and with "
                         "MLA_KERNELS_FASTPATH=0 (default: as the environment says)")
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
    paths = [x for x in a.paths.split(",") if x] or [""]
    for op, path in [(o, pth) for o in a.ops.split(",") if o for pth in paths]:
        if path:
            if path not in ("fast", "full"):
                ap.error(f"--paths: 'fast' or 'full', got {path!r}")
            os.environ["MLA_KERNELS_FASTPATH"] = "0" if path == "full" else "1"
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
        print(f"{op + (' ' + path if path else ''):10s} host {min(best):7.1f} us/call (median of 3 loops {sorted(best)[1]:.1f}); "
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
            st = pstats.Stats(pr).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, callers)
            rows = [(tt / a.n * 1e6, ct / a.n * 1e6, nc / a.n, f"{os.path.basename(k[0])}:{k[1]}({k[2]})")
                    for k, (cc, nc, tt, ct, _) in st.items()]
            for title, col in (("self", 0), ("cumulative", 1)):
                print(f"    top {a.cprofile} by {title} time (us per call of the op, under cProfile; calls per op call):")
                for r in sorted(rows, key=lambda r: -r[col])[:a.cprofile]:
                    print(f"      {r[0]:7.2f} self {r[1]:7.2f} cum {r[2]:5.1f}x  {r[3]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
