"""The house's rules, read from the code's own imports (ast, nothing imported or run).

- Layers import downwards only: tools -> checkpoint / integrations / memory -> optim ->
  comm -> state -> native -> kernels (the package's face, ``zero_triton/__init__``, sits
  just under tools: it imports the layers below and the tools import it).
- No import circles between modules.
- No module but the optimizers' own (``optim/fused.py``, ``optim/zero.py``) and their two
  declared faces reads an optimizer's private attributes: what checkpoint, integrations
  and the tools need beyond the optimizers' public face (torch.optim's and the short
  list in docs/reference.md) they reach through ``optim.interface.internals``; what the
  optimizers' parts need, through the ``Seat`` they are handed (``optim/seat.py``).
- The patches of other libraries (``integrations/``) touch nothing until a ZeroAdam exists.
- No function takes more than 9 parameters but the Triton kernels, the optimizers' public
  constructors and the operator torch's schema spells out: what is built once travels
  as one value (the optimizer's ``Spec``, the agreement's ``Row``, the step's ``StepArgs``
  and ``Operands``), not keyword by keyword.
- The house's sizes: no class over 350 lines, no function over 60, no subclass that
  overrides more than 5 of its base's concrete methods; ZeRO's ``stage`` read in at most 4
  of the library's modules; the step functions obtained and called in one module
  (``optim/launch.py``); where a parameter's state sits in a shard computed only in the
  state layer and the step's side (every way out reads ``state/param_view.py``).

``__main__.py`` files are programs (``python -m zero_triton``), imported by no module:
they may start a tool.
"""
from __future__ import annotations

import ast
import importlib.util
import os
import socket
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "zero_triton"

# From the bottom up; modules of one rank may import each other (circles aside).
RANKS = {"kernels": 0, "native": 1, "state": 2, "comm": 3, "optim": 4,
         "integrations": 5, "checkpoint": 5, "memory": 5, "": 6, "tools": 7}


# Compiled modules: the native layer's, with no source to read.
EXTENSIONS = {"zero_triton._C": "native"}


def module_name(path: Path) -> str:
    parts = ("zero_triton",) + path.relative_to(PACKAGE).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules() -> dict[str, Path]:
    files = [p for p in sorted(PACKAGE.rglob("*.py"))
             if p.name != "__main__.py"]
    return {module_name(p): p for p in files}


def layer(name: str) -> str:
    if name in EXTENSIONS:
        return EXTENSIONS[name]
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in RANKS else ""


