"""What an optimizer was built with beyond torch's hyperparameters: one frozen ``Spec``,
checked once by the constructor and handed down whole to the shards that step it
(``optim/build.py``, ``optim/shard.py``, ``optim/engine_home.py``), where the layers
used to pass each keyword to the next.

torch.optim.Adam's hyperparameters (lr, betas, ...) are not here: they live in the param
groups, where users and schedulers edit them between steps. A spec does not change after
construction; a new capability adds a field here (with its check) rather than a keyword
to every constructor on the way down.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from zero_triton.comm import buckets, grads
from zero_triton.comm.compressed import CODECS  # what can be sent compressed
from zero_triton.native import backends
from zero_triton.optim import offload as offloads
from zero_triton.optim import release as releases
from zero_triton.optim import zero_release
from zero_triton.optim.capture import CAPTURED, EAGER, Captured, Eager
from zero_triton.optim.checks import check_flag
from zero_triton.optim.clipping import Clipping
from zero_triton.optim.pipeline import StepPipeline
from zero_triton.optim.engine_home import is_dtensor
from zero_triton.state import master as master_formats
from zero_triton.state import moments as moment_formats
from zero_triton.state.keys import formats_of

REDUCE_DTYPES = (None, torch.float32, torch.float16, torch.bfloat16)
FEEDBACK = {True: torch.bfloat16, False: None, torch.bfloat16: torch.bfloat16,
            torch.float32: torch.float32}
STOCHASTIC = "stochastic"  # master_weights: no fp32 master, bf16 parameters rounded stochastically
# master_weights's strings: the master formats that name themselves (``state.master.KEYWORDS``).
MASTER_STRINGS = {k: cls.described for k, cls in master_formats.KEYWORDS.items()}


_COMPRESSED_DIFFERENTIABLE = (
    "compressed collectives (reduce_dtype='int8', gather_dtype='int8') cannot be used with "
    "differentiable=True: autograd through the step needs exact gradients and parameters; "
    "leave them out")


def _check_master_weights(master_weights, differentiable: bool) -> None:
    if isinstance(master_weights, str):
        if master_weights not in MASTER_STRINGS:
            kinds = "; ".join(f"{k!r} ({why})" for k, why in MASTER_STRINGS.items())
            raise ValueError(f"master_weights must be True or False (None: True), or "
                             f"{kinds}, got {master_weights!r}")
        if differentiable:
            raise ValueError(f"master_weights={master_weights!r} cannot be used with "
                             "differentiable=True: autograd through the step needs torch's "
                             "own float state; use master_weights=None")
    elif master_weights is not None:
        check_flag("master_weights", master_weights)


def _check_moments(moments, differentiable: bool) -> None:
    if not isinstance(moments, str) or moments not in moment_formats.FORMATS:
        raise ValueError(f"moments must be one of {tuple(moment_formats.FORMATS)} (the Adam "
                         f"moments' storage format), got {moments!r}")
    if moments != "fp32" and differentiable:
        raise ValueError(f"moments={moments!r} cannot be used with differentiable=True: "
                         "autograd through the step needs torch's own float state; use "
                         "moments='fp32' (the default)")


def _master(master_weights) -> bool | str:
    """``master_weights`` as a spec holds it: a format's string, or a flag (None: True)."""
    if master_weights is None:
        return True
    return master_weights if isinstance(master_weights, str) else bool(master_weights)


