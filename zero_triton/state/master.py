"""How one shard's parameters are stepped: the declared part that holds (or not) their
fp32 master, so that a way of keeping it is a class here and a kernel mode, not a branch
through the optimizer.

- ``own``: float32 (float64) parameters are their own master; the kernel steps them.
- ``fp32``: fp16/bf16 parameters with an fp32 master beside them (``master_weights=True``,
  the default): the kernel steps the master and writes the parameter rounded to nearest
  even. 4 bytes per parameter.
- ``remainder``: bf16 parameters whose master is their own 16 bits and an int16 beside
  them (``master_weights="remainder"``, ``zero_triton.kernels.remainder``): the master is
  exact for 2 bytes; the parameter rounds ties away from zero.
- ``remainder8``: bf16 parameters whose master is their own 16 bits and an int8 beside
  them (``master_weights="remainder8"``): a 24-bit master for 1 byte, each step's result
  rounded to 24 bits (``zero_triton.kernels.remainder`` says what that keeps and loses).
- ``none``: bf16 parameters without a master (``master_weights="stochastic"``): the kernel
  steps the parameter in float32 and rounds it back stochastically.

A format that a ``master_weights`` string names says so (``keyword``, with what it is:
``described``); the optimizers' keyword takes its values from ``KEYWORDS``.

A master holds one rank's shard in state order, as the moment stores do
(``zero_triton.state.protocol``), and sees the parameters through the shard's views of
them, one per segment (``param_parts``, a list the owner may update in place):

- ``operands(a, b, param)``: what the kernel takes for state elements [a, b) whose
  parameters are ``param``: (the launch's ``param``, its ``param_lp``, its ``remainder``:
  ``zero_triton.kernels.args.Operands``); ``stochastic``: the launch rounds ``param``
  back stochastically (``StepArgs.stochastic``);
- ``export()``: the fp32 master over the shard (None where the parameters are all there
  is); ``commit(master)``: take back what was written into it (a master that is not
  the parameters, or a copy, takes the elements that changed); ``publish()``: the
  parameters from the master (after a load);
- ``seed()``: the master from the parameters as they are; ``reseed(a, b, part)``: the
  same for elements the user wrote (``exact`` masters keep their extra precision where
  the parameter still is its rounding);
- ``rebase(master, param)``: the master a written ``param`` takes from the one it had
  (for a state dict assembled from shards the owner has not re-seeded yet);
- ``nbytes()``, ``storage()``, ``carry_over(old)``.

Where the views are copies of the model's parameters (host mirrors of offloaded state),
a master is handed their ``mirror`` (``optim.offload.HostPlace``; ``SAME`` otherwise):
``pull()`` the views from the model's parameters, ``push()`` the model's parameters
from the views, ``write(a, b, values)`` state elements [a, b) of the views set to
``values`` (that range returned). The master pushes after it writes the parameters
(``commit``, ``publish``) and pulls before it reads them (``seed``, ``reseed``); each
format implements ``_commit``, ``_publish``, ``_seed`` and ``_reseed`` over its views.
"""
from __future__ import annotations

import torch

from zero_triton.kernels import remainder as remainders


class Same:
    """The views are the model's parameters: nothing to copy either way."""

    def pull(self) -> None:
        pass

    def push(self) -> None:
        pass

    def write(self, a: int, b: int, values: torch.Tensor) -> torch.Tensor:
        return values


SAME = Same()


class _Master:
    format: str
    keyword = None    # the master_weights string that names it (None: chosen by dtype)
    described = ""    # what it keeps, for the keyword's error message
    exact = False  # an fp32 master beside the parameters (torch's "master_param")
    live = True    # export() is the storage itself, or there is nothing to export
    keyed = False  # the step rounds the parameter by a generator keyed by element
    plain = True   # the kernel steps a float32 buffer (the list kernel can)
    stochastic = False  # the kernel rounds the bf16 parameter back stochastically (StepArgs)

    def __init__(self, param_parts, segments, numel: int, device, mirror=SAME):
        self.param_parts, self.segments = param_parts, segments
        self.numel, self.device, self.mirror = numel, device, mirror

    def _spans(self):
        """(state slice, the parameters' view) per segment."""
        return [(slice(s0, s0 + hi - lo), part)
                for part, (lo, hi, s0) in zip(self.param_parts, self.segments)]

    def parameters(self) -> torch.Tensor:
        """The shard's parameters in state order (the view itself when one segment)."""
        if len(self.param_parts) == 1 and self.param_parts[0].numel() == self.numel:
            return self.param_parts[0]
        out = torch.zeros(self.numel, dtype=self.param_parts[0].dtype, device=self.device)
        for span, part in self._spans():
            out[span].copy_(part)
        return out

    def export(self):
        return None

    def checkpointed(self) -> torch.Tensor:
        """The master as a sharded checkpoint saves it: float32 over the shard."""
        master = self.export()
        return master if master is not None else self.parameters().float()

    # -- what every format does around its own: the mirror follows ----------------------
    def commit(self, master: torch.Tensor) -> None:
        self._commit(master)
        self.mirror.push()

    def publish(self) -> None:
        self._publish()
        self.mirror.push()

    def seed(self) -> None:
        self.mirror.pull()
        self._seed()

    def reseed(self, a: int, b: int, part: torch.Tensor) -> None:
        self._reseed(a, b, self.mirror.write(a, b, part))

    # -- each format's own, over its views ------------------------------------------------
    def _commit(self, master: torch.Tensor) -> None:
        for span, part in self._spans():
            if part.data_ptr() != master[span].data_ptr():
                part.copy_(master[span])

    def _publish(self) -> None:
        pass

    def _seed(self) -> None:
        pass

    def _reseed(self, a: int, b: int, part: torch.Tensor) -> None:
        pass

    @staticmethod
    def rebase(master: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        return param.float()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.storage())

    def storage(self) -> list:
        return []

    def carry_over(self, old) -> None:
        pass