def imports(name: str, path: Path, known) -> set[str]:
    """The package's modules that ``name`` imports (at any depth of its code). ``from P
    import m`` of a submodule ``m`` is an import of ``m``; of any other name, of ``P``'s
    face."""
    found = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = name.split(".")
                base = parts[:len(parts) - node.level + (1 if is_package else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod
                       for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name and t.startswith("zero_triton"):
                found.add(t)
    return found


@pytest.fixture(scope="module")
def graph():
    known = modules()
    names = set(known) | set(EXTENSIONS)
    return {n: imports(n, p, names) for n, p in known.items()}


def test_every_import_runs_downwards(graph):
    upward = [f"{a} ({layer(a) or 'face'}) imports {b} ({layer(b) or 'face'})"
              for a, targets in graph.items() for b in sorted(targets)
              if RANKS[layer(b)] > RANKS[layer(a)]]
    assert not upward, "imports that run back up:\n" + "\n".join(upward)


# The declared seams: pure declarations, which import nothing of the package, so that an
# implementation in any layer at or above theirs can implement them.
PROTOCOLS = ["zero_triton.comm.protocol", "zero_triton.state.protocol", "zero_triton.optim.protocol"]


def test_protocol_modules_import_nothing_of_the_package(graph):
    for name in PROTOCOLS:
        assert name in graph, f"{name} is gone: update PROTOCOLS"
        assert not graph[name], f"{name} imports {sorted(graph[name])}"


def test_no_import_circles(graph):
    seen, stack, circles = set(), [], []

    def visit(n):
        if n in stack:
            circles.append(stack[stack.index(n):] + [n])
            return
        if n in seen:
            return
        seen.add(n)
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            visit(m)
        stack.pop()

    for n in sorted(graph):
        visit(n)
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


def optimizer_privates() -> set[str]:
    """The private attributes and methods of the optimizer classes in ``optim/``."""
    names = set()
    for path in (PACKAGE / "optim").glob("*.py"):
        for cls in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(cls, ast.ClassDef) and cls.name in
                    ("FusedAdam", "FusedAdamW", "ZeroAdam", "ZeroAdamW")):
                continue
            for node in ast.walk(cls):
                if isinstance(node, ast.FunctionDef) and node.name.startswith("_") \
                        and not node.name.startswith("__"):
                    names.add(node.name)
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                        and node.value.id == "self" and node.attr.startswith("_") \
                        and not node.attr.startswith("__"):
                    names.add(node.attr)
    return names


# The optimizers' own modules and their declared faces (for the layers above; for the parts).
OWN_OR_DECLARED = {"optim/fused.py", "optim/zero.py", "optim/interface.py", "optim/seat.py"}


def test_no_reaches_into_the_optimizers_privates():
    privates = optimizer_privates()
    assert {"_shards", "_comm", "_reducer"} <= privates  # the reading still sees them
    reaches = []
    for name, path in modules().items():
        if path.relative_to(PACKAGE).as_posix() in OWN_OR_DECLARED:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in privates and not (
                    isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                reaches.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" \
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                    and node.args[1].value in privates:
                reaches.append(f"{path.relative_to(ROOT)}:{node.lineno}: "
                               f"getattr(..., {node.args[1].value!r})")
    assert not reaches, "reaches into an optimizer's privates:\n" + "\n".join(reaches)


# The optimizers' public face beyond torch.optim.Optimizer's (docs/reference.md lists it).
FUSED_FACE = {"backend", "clip_grad_norm_", "clip_grads_with_norm_", "total_grad_norm",
              "memory_report", "wait_params", "no_sync"}
ZERO_FACE = FUSED_FACE | {"stage", "process_group", "rank", "world_size",
                          "consolidated_state_dict", "sharded_state_dict",
                          "join_hook", "join_device", "join_process_group"}  # torch's Joinable


def test_the_optimizers_public_face_is_torchs_plus_a_documented_list():
    import torch
    import zero_triton
    torch_names = set(dir(torch.optim.Optimizer))
    reference = (ROOT / "docs" / "reference.md").read_text()
    for cls, face in ((zero_triton.FusedAdam, FUSED_FACE), (zero_triton.FusedAdamW, FUSED_FACE),
                      (zero_triton.ZeroAdam, ZERO_FACE), (zero_triton.ZeroAdamW, ZERO_FACE)):
        public = {n for n in dir(cls) if not n.startswith("_")} - torch_names
        assert public == face, (cls.__name__, sorted(public ^ face))
        for name in face - {"join_hook", "join_device", "join_process_group"}:
            assert f"`{name}" in reference, f"docs/reference.md does not list {name}"


def test_the_rules_see_a_planted_violation(tmp_path, graph):
    """The checks can fail: an upward import and a circle, planted in a copy of the graph."""
    planted = {k: set(v) for k, v in graph.items()}
    planted["zero_triton.native.backends"].add("zero_triton.tools.bench")
    planted["zero_triton.tools.bench"].add("zero_triton.native.backends")
    with pytest.raises(AssertionError, match="run back up"):
        test_every_import_runs_downwards(planted)
    with pytest.raises(AssertionError, match="circles"):
        test_no_import_circles(planted)


_PATCHES = r"""
import os, torch, torch.nn.utils as U, torch.nn.utils.clip_grad as CG
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict as DCP
clip, unscale, unscale_ = U.clip_grad_norm_, torch.amp.GradScaler._unscale_grads_, torch.amp.GradScaler.unscale_
value = U.clip_grad_value_
state_dict_fn = DCP._state_dict_fn
routes = lambda f: getattr(f, "_zero_triton_routes", False)  # routed in place: same objects
split = (U.get_total_norm, U.clip_grads_with_norm_)
def patched():
    return (routes(U.clip_grad_norm_) and U.clip_grad_norm_ is clip,
            routes(CG.clip_grad_norm_) and CG.clip_grad_norm_ is clip,
            routes(U.clip_grad_value_) and CG.clip_grad_value_ is value,
            all(map(routes, split)),
            torch.amp.GradScaler._unscale_grads_ is not unscale, torch.amp.GradScaler.unscale_ is not unscale_,
            DCP._state_dict_fn is not state_dict_fn)
import zero_triton
m = torch.nn.Linear(4, 4)
zero_triton.FusedAdamW(m.parameters())
print("fused", patched())
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
dist.init_process_group("gloo", rank=0, world_size=1)
zero_triton.ZeroAdamW(torch.nn.Linear(4, 4).parameters())  # one rank of ZeRO-1: routes nothing
print("one rank", patched(), zero_triton.integrations.applied())
zero_triton.ZeroAdamW(m.parameters(), stage=2)  # its gradients are shards: torch's clipping routes
once = (U.clip_grad_norm_, torch.amp.GradScaler._unscale_grads_, torch.amp.GradScaler.unscale_,
        DCP._state_dict_fn)
zero_triton.ZeroAdamW(torch.nn.Linear(4, 4).parameters(), stage=2)
print("zero", patched(), once == (U.clip_grad_norm_, torch.amp.GradScaler._unscale_grads_,
                                  torch.amp.GradScaler.unscale_, DCP._state_dict_fn))
import importlib.util, sys
if importlib.util.find_spec("accelerate") is not None:  # imported after the first ZeroAdam
    before = "accelerate.accelerator" in sys.modules
    import accelerate.accelerator as A
    print("accelerate", before, getattr(A.Accelerator.clip_grad_norm_, "_zero_triton_routes", False))
dist.destroy_process_group()
"""


def test_patches_are_applied_by_the_first_zero_adam_only_and_once():
    """``import zero_triton`` and FusedAdam change nothing of torch, nor does a ZeroAdam of
    ZeRO-1 at one rank (nothing needs routing); the first ZeroAdam that needs them
    applies every patch of ``integrations/`` (torch's clipping functions, routed in place, GradScaler's
    two methods, DCP's way to an optimizer's state dict, and accelerate's
    ``Accelerator.clip_grad_norm_`` once accelerate is imported, here after it), and a
    second one applies none again."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from dist_utils import run_python  # a process of its own, where zero_triton is imported afresh
    out = run_python(["-c", _PATCHES], timeout=300, env={**os.environ, "PORT": str(port)})
    assert out.returncode == 0, out.stderr
    assert "fused (False, False, False, False, False, False, False)" in out.stdout, out.stdout
    assert "one rank (False, False, False, False, False, False, False) []" in out.stdout, out.stdout
    assert "zero (True, True, True, True, True, True, True) True" in out.stdout, out.stdout
    if importlib.util.find_spec("accelerate") is not None:
        assert "accelerate False True" in out.stdout, out.stdout


def test_setup_installs_every_package():
    """A regular (non-editable) install ships each folder of the layout: setup.py's
    PACKAGES names every package under zero_triton/."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    listed = next(ast.literal_eval(node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "PACKAGES")
    found = {module_name(p.parent / "__init__.py") for p in PACKAGE.rglob("__init__.py")}
    assert set(listed) == found, (sorted(found - set(listed)), sorted(set(listed) - found))


_OFF = r"""
import os, sys, torch, torch.nn.utils as U, torch.nn.utils.clip_grad as CG
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict as DCP
import torch.distributed.optim.zero_redundancy_optimizer as ZRO
have_accelerate = __import__("importlib").util.find_spec("accelerate") is not None
if have_accelerate:
    import accelerate.accelerator as A
def torch_objects():
    objs = [U.clip_grad_norm_, CG.clip_grad_norm_, U.clip_grad_value_, U.get_total_norm,
            U.clip_grads_with_norm_, torch.amp.GradScaler._unscale_grads_,
            torch.amp.GradScaler.unscale_, DCP._state_dict_fn, DCP._get_optim_state_dict,
            ZRO.ZeroRedundancyOptimizer._build_param_buckets]
    if have_accelerate:
        objs.append(A.Accelerator.clip_grad_norm_)
    return objs
def cells():  # what torch's clipping wrappers call, and the markers on them
    out = []
    for f in (U.clip_grad_norm_, U.clip_grad_value_, U.get_total_norm, U.clip_grads_with_norm_):
        out.append(tuple(c.cell_contents for c in (f.__closure__ or ())))
        out.append(vars(f).get("_zero_triton_routes"))
    return out
before, before_cells = torch_objects(), cells()
import zero_triton
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
dist.init_process_group("gloo", rank=0, world_size=1)
zero_triton.FusedAdamW(torch.nn.Linear(4, 4).parameters())  # arms torch_zero
opt = zero_triton.ZeroAdamW(torch.nn.Linear(4, 4).parameters(), stage=2)
print("applied", zero_triton.integrations.applied())
print("changed", cells() != before_cells or torch_objects() != before)
zero_triton.integrations.disable()
print("restored", [a is b for a, b in zip(torch_objects(), before)], cells() == before_cells,
      # no import hook of ours left (torch's own imports may add setuptools' finders)
      not any(type(f).__module__.startswith("zero_triton") for f in sys.meta_path))
zero_triton.ZeroAdamW(torch.nn.Linear(4, 4).parameters(), stage=2)  # off: applies nothing
zero_triton.FusedAdamW(torch.nn.Linear(4, 4).parameters())
print("after", zero_triton.integrations.applied(), cells() == before_cells,
      all(a is b for a, b in zip(torch_objects(), before)))
# torch's clipping is torch's again: the tensors clipped by the norm of what it is given
g = [torch.full((3,), 3.0), torch.full((4,), 4.0)]
ps = [torch.zeros(3, requires_grad=True), torch.zeros(4, requires_grad=True)]
for p, x in zip(ps, g):
    p.grad = x.clone()
n = torch.nn.utils.clip_grad_norm_(ps, 1.0)
print("clip", round(float(n), 4), round(float(torch.cat([p.grad for p in ps]).norm()), 4))
dist.destroy_process_group()
"""


@pytest.mark.parametrize("how", ["disable()", "ZERO_TRITON_PATCHES=0"])
def test_patches_can_be_turned_off_and_undone(how):
    """``zero_triton.integrations.disable()`` undoes every patch applied (torch's clipping
    wrappers' cells and markers, GradScaler's two methods, DCP's two functions, torch's
    ZeroRedundancyOptimizer's bucket builder, accelerate's clip and its import hook): the
    very objects torch had, and no later ZeroAdam patches again; with
    ``ZERO_TRITON_PATCHES=0`` none is ever applied. torch's ``clip_grad_norm_`` then clips
    what it is given by its own norm, as without zero_triton."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from dist_utils import run_python
    env = {**os.environ, "PORT": str(port)}
    if how != "disable()":
        env["ZERO_TRITON_PATCHES"] = "0"
    out = run_python(["-c", _OFF], timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    n = 11 if importlib.util.find_spec("accelerate") is not None else 10
    if how == "disable()":
        applied = next(line for line in out.stdout.splitlines() if line.startswith("applied"))
        names = {"grad_scaler", "clip_grad", "dcp", "torch_zero"} | (
            {"accelerate_clip"} if n == 11 else set())
        assert all(f"'{name}'" in applied for name in names), out.stdout
        assert "changed True" in out.stdout, out.stdout
    else:
        assert "applied []" in out.stdout and "changed False" in out.stdout, out.stdout
    assert f"restored {[True] * n} True True" in out.stdout, out.stdout
    assert "after [] True True" in out.stdout, out.stdout
    assert "clip 9.5394 1.0" in out.stdout, out.stdout  # sqrt(3 * 9 + 4 * 16)


# Functions that take torch.optim.Adam's arguments or a kernel's operands one by one, as
# their callers give them: the optimizers' public signatures and the kernels' entry points.
# The Triton kernels (``@triton.jit``: a pointer or constexpr per parameter), the public
# constructors, torch.library's operator (its schema is its signature) and the reference
# (torch.optim.Adam's arguments, as tests and benchmarks call it).
MANY_PARAMETERS = {
    "optim/fused.py": {"__init__"}, "optim/zero.py": {"__init__"},
    "kernels/adam.py": {"_adam_kernel", "_adam_list_kernel", "_step_block", "_adam_update"},
    "kernels/adam_bf16.py": {"_adam_bf16_kernel"},
    "kernels/adam8.py": {"_adam8_kernel"}, "kernels/adam4.py": {"_adam4_kernel"},
    "native/ops.py": {"adam_step_", "_"},
    "reference.py": {"torch_adam_step_"},
}


def test_no_function_takes_more_than_nine_parameters():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            a = node.args
            names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
            count = len(names) - (1 if names[:1] in (["self"], ["cls"]) else 0)
            if count > 9 and node.name not in MANY_PARAMETERS.get(rel, ()):
                found.append(f"{rel}:{node.lineno} {node.name} takes {count}")
    assert not found, "pass what is built once as one value (a dataclass): " + "; ".join(found)


def _sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), ast.parse(path.read_text())


# torch.optim.Adam's single-tensor step as torch writes it, line for line: the reference
# the kernels are held to reads best next to torch's own.
LONG_FUNCTIONS = {"reference.py": {"torch_adam_step_"}}


def test_no_class_over_350_lines_nor_function_over_60():
    found = []
    for rel, tree in _sources():
        for node in ast.walk(tree):
            limit = 350 if isinstance(node, ast.ClassDef) else \
                60 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                and node.name not in LONG_FUNCTIONS.get(rel, ()) else None
            if limit and node.end_lineno - node.lineno + 1 > limit:
                found.append(f"{rel}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not found, "split it by what it does: " + "; ".join(found)


def _concrete(fn) -> bool:
    """A method with a body beyond a docstring, ``pass`` or ``...``."""
    body = [b for b in fn.body if not (isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant))]
    return bool(body) and not (len(body) == 1 and isinstance(body[0], ast.Pass))


def overriding_subclasses(limit: int = 5) -> list:
    """(class, base, overridden) for each class of the package that overrides more than
    ``limit`` of its (package) base's concrete methods, dunders aside."""
    classes = {}
    for rel, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, node)
    found = []
    for name, cls in classes.items():
        for b in cls.bases:
            base = classes.get(b.id if isinstance(b, ast.Name) else getattr(b, "attr", None))
            if base is None or base is cls:
                continue
            theirs = {f.name for f in base.body if isinstance(f, ast.FunctionDef)
                      and _concrete(f) and not f.name.startswith("__")}
            mine = {f.name for f in cls.body if isinstance(f, ast.FunctionDef)}
            if len(theirs & mine) > limit:
                found.append((name, base.name, sorted(theirs & mine)))
    return found


def test_no_subclass_overrides_more_than_five_of_its_bases_methods():
    assert not overriding_subclasses(), \
        "a part, not a subclass that replaces its base: " + repr(overriding_subclasses())
    assert overriding_subclasses(0), "the check sees no override at all"  # it can fail


def stage_readers() -> set:
    """The library's modules (tools aside) that read a name or attribute ``stage``."""
    found = set()
    for rel, tree in _sources():
        if rel.startswith("tools/"):
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Name) and node.id == "stage" and isinstance(node.ctx, ast.Load)) \
                    or (isinstance(node, ast.Attribute) and node.attr == "stage"
                        and isinstance(node.ctx, ast.Load)):
                found.add(rel)
    return found