@dataclass(frozen=True)
class Spec:
    """``backend``: "auto" or a backend name (``zero_triton.native.backends``);
    ``master_weights``: keep an fp32 master of fp16/bf16 parameters (``"remainder"``: its
    low half beside bf16 parameters; ``"stochastic"``: none, bf16 parameters updated in
    float32 and rounded back stochastically; ``zero_triton.state.master``); ``reduce_dtype``: the
    dtype gradients are averaged in (None: their own); ``bucket_cap_mb``: MiB of
    gradients per bucket at most (None: one bucket per flat buffer); ``stage``: 1 (state
    sharded) or 2 (gradients too); ``max_grad_norm``: clip by the global norm inside
    ``step()`` (None: no); ``differentiable``: torch's differentiable step, no flat
    buffers; ``moments``: the moments' format (``zero_triton.state.moments.FORMATS``);
    ``gather_codec``: how the parameters' all-gather is sent (None: in their dtype;
    "int8"); ``reduce_codec``: how the gradients' average is sent (None: in
    ``reduce_dtype``; "int8", summed in float32); ``error_feedback``: the dtype of the
    int8 average's error buffers (None: none); ``placement``: where the optimizer
    state lives, what the ``offload`` and ``offload_fraction`` keywords chose
    (``zero_triton.optim.offload``: ``BESIDE`` the parameters, or ``Offloaded(f)``, f of
    each shard in host memory); ``capture``:
    what torch's ``capturable`` keyword chose (``zero_triton.optim.capture``: ``CAPTURED``,
    a step a CUDA graph can capture, every buffer it uses made before and nothing read
    on the host, docs/capture.md; ``EAGER``), the parts that differ for it."""

    backend: str = "auto"
    master_weights: bool | str = True
    reduce_dtype: torch.dtype | None = None
    bucket_cap_mb: float | None = None
    stage: int = 1
    max_grad_norm: float | None = None
    differentiable: bool = False
    moments: str = "fp32"
    gather_codec: str | None = None
    reduce_codec: str | None = None
    error_feedback: torch.dtype | None = None
    placement: offloads.Beside = offloads.BESIDE
    capture: Eager = EAGER
    release: bool = False

    @classmethod
    def build(cls, *, backend="auto", master_weights=None, reduce_dtype=None, bucket_cap_mb=None,
              stage=1, max_grad_norm=None, differentiable=False, moments="fp32",
              capturable=False) -> "Spec":
        """The constructor's keywords, checked in the order the optimizers have always
        checked them (each error names the fix; nothing has changed yet)."""
        _check_master_weights(master_weights, differentiable)
        if max_grad_norm is not None and (isinstance(max_grad_norm, bool) or
                                          not isinstance(max_grad_norm, (int, float)) or
                                          not max_grad_norm > 0):
            raise ValueError(f"max_grad_norm must be a float > 0 or None, got {max_grad_norm!r}")
        check_flag("differentiable", differentiable)
        if backend not in backends.NAMES:
            raise ValueError(f"unknown backend {backend!r}; choose one of {backends.NAMES}")
        if bucket_cap_mb is not None and (isinstance(bucket_cap_mb, bool) or
                                          not isinstance(bucket_cap_mb, (int, float)) or
                                          not 0 < bucket_cap_mb < math.inf):
            raise ValueError(f"bucket_cap_mb must be a number > 0 (MiB of gradients per bucket; "
                             f"25 is DDP's default) or None for one bucket, got {bucket_cap_mb!r}")
        if stage not in grads.HOLDERS or not isinstance(stage, int) or isinstance(stage, bool):
            raise ValueError(f"stage must be 1 (optimizer state sharded) or 2 (gradients too), "
                             f"got {stage!r}")
        reduce_codec = reduce_dtype if isinstance(reduce_dtype, str) else None
        if reduce_codec is not None and reduce_codec in CODECS:
            reduce_dtype = torch.float32  # the codes are summed, and the average held, in fp32
        if reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"reduce_dtype must be None (the gradients' own dtype), "
                             f"torch.float32, torch.float16, torch.bfloat16 or 'int8' (int8 "
                             f"blocks on the wire, summed in float32), got {reduce_dtype!r}")
        if reduce_codec and differentiable:
            raise ValueError(_COMPRESSED_DIFFERENTIABLE)
        _check_moments(moments, differentiable)
        check_flag("capturable", capturable)
        if capturable and differentiable:
            raise ValueError("capturable=True cannot be used with differentiable=True: the "
                             "differentiable step is torch's, building an autograd graph at "
                             "each step; leave one of them out")
        return cls(backend=backend, master_weights=_master(master_weights),
                   reduce_dtype=reduce_dtype, bucket_cap_mb=bucket_cap_mb, stage=stage,
                   max_grad_norm=None if max_grad_norm is None else float(max_grad_norm),
                   differentiable=bool(differentiable), moments=moments,
                   reduce_codec=reduce_codec, capture=CAPTURED if capturable else EAGER,
                   error_feedback=FEEDBACK[True] if reduce_codec else None)

    def for_group(self, group: dict) -> "Spec":
        """The spec a param group's shards are built to: this one, with the group's own
        state formats where it names them (``state.keys.GROUP_FORMATS``: ``moments``,
        ``master_weights``), checked as the constructor checks them."""
        given = formats_of(group)
        if not given:
            return self
        moments = given.get("moments", self.moments)
        master_weights = given.get("master_weights", self.master_weights)
        _check_moments(moments, self.differentiable)
        _check_master_weights(master_weights, self.differentiable)
        return dataclasses.replace(self, moments=moments, master_weights=_master(master_weights))

    def with_offload(self, offload=None, offload_fraction=None) -> "Spec":
        """This spec with the optimizer state placed by ``offload`` (None: beside the
        parameters; "cpu": in host memory, ``zero_triton.optim.offload``), checked.
        ``offload_fraction``: the share of the state offloaded (None: all of it)."""
        if offload is not None and offload not in offloads.PLACEMENTS:
            raise ValueError(f"offload must be None (the state beside the parameters) or one of "
                             f"{offloads.PLACEMENTS} (the optimizer state in host memory, stepped "
                             f"there), got {offload!r}")
        if offload_fraction is not None:
            if isinstance(offload_fraction, bool) or not isinstance(offload_fraction, (int, float)) \
                    or not 0 <= offload_fraction <= 1:
                raise ValueError(f"offload_fraction must be a number in [0, 1] (the share of the "
                                 f"optimizer state in host memory), got {offload_fraction!r}")
            if offload is None:
                raise ValueError("offload_fraction applies to offload='cpu'; pass offload='cpu' "
                                 "or leave offload_fraction out")
            if offload_fraction == 0:
                offload = None
        if offload is not None and self.differentiable:
            raise ValueError("offload='cpu' cannot be used with differentiable=True: autograd "
                             "through the step needs torch's own state beside the parameters; "
                             "leave offload out")
        if offload is not None and isinstance(self.capture, Captured):
            raise ValueError("offload='cpu' cannot be used with capturable=True: the offloaded "
                             "state is stepped by the host, which a CUDA graph cannot capture "
                             "(it records device work only); leave one of them out")
        if offload is None:
            return dataclasses.replace(self, placement=offloads.BESIDE)
        fraction = 1.0 if offload_fraction is None else float(offload_fraction)
        return dataclasses.replace(self, placement=offloads.Offloaded(fraction))

    def with_release(self, grad_release=False) -> "Spec":
        """This spec with gradient release (``zero_triton.optim.release``: each parameter
        stepped in backward as its gradient is made, the gradient then freed), checked
        against what needs every gradient before any parameter is stepped."""
        check_flag("grad_release", grad_release)
        if not grad_release:
            return self
        why = ("grad_release=True steps each parameter in backward, as its gradient is made, "
               "and frees the gradient")
        if self.max_grad_norm is not None:
            raise ValueError(f"max_grad_norm cannot be used with grad_release=True: clipping by the "
                             f"global norm needs every gradient before any parameter is stepped, "
                             f"and {why}; leave one of them out")
        if self.differentiable:
            raise ValueError("grad_release=True cannot be used with differentiable=True: the "
                             "differentiable step is torch's own, in step(); leave one of them out")
        if isinstance(self.capture, Captured):
            raise ValueError(f"grad_release=True cannot be used with capturable=True: {why}, one "
                             "launch per parameter inside backward, which no captured step "
                             "holds; leave one of them out")
        if self.placement is not offloads.BESIDE:
            raise ValueError(f"grad_release=True cannot be used with offload='cpu': {why}, and "
                             "the offloaded state is stepped in host memory once the step's "
                             "gradients are there; leave one of them out")
        return dataclasses.replace(self, release=True)

    def with_wire(self, gather_dtype=None, error_feedback=True) -> "Spec":
        """This spec with ZeroAdam's parameter gathers (``gather_dtype``) and the int8
        average's error buffers (``error_feedback``), checked (``zero_triton.comm.compressed``)."""
        if gather_dtype is not None and gather_dtype not in CODECS:
            raise ValueError(f"gather_dtype must be None (the parameters' own dtype) or 'int8' "
                             f"(int8 blocks on the wire), got {gather_dtype!r}")
        if not (isinstance(error_feedback, bool) or error_feedback in (torch.float32, torch.bfloat16)):
            raise ValueError(f"error_feedback must be True (bfloat16 error buffers), False, "
                             f"torch.bfloat16 or torch.float32, got {error_feedback!r}")
        if self.reduce_codec is None and error_feedback is not True:
            raise ValueError("error_feedback applies to reduce_dtype='int8' (what its "
                             "quantization drops, sent again the next step); leave it out "
                             "or pass reduce_dtype='int8'")
        if gather_dtype and self.differentiable:
            raise ValueError(_COMPRESSED_DIFFERENTIABLE)
        return dataclasses.replace(
            self, gather_codec=gather_dtype,
            error_feedback=FEEDBACK[error_feedback] if self.reduce_codec else None)

    @property
    def align(self) -> int:
        """The flat layout's alignment (elements) the moments' format needs."""
        return moment_formats.FORMATS[self.moments].align

    @property
    def stochastic(self) -> bool:
        """bf16 parameters without an fp32 master, rounded back stochastically."""
        return self.master_weights == STOCHASTIC

    def master_format(self, dtype: torch.dtype) -> str:
        """How parameters of ``dtype`` are stepped (``zero_triton.state.master.FORMATS``)."""
        if dtype not in (torch.float16, torch.bfloat16):
            return "own"
        named = master_formats.KEYWORDS.get(self.master_weights) if isinstance(
            self.master_weights, str) else None
        return named.format if named else "fp32"

    def check_params(self, params, amsgrad: bool) -> None:
        """Refuse, with the fix and before anything is built, what the moments' format
        cannot step (amsgrad's maximum, float64 or complex parameters) and parameters
        ``master_weights="stochastic"`` or ``"remainder"`` does not apply to (any but
        bfloat16)."""
        if isinstance(self.master_weights, str):
            mode = self.master_weights
            for i, p in enumerate(params):
                if p.dtype != torch.bfloat16:
                    fix = ("float32 and float64 parameters are their own master: use "
                           "master_weights=None" if p.dtype in (torch.float32, torch.float64)
                           else f"{mode!r} is for bfloat16 only (the top half of a float32): "
                           "use bfloat16 parameters, or master_weights=None (an fp32 master)")
                    raise ValueError(f"master_weights={mode!r} is for "
                                     f"{MASTER_STRINGS[mode]}; parameter {i} "
                                     f"{tuple(p.shape)} is {p.dtype}: {fix}")
        self._check_compressed(params)
        if self.release and any(is_dtensor(p) for p in params):
            raise ValueError("grad_release=True is for plain tensors: FSDP2 and tensor parallel "
                             "make DTensor gradients in their own hooks after backward's, and "
                             "FSDP2 already frees the unsharded ones; leave grad_release out")
        if self.moments == "fp32":
            return
        if amsgrad:
            raise ValueError(f"moments={self.moments!r} cannot be used with amsgrad=True: it "
                             "stores no running maximum of exp_avg_sq; use moments='fp32' for "
                             "amsgrad (another optimizer, or a param group of its own in one "
                             "built with moments='fp32')")
        for i, p in enumerate(params):
            if p.dtype == torch.float64 or p.is_complex():
                raise ValueError(f"moments={self.moments!r} cannot be used with {p.dtype} "
                                 f"parameters (parameter {i}, {tuple(p.shape)}): its codes hold "
                                 "float32 state of real parameters; step them with an "
                                 "optimizer built with moments='fp32'")

    def _check_compressed(self, params) -> None:
        """int8 parameter gathers need an fp32 master beside fp16/bf16 parameters (the
        parameters become the master's quantized rounding); int8 averages, real
        parameters of at most float32."""
        for i, p in enumerate(params):
            where = f"parameter {i} {tuple(p.shape)} is {p.dtype}"
            if self.reduce_codec and (p.dtype == torch.float64 or p.is_complex()):
                raise ValueError(f"reduce_dtype='int8' averages real gradients of float32 or "
                                 f"narrower in float32; {where}: use reduce_dtype=None for it "
                                 "(another optimizer or param group)")
            if not self.gather_codec:
                continue
            if p.dtype not in (torch.float16, torch.bfloat16):
                raise ValueError(
                    f"gather_dtype='int8' sends fp16/bf16 parameters as int8 blocks, every "
                    f"rank then holding their dequantized values while the fp32 master stays "
                    f"exact; {where}, which is its own master and would lose its precision: "
                    "train in bf16 (model.to(torch.bfloat16)) with master_weights=None, or "
                    "leave gather_dtype out")
            if self.master_format(p.dtype) != "fp32":
                raise ValueError(
                    f"gather_dtype='int8' keeps an fp32 master beside the parameters, which "
                    f"become its quantized rounding; master_weights={self.master_weights!r} "
                    "keeps none (or keeps its low half beside the parameter's bits, which "
                    "the gather replaces): use master_weights=None with gather_dtype='int8'")

    @property
    def pipeline(self) -> type:
        """The step's pipeline (``optim.pipeline``): the plain one, or gradient release's,
        one process's (``optim.release``) or over ranks at stage 2 (``optim.zero_release``)."""
        if not self.release:
            return StepPipeline
        over_ranks = self.grads is not grads.ReleasedGrads  # ZeroAdam's stage 2 holds them
        return zero_release.ZeroReleasePipeline if over_ranks else releases.ReleasePipeline

    def clipping(self, buffers) -> Clipping:
        """This step's clipping (``optim.clipping``): under one process's gradient release,
        ``ReleasedNorms``, which keeps each released gradient's norm and clips by none."""
        if self.pipeline is releases.ReleasePipeline:
            return releases.ReleasedNorms(buffers)
        return Clipping(buffers)

    @property
    def grads(self) -> type:
        """How the gradients are held (``comm.protocol.GradHolder``): the class of this
        ``stage``. Everything that differs between the stages asks it, not the number."""
        if self.release and not grads.HOLDERS[self.stage].sharded:
            return grads.ReleasedGrads  # one process: each parameter stepped as it arrives
        return grads.HOLDERS[self.stage]

    def bucket_numel(self, dtype: torch.dtype, numel: int, world_size: int) -> int | None:
        """Elements per bucket of a flat buffer of ``numel`` elements of ``dtype``
        (``zero_triton.comm.buckets.bucket_numel``); None: one bucket (one rank, or
        ``bucket_cap_mb=None``)."""
        if self.bucket_cap_mb is None or world_size == 1:
            return None
        return buckets.bucket_numel(self.bucket_cap_mb, dtype, numel)

    @classmethod
    def from_options(cls, options: dict) -> "Spec":
        """The spec whose ``options()`` these are, checked again."""
        options = dict(options)
        offload, fraction = options.pop("offload", None), options.pop("offload_fraction", None)
        release = options.pop("grad_release", False)
        return cls.build(**options).with_offload(offload, fraction).with_release(release)

    def options(self) -> dict:
        """What a copy (``copy.deepcopy``, ``pickle``) of a one-process optimizer keeps."""
        return {"master_weights": self.master_weights, "backend": self.backend,
                "max_grad_norm": self.max_grad_norm, "moments": self.moments,
                **self.capture.keywords,
                **self.placement.keywords, "grad_release": self.release}