class OwnMaster(_Master):
    """float32 and float64 parameters: the kernel steps the parameters themselves."""

    format = "own"

    def operands(self, a: int, b: int, param: torch.Tensor) -> tuple:
        return param, None, None

    def checkpointed(self) -> torch.Tensor:
        return self.parameters()


class NoMaster(_Master):
    """bf16 parameters stepped without a master, rounded back stochastically."""

    format = "none"
    keyword = "stochastic"
    described = "bfloat16 parameters without an fp32 master, stepped with stochastic rounding"
    keyed = True
    plain = False
    stochastic = True

    def operands(self, a: int, b: int, param: torch.Tensor) -> tuple:
        return param, None, None


class Fp32Master(_Master):
    """An fp32 copy of fp16/bf16 parameters, which the parameters are the rounding of."""

    format = "fp32"
    exact = True

    def __init__(self, param_parts, segments, numel: int, device, mirror=SAME):
        super().__init__(param_parts, segments, numel, device, mirror)
        self.master = torch.zeros(numel, dtype=torch.float32, device=device)
        self._seed()  # the views are the parameters' as the place was made

    def operands(self, a: int, b: int, param: torch.Tensor) -> tuple:
        return self.master[a:b], param, None

    def export(self) -> torch.Tensor:
        return self.master

    def _commit(self, master: torch.Tensor) -> None:
        if master.data_ptr() != self.master.data_ptr():
            self.master.copy_(master)

    def _publish(self) -> None:
        for span, part in self._spans():
            part.copy_(self.master[span])

    def _seed(self) -> None:
        for span, part in self._spans():
            self.master[span].copy_(part)

    def _reseed(self, a: int, b: int, part: torch.Tensor) -> None:
        m = self.master[a:b]
        m.copy_(self.rebase(m, part))

    @staticmethod
    def rebase(master: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        """Where ``param`` is no longer the master's rounding, the written value."""
        return torch.where(param != master.to(param.dtype), param.float(), master)

    def storage(self) -> list:
        return [self.master]

    def carry_over(self, old) -> None:
        if isinstance(old, Fp32Master) and old.param_parts[0].dtype == self.param_parts[0].dtype:
            self.master.copy_(old.master)


class RemainderMaster(_Master):
    """The low 16 bits of bf16 parameters' fp32 master, beside them (int16)."""

    format = "remainder"
    keyword = "remainder"
    described = ("the low 16 bits of the fp32 master beside bfloat16 parameters: an exact "
                 "master for 2 bytes")
    exact = True
    live = False  # export() joins a copy
    plain = False
    dtype = torch.int16  # the remainder's (``zero_triton.kernels.remainder``)

    def __init__(self, param_parts, segments, numel: int, device, mirror=SAME):
        super().__init__(param_parts, segments, numel, device, mirror)
        self.remainder = torch.zeros(numel, dtype=self.dtype, device=device)

    def operands(self, a: int, b: int, param: torch.Tensor) -> tuple:
        return param, None, self.remainder[a:b]

    def export(self) -> torch.Tensor:
        return remainders.join(self.parameters(), self.remainder)

    def _commit(self, master: torch.Tensor) -> None:
        """The elements of ``master`` that differ from the one the parameters and
        remainders make now: an export written back unchanged changes nothing (not even
        a parameter the user wrote since, which ``reseed`` has yet to pair)."""
        high, low = remainders.split(master, self.dtype)
        params = self.parameters()
        changed = master.view(torch.int32) != remainders.join(params, self.remainder).view(torch.int32)
        self.remainder.copy_(torch.where(changed, low, self.remainder))
        for span, part in self._spans():
            part.copy_(torch.where(changed[span], high[span], part))

    def _seed(self) -> None:
        """A bf16 parameter is exactly the master whose low half is zero."""
        self.remainder.zero_()

    def _reseed(self, a: int, b: int, part: torch.Tensor) -> None:
        r = self.remainder[a:b]
        r.copy_(remainders.consistent(part, r))

    @classmethod
    def rebase(cls, master: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        """The written ``param`` with the master's low bits, where they still pair."""
        _, low = remainders.split(master, cls.dtype)
        return remainders.join(param, remainders.consistent(param, low))

    def storage(self) -> list:
        return [self.remainder]

    def carry_over(self, old) -> None:
        if type(old) is type(self):
            self.remainder.copy_(old.remainder)


class Remainder8Master(RemainderMaster):
    """Bits 8-15 of bf16 parameters' fp32 master, beside them (int8): a 24-bit master."""

    format = "remainder8"
    keyword = "remainder8"
    described = ("8 more bits of the master beside bfloat16 parameters (int8): a 24-bit "
                 "master for 1 byte, each step rounded to 2**-16 of the weight")
    dtype = torch.int8


FORMATS = {cls.format: cls for cls in (OwnMaster, NoMaster, Fp32Master, RemainderMaster,
                                       Remainder8Master)}
KEYWORDS = {cls.keyword: cls for cls in FORMATS.values() if cls.keyword}


def make(format: str, param_parts, segments, numel: int, device, mirror=SAME):
    """The master part of ``format`` for a shard of ``numel`` state elements, over views
    that ``mirror`` keeps (``SAME``: the model's parameters themselves)."""
    return FORMATS[format](param_parts, segments, numel, device, mirror)