def test_stage_is_read_in_at_most_four_modules():
    readers = stage_readers()
    assert "optim/spec.py" in readers  # the one place a stage becomes a gradient holder
    assert len(readers) <= 4, sorted(readers)


def mode_readers(word: str, sources) -> set:
    """The modules of ``sources`` ((path, tree) pairs; tools aside: they are users of the
    public keywords) that read the name or attribute ``word``, other than to hand torch's
    keyword on as it came (``word=word`` in a call: a public constructor passing it to
    where the mode is chosen)."""
    found = set()
    for rel, tree in sources:
        if rel.startswith("tools/"):
            continue
        passed = {id(k.value) for k in ast.walk(tree) if isinstance(k, ast.keyword)
                  and k.arg == word and isinstance(k.value, ast.Name) and k.value.id == word}
        for node in ast.walk(tree):
            name = node.id if isinstance(node, ast.Name) else \
                node.attr if isinstance(node, ast.Attribute) else None
            if name == word and isinstance(node.ctx, ast.Load) and id(node) not in passed:
                found.add(rel)
    return found


# Where torch's ``capturable`` and our ``offload`` become parts (``optim/capture.py``'s modes,
# ``optim/offload.py``'s placements), and where torch's own rules for its keyword are
# checked; below, the parts are handed what they need and nothing asks which mode it is.
MODES_CHOSEN = {"capturable": {"optim/spec.py", "optim/checks.py"}, "offload": {"optim/spec.py"}}


