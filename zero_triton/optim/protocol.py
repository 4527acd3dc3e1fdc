"""What a step asks of the other ranks: the declared part an optimizer is composed with.

Every call that reads or writes the state (``step``, clipping, GradScaler, the state
dicts, checkpoints) starts with ``enter``: what the user changed since the last such
call is followed (param groups edited by hand refused, ``opt.state`` edits taken in,
masters of written parameters re-seeded), and, over a process group, every rank agrees
first that all are at the same call and on what each found. The step then asks the
ranks to agree on what a kernel needs (``agree``) and tells them when it is done
(``stepped``); a load tells them too (``loaded``). The torch-format state dict is
theirs too: one rank reads its own state, ranks over a group serve each other their
shards.

Implementations (``zero_triton.optim.ranks``): ``OneRank`` (FusedAdam, and ZeroAdam on a
group of one: nothing to agree on) and ``AgreedRanks`` (ZeroAdam over a group: a
host-side agreement per call, step flags, the shard server's count of steps and loads,
torch's Join). The optimizer calls them with its ``Seat`` (``seat``:
``zero_triton.optim.seat``, its public face and the members it declares); they read
none of its private attributes. ``tests/test_layers.py`` holds this module to importing nothing of the package.
"""
from __future__ import annotations

from typing import Any, Optional, Protocol, runtime_checkable


@runtime_checkable
class Ranks(Protocol):
    shadowing: bool    # under torch's Join: this rank, out of inputs, runs the others' iteration

    def enter(self, seat: Any, entry: str, pairs: Optional[list] = None, stale: bool = False,
              detail: str = "") -> bool:
        """Start call ``entry`` (``pairs``: the (param group, shard) pairs it reads, None
        for all): follow the user's edits, agreed by every rank. Returns whether the
        gradients must be averaged again (``stale``: changed after their average began,
        on any rank)."""

    def clipping(self, args: Optional[tuple]) -> None:
        """``clip_grad_norm_``'s ``args`` (max_norm, norm_type) while the call is in
        progress, None once it is done (or inside ``step``): what its agreement shows a
        rank shadowing under torch's Join."""

    def backward_entry(self, seat: Any) -> Any:
        """What backward's launches call (with a detail naming the bucket) before the
        first bucket of a round, handed to the reducer as it is made; None: nothing."""

    def built(self, seat: Any) -> None:
        """The optimizer is built (its state exists)."""

    def catch_up(self, entry: str, rows: Any) -> None:
        """Under torch's Join, this joined rank's shadow iteration met call ``entry``
        that the others made first; ``rows``: what that call's exchange brought."""

    def refuse_under_join(self, enabled: bool) -> None:
        """Join's hook was asked for (``enabled``: Join is on): refuse what it cannot do."""

    def before_reduce(self, shards: list) -> None:
        """The local gradients are all in ``shards``' buffers, about to be averaged."""

    def after_reduce(self, seat: Any) -> None:
        """This step's gradients were averaged (or it was asked again)."""

    def agree(self, seat: Any, shards: list, found_inf: Any) -> Any:
        """The step's found_inf (GradScaler's, or None) and which parameters step, agreed
        by every rank before the kernels; returns the found_inf the kernels read."""

    def agree_found_inf(self, seat: Any, per_device: dict) -> None:
        """GradScaler's per-device inf flags, agreed in place."""

    def stepped(self, seat: Any) -> None:
        """A step completed on this rank."""

    def loaded(self) -> None:
        """A load (a state dict, a checkpoint, an agreed reset) wrote the state."""

    def state_dict(self, seat: Any) -> dict:
        """The full state in torch.optim.Adam's format on this rank (after ``enter``)."""

    def load_state_dict(self, seat: Any, state_dict: dict) -> None:
        """Load a full state in torch.optim.Adam's format: checked (on every rank)
        before anything changes."""


@runtime_checkable
class Place(Protocol):
    """Where one part of a shard's optimizer state lives (``zero_triton.optim.offload``:
    ``DevicePlace`` beside the parameters, ``HostPlace`` in host memory), chosen when the
    shard is built from ``offload``. It holds ``pieces`` of the home's segments (a piece:
    segment ``k``'s elements [off, off + hi - lo), at ``s0`` in this part's state) and is
    the part's master's ``mirror`` (``zero_triton.state.master``)."""

    offloaded: bool      # the state is not beside the parameters (what memory_report counts)
    pieces: list         # the pieces it holds, in state order
    of_segment: dict     # home segment -> the indices of its pieces here

    def parts(self) -> list:
        """The parameter views the state is built over (the device's, or host mirrors)."""

    def refresh(self) -> None:
        """The engine swapped parameters: views of a part of them follow."""

    def fetch(self, js) -> None:
        """Pieces ``js``' averaged gradients on their way to where the state is."""

    def forget(self) -> None:
        """The averages were written where a copy taken cannot see it: copies are stale."""

    def grad(self, j: int) -> Any:
        """Piece ``j``'s averaged gradients where the state is, once they are there."""

    def done(self, js) -> None:
        """Pieces ``js`` were stepped: their parameters back where the model reads them."""

    def host_bytes(self) -> int:
        """Bytes of host memory it holds beyond the state (mirrors, staging)."""

    def pull(self) -> None:
        """The views from the model's parameters."""

    def push(self) -> None:
        """The model's parameters from the views."""

    def write(self, a: int, b: int, values: Any) -> Any:
        """State elements [a, b) of the views set to ``values``; that range returned."""


