"""Shared pieces of the ecosystem scripts: a tiny model, its data, a plain-torch
reference loop, and helpers to record results that the tests compare.

Scripts call ``setup_process()`` first. Every script writes one ``torch.save`` file per
rank (``--out DIR`` -> ``DIR/rank{r}.pt``) holding a dict of phases; a phase that raised
records its traceback under ``error`` so that the test can say which step of the recipe
failed. Importing this module has no side effect beyond TRITON_INTERPRET's default.
"""
import copy
import faulthandler
import os
import sys
import traceback

os.environ.setdefault("TRITON_INTERPRET", "1")  # as tests/conftest.py: Triton on CPU tensors

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def setup_process():
    """Call first in every script: one thread per rank (2 ranks share 2 cores) and the
    watchdog."""
    torch.set_num_threads(1)
    arm_watchdog()


def arm_watchdog(seconds=None):
    """(Re)start the watchdog: a hang (a collective some rank never joins) dumps every
    thread's stack and exits after ``seconds`` (default $ECOSYSTEM_HANG_S, else 150), so
    the test shows where it hung instead of only timing out."""
    if seconds is None:
        seconds = float(os.environ.get("ECOSYSTEM_HANG_S", "150"))
    faulthandler.dump_traceback_later(seconds, exit=True, file=sys.stderr)


def finish(rank):
    """Call last: every rank reaches here, then the process group is torn down before
    the interpreter exits (gloo's threads alive at exit abort the process: "terminate
    called without an active exception", seen once on a loaded machine)."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()
    print(f"rank {rank}: done", flush=True)
    sys.stderr.flush()
    os._exit(0)  # no interpreter finalisation with gloo's threads around (see demo.py)


IN, HIDDEN, OUT = 8, 32, 4
SAMPLES = 128
LR, WEIGHT_DECAY, BETAS = 1e-2, 0.1, (0.9, 0.99)


class Net(torch.nn.Module):
    """Linear -> LayerNorm -> tanh -> Linear(bias=False), plus a buffer that must survive
    save/load. ``forward(x, labels=None)`` returns the output, or ``{"loss", "logits"}``
    when labels are given (what HF Trainer expects of a model)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.fc1 = torch.nn.Linear(IN, HIDDEN)
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, OUT, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        self.register_buffer("offset", torch.randn(OUT, generator=g))

    def forward(self, x, labels=None):
        out = self.fc2(torch.tanh(self.norm(self.fc1(x)))) + self.offset
        if labels is None:
            return out
        return {"loss": F.mse_loss(out, labels), "logits": out}


def data():
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, IN, generator=g)
    y = torch.randn(SAMPLES, OUT, generator=g)
    return x, y


class DictDataset(torch.utils.data.Dataset):
    """{"x", "labels"} samples for HF Trainer."""

    def __init__(self):
        self.x, self.y = data()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


def snapshot(sd: dict) -> dict:
    """A detached deep copy of a (model or optimizer) state dict."""
    def clone(v):
        if isinstance(v, torch.Tensor):
            return v.detach().clone()
        if isinstance(v, dict):
            return {k: clone(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return type(v)(clone(x) for x in v)
        return copy.deepcopy(v)
    return clone(sd)


def strip_prefix(sd: dict, prefix: str = "module.") -> dict:
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in sd.items()}


def params_of(model) -> dict:
    """name -> fp32 copy of every parameter and buffer (wrapper prefixes stripped)."""
    return {k: v.detach().float().clone() for k, v in strip_prefix(model.state_dict()).items()}


def reference_adamw(steps: int, global_batch: int, sched_steps_per_step: int = 1,
                    max_grad_norm: float | None = None, lr: float = LR) -> dict:
    """torch.optim.AdamW in one process on the full (global) batch, no accelerate:
    the ground truth. ``sched_steps_per_step``: LinearLR steps per optimizer step
    (accelerate steps a prepared scheduler num_processes times per step)."""
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY)
    sched = torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.1, total_iters=4 * steps)
    x, y = data()
    for s in range(steps):
        xb, yb = x[s * global_batch:(s + 1) * global_batch], y[s * global_batch:(s + 1) * global_batch]
        loss = F.mse_loss(model(xb), yb)
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        for _ in range(sched_steps_per_step):
            sched.step()
        opt.zero_grad()
    return params_of(model)


class Phases:
    """Records phases into a dict; ``with phases("name") as rec: rec["k"] = v``. An
    exception is recorded (with its traceback) and printed, never raised."""

    def __init__(self):
        self.results = {}

    def __call__(self, name):
        phases = self

        class _Ctx:
            def __enter__(self):
                phases.results[name] = {"ok": False}
                return phases.results[name]

            def __exit__(self, typ, exc, tb):
                rec = phases.results[name]
                if exc is None:
                    rec["ok"] = True
                else:
                    rec["error"] = "".join(traceback.format_exception(typ, exc, tb))
                    print(f"[phase {name}] FAILED:\n{rec['error']}", flush=True)
                return True  # swallow: later phases still run

        return _Ctx()

    def save(self, out_dir: str, rank: int):
        os.makedirs(out_dir, exist_ok=True)
        torch.save(self.results, os.path.join(out_dir, f"rank{rank}.pt"))