@pytest.mark.parametrize("word", sorted(MODES_CHOSEN))
def test_the_modes_are_read_only_where_they_are_chosen(word):
    planted = ast.parse(f"def f({word}):\n    g({word}={word})\n    return h() if {word} else 0")
    assert mode_readers(word, [("optim/x.py", planted)]) == {"optim/x.py"}  # it can fail
    passed_on = ast.parse(f"def f({word}):\n    g({word}={word})")
    assert not mode_readers(word, [("optim/x.py", passed_on)])
    readers = mode_readers(word, _sources())
    assert readers <= MODES_CHOSEN[word] and len(readers) <= 2, sorted(readers)


def test_no_module_asks_which_kind_of_home_a_shard_has():
    """What differs between a flat buffer's shards and DTensor parameters' (the global
    norm's reduction, the compact entries, the checkpoint files' refusal) is a method of
    each home (``optim.protocol.Home``), not a branch on a flag naming the kind."""
    planted = ast.parse("def f(shard):\n    return 1 if shard.engine_owned else 0")
    assert mode_readers("engine_owned", [("optim/x.py", planted)]) == {"optim/x.py"}
    assert not mode_readers("engine_owned", _sources())
    readers = {rel for rel, tree in _sources() if rel != "optim/engine_home.py" and any(
        isinstance(n, ast.Name) and n.id == "EngineHome" for n in ast.walk(tree))}
    assert readers <= {"optim/shard.py", "optim/protocol.py"}, sorted(readers)