@runtime_checkable
class Home(Protocol):
    """Where a shard's parameters and gradients live, and how a step reaches them: a flat
    buffer of ours with its gradients and buckets (``zero_triton.optim.flat_home.FlatHome``)
    or DTensor parameters' local shards where their engine keeps them
    (``zero_triton.optim.engine_home.EngineHome``: no buckets, no flat buffer, the engine
    averages and gathers). A ``Shard`` holds one and steps ``segments`` of it: segment
    ``k`` is elements [lo, hi) of the home, at ``s0`` in the state."""

    params: list          # the parameters, in layout order
    comm: Any             # the communicator (``comm.protocol.Comm``)
    spec: Any             # what the optimizer was built with (``optim.spec.Spec``)
    key: int              # its number in the optimizer (the same on every rank)
    dtype: Any
    device: Any
    layout: Any           # ``state.flat.FlatLayout``: where every rank's shard lies
    segments: list        # (lo, hi, s0) of each segment this rank steps
    param_parts: list     # the parameters' elements of each segment
    param_views: list     # where each parameter lives now
    grad_buffer: Any      # how its gradients are held (``comm.protocol.GradHolder``)
    rows: bool            # each segment a local shard stepped through its rows (``optim.rows``)
    seed: int             # stochastic rounding's seed
    gathers: bool         # we gather the updated parameters (bucket by bucket) after the step
    separate_shard: bool  # the averaged gradients live apart from the local ones
    flat_param: Any       # the flat parameter buffer (None: the engine's)
    buckets: Any          # the buckets of ``comm.buckets`` (none: the engine's)

    def grad(self, k: int) -> Any:
        """Segment ``k``'s averaged gradients at this step."""

    def canonical(self, k: int) -> int:
        """Where segment ``k``'s stochastic rounding is keyed."""

    def finished(self, k: int) -> None:
        """Segment ``k`` was stepped."""

    def gather(self, k: int) -> None:
        """Start gathering every rank's updated segment ``k`` (the engine: its own)."""

    def views(self, views: dict) -> dict:
        """Per-parameter views of state ``views``, as the parameters are presented."""

    def local_views(self, views: dict) -> dict:
        """Per-parameter views of state ``views``, as this process holds them."""

    def local_value(self, value: Any, i: int) -> Any:
        """Parameter ``i``'s part of a given state value, as this process holds it."""

    def first_moved(self, hint: bool = False) -> tuple:
        """(index of the first parameter that moved out of the home or -1, swapped)."""

    def rehomed(self) -> "Home":
        """A new home of the same parameters where they are now."""

    def carry_over(self, old: "Home", written: Any) -> list:
        """Take what ``old`` held that the new home keeps (its gradients); returns the
        parameters whose masters start again from their values (``written``, and any
        whose values the user replaced; none where the engine's writes are followed)."""

    def launch(self, backend: str, format: str, plain: bool, buffers: Any) -> Any:
        """The launch part (``optim.launch``) that steps a side of a shard of this home
        with ``backend`` for ``format`` moments (``plain``: the master's format keeps no
        extra bits), its scratch from ``buffers``."""

    @classmethod
    def norm_total(cls, homes: list, comm: Any, norm_type: float, buffers: Any) -> Any:
        """The sum of |g|^norm_type (the largest |g| for inf) of the averaged gradients of
        ``homes`` (all of this kind) over every rank, a 1-element tensor in ``buffers``'
        kept tensors: what clipping's global norm is the root of."""

    def compact_entry(self, moments: Any, i: int, entry: dict) -> Any:
        """Parameter ``i``'s moments as ``moments`` (the shard's store) keeps them, for the
        compact state dict; None to keep torch's ``entry`` as it is."""

    def checkpointable(self, entry: str) -> None:
        """Raise, naming the fix, where ``zero_triton.checkpoint`` (called as ``entry``)
        cannot save this home's shards."""

    def watch_averages(self, watcher: Any) -> None:
        """Tell ``watcher(k, landed)`` when segment ``k``'s averages start and land."""

    def remove_hooks(self) -> None:
        """Take backward's hooks off the parameters."""

    def nbytes(self) -> dict:
        """Bytes it holds, by kind (params, grads, padding)."""
