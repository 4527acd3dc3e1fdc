"""A captured step against an eager one, on a GPU (the capture stage of bench/gpu_check.sh).

    python bench/capture_check.py [--dry-run]

For FusedAdamW (fp32; bf16 + int8 moments; bf16 "remainder"; clipped) and ZeroAdamW at
world size 1 on NCCL (stage 1 and 2, clipped), all with capturable=True: two copies of
one model take 3 eager warm-up steps on the same gradients; then one copy's
``opt.step()`` is captured in a CUDA graph and replayed on 20 more gradients while the
other steps eagerly on the same ones. Prints whether the parameters and the state are
the same bits. The same with ``torch.compile(model, mode="reduce-overhead")`` around
forward and backward (FusedAdamW, fp32). Then the time of a replayed step against an
eager one over GPT-2 small's 148 tensors (median of 50, CUDA events).

``--dry-run``: on CPU, the replay is the eager step itself (no graph), 5 steps, an
eighth of GPT-2 small's dimensions: it proves the script runs, and measures nothing.
"""
import argparse
import os
import socket
import statistics
import sys

import torch

GPT2_SMALL = ([(50304, 768), (1024, 768)]
              + [s for _ in range(12) for s in [(768,), (768,), (2304, 768), (2304,), (768, 768), (768,),
                                                 (768,), (768,), (3072, 768), (3072,), (768, 3072), (768,)]]
              + [(768,), (768,)])


class Graphed:
    """``fn`` captured in a CUDA graph (warmed up by the caller), or, dry, ``fn`` itself."""

    def __init__(self, fn, dry: bool):
        self.fn, self.dry = fn, dry
        if dry:
            return
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            fn()

    def __call__(self):
        if self.dry:
            self.fn()
        else:
            self.graph.replay()


def _params(shapes, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(s, generator=g) * 0.02).to(device, dtype)) for s in shapes]


def _grads(params, t):
    g = torch.Generator(device="cpu").manual_seed(1000 + t)
    return [torch.randn(p.shape, generator=g).to(p.device, p.dtype) for p in params]


def _state(opt):
    sd = opt.state_dict()["state"]
    return [t for k in sorted(sd) for t in sd[k].values() if isinstance(t, torch.Tensor)]


def compare(make_opt, shapes, dtype, device, dry, steps=20, warm=3):
    """(parameters the same bits, state the same bits) after ``warm`` eager steps and
    ``steps`` more, replayed against eager."""
    a, b = _params(shapes, dtype, device), _params(shapes, dtype, device)
    oa, ob = make_opt(a), make_opt(b)

    def backward(ps, o, t):  # d/dp sum(p * g) = g: the gradients through backward's hooks
        o.zero_grad(set_to_none=False)
        sum((p.float() * g.float()).sum() for p, g in zip(ps, _grads(ps, t))).backward()
    for t in range(warm):
        for ps, o in ((a, oa), (b, ob)):
            backward(ps, o, t)
            o.step()
    replay = Graphed(ob.step, dry)
    for t in range(warm, warm + steps):
        backward(a, oa, t)
        oa.step()
        backward(b, ob, t)
        replay()
    if device.type == "cuda":
        torch.cuda.synchronize()
    same_params = all(torch.equal(x, y) for x, y in zip(a, b))
    same_state = all(torch.equal(x, y) for x, y in zip(_state(oa), _state(ob)))
    return same_params, same_state


def compiled(dry, device):
    """FusedAdamW under a model compiled with mode="reduce-overhead": its forward and
    backward graphed by torch, the step by us; against the same compiled model stepped
    eagerly."""
    from zero_triton import FusedAdamW
    outs = []
    for capture in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(),
                                    torch.nn.Linear(512, 256)).to(device)
        opt = FusedAdamW(model.parameters(), lr=torch.tensor(1e-3, device=device), capturable=True)
        run = model if dry else torch.compile(model, mode="reduce-overhead")
        step = None
        for t in range(23):
            x = torch.randn(32, 256, generator=torch.Generator().manual_seed(t)).to(device)
            opt.zero_grad(set_to_none=False)
            run(x).pow(2).mean().backward()
            if capture and t == 3:
                step = Graphed(opt.step, dry)
            if capture and step is not None:
                step()
            else:
                opt.step()
        outs.append([p.detach().clone() for p in model.parameters()])
    return all(torch.equal(x, y) for x, y in zip(*outs))


def timed(make_opt, device, dry, n=50):
    """(eager ms, replayed ms) of a step over GPT-2 small's tensors, medians of ``n``
    (dry: each dimension an eighth)."""
    shapes = [tuple(max(1, d // 8) for d in s) for s in GPT2_SMALL] if dry else GPT2_SMALL
    params = _params(shapes, torch.float32, device)
    opt = make_opt(params)
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        p.grad.normal_()
    for _ in range(3):
        opt.step()
    replay = Graphed(opt.step, dry)
    out = []
    for fn in (opt.step, replay):
        times = []
        for _ in range(n):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                import time
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        out.append(statistics.median(times))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        print("needs an NVIDIA GPU (or --dry-run)", file=sys.stderr)
        return 2
    device = torch.device("cpu" if dry else "cuda")
    import torch.distributed as dist
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo" if dry else "nccl", rank=0, world_size=1)
    from zero_triton import FusedAdamW, ZeroAdamW

    def lr():
        return torch.tensor(1e-3, device=device)
    shapes = [(512, 256), (256,), (1024, 512), (512,), (64, 1024)]
    cases = [
        ("FusedAdamW fp32", torch.float32, lambda ps: FusedAdamW(ps, lr=lr(), capturable=True)),
        ("FusedAdamW bf16, int8 moments", torch.bfloat16,
         lambda ps: FusedAdamW(ps, lr=lr(), moments="int8", capturable=True)),
        ("FusedAdamW bf16 remainder", torch.bfloat16,
         lambda ps: FusedAdamW(ps, lr=lr(), master_weights="remainder", capturable=True)),
        ("FusedAdamW fp32, max_grad_norm", torch.float32,
         lambda ps: FusedAdamW(ps, lr=lr(), max_grad_norm=0.5, capturable=True)),
        ("ZeroAdamW stage 1 (NCCL, world 1)", torch.float32,
         lambda ps: ZeroAdamW(ps, lr=lr(), bucket_cap_mb=1, capturable=True)),
        ("ZeroAdamW stage 2, clipped", torch.float32,
         lambda ps: ZeroAdamW(ps, lr=lr(), stage=2, bucket_cap_mb=1, max_grad_norm=0.5,
                              capturable=True)),
    ]
    failed = 0
    print(f"{'replayed vs eager, 20 steps':40} {'params':>7} {'state':>7}")
    for name, dtype, make in cases:
        params, state = compare(make, shapes, dtype, device, dry, steps=5 if dry else 20)
        failed += not (params and state)
        print(f"{name:40} {'same' if params else 'DIFFER':>7} {'same' if state else 'DIFFER':>7}")
    same = compiled(dry, device)
    failed += not same
    print(f"{'torch.compile reduce-overhead + captured':40} {'same' if same else 'DIFFER':>7}")
    for name, make in [("FusedAdamW", lambda ps: FusedAdamW(ps, lr=lr(), capturable=True)),
                       ("ZeroAdamW stage 1", lambda ps: ZeroAdamW(ps, lr=lr(), capturable=True))]:
        eager, replayed = timed(make, device, dry, n=3 if dry else 50)
        print(f"GPT-2 small's 148 tensors, {name}: eager {eager:.3f} ms, replayed {replayed:.3f} ms "
              f"({eager / replayed:.2f}x)")
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