def test_the_step_functions_are_called_from_one_module():
    """``backends.step_function`` / ``list_step_function`` are obtained (and the kernels'
    entry points imported) only by the launch part (and torch.library's operator); the
    shard hands its launches to it."""
    entry = {"step_function", "list_step_function"}
    kernels = {"adam_step", "adam_step_list", "adam8_step", "adam_bf16_step"}
    found = set()
    for rel, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in entry:
                found.add(rel)
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("zero_triton.kernels.") \
                    and kernels & {a.name for a in node.names} and rel != "native/backends.py":
                found.add(rel)
    assert found == {"optim/launch.py", "native/ops.py"}, sorted(found)


# The layout's position arithmetic: where a parameter's elements sit in a rank's shard.
POSITIONS = {"ranges_in", "shard_segments", "canonical_segments", "shard_range"}
# Who may compute positions: the state layer (the layout, the per-parameter view, the
# store) and the step's side (the home and shard, the buckets that average gradients);
# every way out of the state (state dicts, DCP, compact, checkpoints) reads them from
# ``state/param_view.py``.
POSITION_READERS = {"optim/flat_home.py", "optim/shard.py", "comm/buckets.py"}


def position_readers() -> set:
    found = set()
    for rel, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in POSITIONS and isinstance(node.ctx, ast.Load):
                found.add(rel)
    return found


def test_the_ways_out_see_the_state_through_the_per_parameter_view():
    readers = position_readers()
    assert "state/param_view.py" in readers  # the check sees a reader: it can fail
    outside = {r for r in readers if not r.startswith("state/")} - POSITION_READERS
    assert not outside, f"position arithmetic outside the state layer's view: {sorted(outside)}"


def test_no_attribute_is_passed_through_by_name_in_optim_or_comm():
    """No ``__getattr__`` in ``optim/`` or ``comm/``, and no ``setattr(self, name, ...)``
    copies there or in ``state/``: a part's members are declared where it is (a wrapper
    that forwards whatever is asked hides what it depends on)."""
    def passes_through(node) -> bool:
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
            return True
        return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
            and node.func.id == "setattr" and isinstance(node.args[0], ast.Name) \
            and node.args[0].id == "self"
    found = [f"{rel}:{node.lineno}" for rel, tree in _sources()
             if rel.startswith(("optim/", "comm/", "state/"))
             for node in ast.walk(tree) if passes_through(node)]
    assert not found, "declare the members instead: " + ", ".join(found)


def test_a_seat_shows_its_declared_members_only():
    """What the optimizers' parts are handed (``optim/seat.py``): the members the seat
    declares (``param_groups``, ``state``, Join's calls and the optimizer's parts), no
    other attribute of the optimizer, and it does not keep a dropped optimizer alive."""
    import gc

    import torch
    import zero_triton
    from zero_triton.optim.seat import seat_of
    p = torch.nn.Parameter(torch.zeros(3))
    opt = zero_triton.FusedAdamW([p])
    seat = seat_of(opt)
    assert seat.param_groups is opt.param_groups and seat.state is opt.state
    assert seat.comm.world_size == 1 and [f for _, f in seat.shards()]
    for undeclared in ("_comm", "defaults", "add_param_group"):  # nothing passed through by name
        with pytest.raises(AttributeError):
            getattr(seat, undeclared)
    del opt
    gc.collect()
    assert seat.optimizer is None


def _protocol_members(proto) -> tuple:
    """(methods, data attributes) a Protocol declares."""
    methods = {n for n, v in vars(proto).items() if callable(v) and not n.startswith("_")}
    return methods, set(proto.__annotations__)


def test_the_parts_implement_the_protocols_they_are_chosen_by():
    """The ranks parts (``OneRank``, ``AgreedRanks``) implement ``Ranks`` and the places
    (``DevicePlace``, ``HostPlace``: offload chosen once, when a shard is built)
    implement ``Place``: every declared method, and the data on a built one."""
    import inspect

    import torch
    import zero_triton
    from zero_triton.optim.protocol import Place, Ranks
    from zero_triton.optim.ranks import AgreedRanks, CapturedRanks, OneRank

    methods, data = _protocol_members(Ranks)
    assert {"enter", "agree", "backward_entry", "catch_up"} <= methods  # the check sees them
    for cls in (OneRank, AgreedRanks, CapturedRanks):
        assert not [m for m in methods if not callable(getattr(cls, m, None))], cls
        init = "".join(inspect.getsource(c.__init__) for c in cls.__mro__[:-1] if "__init__" in vars(c))
        assert all(hasattr(cls, d) or f"self.{d} =" in init for d in data), cls
    methods, data = _protocol_members(Place)
    assert {"fetch", "grad", "done", "pull", "push", "write"} <= methods
    for offload in (None, "cpu"):
        p = torch.nn.Parameter(torch.zeros(64))
        opt = zero_triton.FusedAdamW([p], offload=offload)
        (side,) = opt._shards.groups[0][0].sides
        assert isinstance(side.place, Place), type(side.place)
        assert side.place.offloaded == (offload is not None)
        assert side.state.master.mirror is side.place  # the master keeps the views through it


def test_both_homes_implement_the_declared_home():
    """``FlatHome`` and ``EngineHome`` implement ``optim.protocol.Home``: every declared
    method with its signature, and the data on a built flat home and in the engine
    home's class or constructor."""
    import inspect

    import torch
    import zero_triton
    from conftest import assert_signature
    from zero_triton.optim.engine_home import EngineHome
    from zero_triton.optim.flat_home import FlatHome
    from zero_triton.optim.protocol import Home

    methods, data = _protocol_members(Home)
    assert {"grad", "first_moved", "rehomed", "views"} <= methods and "segments" in data
    for cls in (FlatHome, EngineHome):
        for m in methods:
            assert_signature(cls, Home, m)
    init = inspect.getsource(EngineHome.__init__)
    assert all(hasattr(EngineHome, d) or f"self.{d} =" in init or f"self.{d}," in init
               for d in data), sorted(d for d in data if not hasattr(EngineHome, d))
    opt = zero_triton.FusedAdamW([torch.nn.Parameter(torch.zeros(64))])
    home = opt._shards.groups[0][0].home
    assert isinstance(home, Home) and type(home) is FlatHome


@pytest.mark.parametrize("capturable", [False, True])
def test_capturable_is_chosen_once_into_the_parts_it_changes(capturable):
    """``optim/capture.py``'s mode hands each part its own: the reducer's staging, the
    buffers of clipping and of a DTensor's rows, torch's group key; nothing below asks."""
    import torch
    import zero_triton
    from zero_triton.comm.staging import OwnStaging, Staging
    from zero_triton.optim.capture import CAPTURED, EAGER
    from zero_triton.state.buffers import PLAIN, Kept

    p = torch.nn.Parameter(torch.zeros(64))
    opt = zero_triton.FusedAdamW([p], capturable=capturable, backend="triton")
    assert opt._spec.capture is (CAPTURED if capturable else EAGER)
    assert type(opt._reducer.staging) is (OwnStaging if capturable else Staging)
    assert opt._reducer.early is False  # one process: nothing launched from backward
    assert isinstance(opt._clipping.buffers, Kept) if capturable else opt._clipping.buffers is PLAIN
    assert opt.param_groups[0]["capturable"] is capturable
    copy = __import__("copy").deepcopy(opt)  # a copy is built with the same mode
    assert copy._spec.capture is opt._spec.capture


def test_offload_is_chosen_once_into_a_placement():
    """``offload``/``offload_fraction`` become a placement (``optim/offload.py``) that
    makes each shard's places; a copy is built with the same one."""
    import copy

    import torch
    import zero_triton
    from zero_triton.optim.offload import BESIDE, Offloaded

    for offload, fraction, sides in ((None, None, [False]), ("cpu", None, [True]),
                                     ("cpu", 0.5, [False, True]), ("cpu", 0, [False])):
        ps = [torch.nn.Parameter(torch.zeros(64)) for _ in range(4)]
        opt = zero_triton.FusedAdamW(ps, offload=offload, offload_fraction=fraction)
        placement = opt._spec.placement
        assert placement is BESIDE if sides == [False] else isinstance(placement, Offloaded)
        assert [s.place.offloaded for s in opt._shards.groups[0][0].sides] == sides, (offload, fraction)
        assert copy.deepcopy(opt)._spec.placement.keywords == placement.keywords


def _written_fields(tree, names) -> list:
    """(line, field) of each assignment to ``<name>.<field>`` for a variable or attribute
    called one of ``names``."""
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, (ast.Attribute, ast.Name)):
                    base = sub.value.attr if isinstance(sub.value, ast.Attribute) else sub.value.id
                    if base in names:
                        found.append((node.lineno, sub.attr))
    return found


def test_the_reducers_fields_are_written_in_its_own_module_only():
    """The reducer (``comm/buckets.py``) changes its own state: the other modules call its
    methods (``start_gathers``, ``set_overlapped``, ``accumulating``, ...)."""
    planted = _written_fields(ast.parse("opt._reducer.gathering = True\nseat.reducer.sync = 1"),
                              ("reducer", "_reducer"))
    assert [f for _, f in planted] == ["gathering", "sync"]  # the check sees a write
    found = [f"{rel}:{line} {field}" for rel, tree in _sources() if rel != "comm/buckets.py"
             for line, field in _written_fields(tree, ("reducer", "_reducer"))]
    assert not found, "call a method of the reducer instead: " + ", ".join(found)


def _field_writes(tree) -> list:
    """(line, object, field) of each assignment to ``<object>.<field>`` where the object is
    a bucket (a name or attribute ``bucket``, ``b``, ``*_bucket``, an item of ``buckets``)
    or a bucket's staging (``staged``)."""
    def kind(value):
        if isinstance(value, ast.Subscript):
            value = value.value
        name = value.id if isinstance(value, ast.Name) else \
            value.attr if isinstance(value, ast.Attribute) else ""
        if name == "staged":
            return "staged"
        if name in ("bucket", "b", "buckets") or name.endswith("bucket"):
            return "bucket"
        return None

    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                if isinstance(t, ast.Attribute) and kind(t.value):
                    found.append((node.lineno, kind(t.value), t.attr))
    return found


# A bucket's states and transitions (``comm/buckets.py`` ``Bucket``, its launches by the
# ``Reducer``) and its staging's (``comm/staging.py`` ``Staged``, moved by ``Staging``):
# each written in its own module; the others call their methods.
FIELD_HOMES = {"bucket": "comm/buckets.py", "staged": "comm/staging.py"}


def test_the_buckets_fields_are_written_in_their_own_modules_only():
    planted = _field_writes(ast.parse(
        "b.gather = 1\nself.buckets[k].watch = f\nbucket.staged.pool = p\nx.y, b.z = 1, 2"))
    assert planted == [(1, "bucket", "gather"), (2, "bucket", "watch"), (3, "staged", "pool"),
                       (4, "bucket", "z")]  # the check sees each kind of write
    found = [f"{rel}:{line} {what}.{field}" for rel, tree in _sources()
             for line, what, field in _field_writes(tree) if FIELD_HOMES[what] != rel]
    assert not found, "call the bucket's (or its staging's) method instead: " + ", ".join(found)


def test_one_way_to_list_the_shards():
    """The shards are listed in ``optim/shards.py`` (``Shards.listed``; ``followed``,
    after following what the user moved); the parts read them through ``Seat.shards``,
    the layers above through ``Internals.shards``. The seven ways of before are gone,
    and nothing calls them (a checkpoint's ``Target.flats`` are flat buffers: it refuses
    the engine's shards)."""
    from zero_triton.optim.fused import FusedAdam
    from zero_triton.optim.interface import Internals
    from zero_triton.optim.seat import Seat

    old = {"_all_flats", "_current_flats", "_flat_shards", "_flats", "flats", "all_flats",
           "current_flats", "flat_shards"}
    for cls in (FusedAdam, Seat, Internals):
        assert not old & set(dir(cls)), (cls.__name__, sorted(old & set(dir(cls))))
    calls = [f"{rel}:{node.lineno} {node.attr}" for rel, tree in _sources() for node in ast.walk(tree)
             if isinstance(node, ast.Attribute) and node.attr in old - {"flats"}]
    assert not calls, calls
