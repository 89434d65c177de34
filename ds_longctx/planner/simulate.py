"""One rank's forward + backward, run for real on fake tensors under a fake process group.

The model is built from its HF config inside ``FakeTensorMode`` (shapes and dtypes, no storage), our
``patch.patch_model`` installs exactly what training installs (attention, memory stack, SP loss),
and the step runs under :class:`Accountant`, which counts every storage the real code creates and
frees, split by where it lives (device / host) and by what created it (attention / mlp / loss /
other). Collectives go to torch's "fake" backend, which returns without moving data: every rank's
shapes are the same, so rank 0's step is every rank's step.

Simulated device. Fake CUDA tensors exist on a CPU-only torch, but autograd aborts on them (the
engine needs a CUDA device guard) and SDPA on them falls back to the math kernel (an S x S matrix).
So the GPU is stood in for by the ``meta`` device: offloaded tensors (``.to("cpu")``) then land on
fake ``cpu`` and are counted as host bytes, and SDPA on meta gets a kernel for the simulation (torch.library,
:func:`_flash_sdpa_on_meta`) that runs it as the GPU's flash kernel (out + fp32 LSE saved, no S x S matrix).
``device="cpu"`` simulates a CPU run instead (host and device are the same memory there); the CPU
tests use it to compare with real CPU measurements.
"""
from __future__ import annotations

import contextlib
import copy
import pickle
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..attention import kernels, registry
from ..attention.kernels import backward_workspace_bytes  # (importing it registers the ds_longctx attention ops)
from ..data.batch import BATCH_KEY, RING_KEY
from ..dist.comm import build_ring_groups, disable_cpu_shm_allreduce
from ..dist.layout import Layout
from ..measure import flops as _flops
from ..measure.allocator import replay
from ..memory.checkpointing import around_checkpointed_runs
from ..memory.offload import OffloadTarget
from ..measure.simulation import simulated_step
from ..memory.tiles import representative
from ..models import layer_role, text_config
from ..patching.patch import patch_model
from ..patching.sp_batch import hands_hf_no_mask
from ..patching.spec import build_spec
from .model_states import model_dtype
from .recurrent import gated_delta_as_kernel

CATEGORIES = ("attention", "mlp", "loss", "other")
_TAG = "ds_longctx_planner_tag"


class NeedsOwnProcess(RuntimeError):
    """The process already runs a real process group; the fake one needs a process of its own."""


# ---------------------------------------------------------------------------------------------
# fake world
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def fake_world(world_size: int):
    """A default process group of ``world_size`` fake ranks (this process is rank 0)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        if dist.get_backend() != "fake":
            raise NeedsOwnProcess("a real process group is initialized in this process")
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    import deepspeed.comm as ds_comm

    # DeepSpeed's comm wrapper (used by its Ulysses attention) must see a backend; it wraps ours.

    disable_cpu_shm_allreduce()
    ds_comm.init_distributed(dist_backend="fake", auto_mpi_discovery=False, dist_init_required=False,
                             verbose=False)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def _contiguous_positions():
    """HF looks for packed sequences in position_ids by reading their values; on fake tensors it cannot
    and assumes packing, which materializes an [s, s] mask. The planner's position_ids are one
    contiguous sequence, for which the real run finds no packing: give that answer. Only where HF builds its
    own mask (HF's attention, or architectures outside ds_longctx.models): otherwise the forward hands HF a 4-D
    no-mask (sp_batch.hands_hf_no_mask), which HF returns as given without looking at position_ids.

    The one swap left (issue 23 item 2), because no input reaches the real run's answer on fake tensors:
    transformers 5.24's ``_preprocess_mask_arguments`` calls ``find_packed_sequence_indices`` whenever
    position_ids are given (the decoder makes them when the caller does not), the mask is None and there is
    no cache, and that function returns the packed mask whenever ``is_tracing`` holds, which it does for
    every FakeTensor; an all-ones 2-D mask instead (what the document wrapper passes for packed batches
    under our attention) is materialized too (``_ignore_causal_mask_sdpa`` refuses to skip a fake padding
    mask). Only HF's early exits (a 4-D mask, an attention name without a mask function) would avoid it,
    which would change what the real run passes HF. Without this, a 2-layer step of a tiny Llama under
    transformers' own attention at 8,192 tokens is 4.32 GB instead of 42 MB (its [s, s] masks, about 64 bytes per
    query-key pair; tests/test_planner_state.py). The shipped configs (untied attention on the architectures of
    ds_longctx.models) hand HF a no-mask and never enter it."""
    import transformers.masking_utils as mu

    orig = mu.find_packed_sequence_indices
    mu.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        mu.find_packed_sequence_indices = orig


# ---------------------------------------------------------------------------------------------
# accounting
# ---------------------------------------------------------------------------------------------


class Accountant(TorchDispatchMode):
    """Live storage bytes created inside the mode, by place (device/host) and category.

    Category: the innermost attention/MLP module whose forward is running (forward, and recompute
    under checkpointing); in backward, the category of the module whose forward created the autograd
    node being run (recorded on ``node.metadata`` by :class:`_Tagger`); else ``default``.
    """

    def __init__(self, device_type: str):
        super().__init__()
        self.device_type = device_type
        self.live: Dict[tuple, int] = {}
        self.peak_device = 0
        self.peak_breakdown: Dict[str, int] = {c: 0 for c in CATEGORIES}
        self.host_at_peak = 0
        self.peak_host = 0
        self.stack: List[str] = []
        self.default = "other"
        self._dev = 0
        self._host = 0
        self._seen: Dict[int, tuple] = {}
        self._ignored: set = set()
        self.host_scope = False
        self._last_bwd = "other"
        self._keep: list = []
        # work of the step (measure/flops.py): (kind, phase, key) -> [flops, bytes, calls]; phase forward / backward /
        # recompute (a forward op run inside backward: checkpoint recompute, tiled recompute, attention recompute)
        self.work: Dict[tuple, List[float]] = {}
        self.in_backward = False
        self.recomputing = 0
        # device allocations and frees in order, for the caching-allocator model (measure/allocator.py)
        self.device_events: List[tuple] = []

    def ignore(self, tensors):
        """Storages that existed before the step (parameters, buffers): views of them are not new."""
        for t in tensors:
            st = t.untyped_storage()
            self._keep.append(st)  # pins the id while ignored
            self._ignored.add(id(st))

    def category(self) -> str:
        if self.stack:
            return self.stack[-1]
        node = torch._C._current_autograd_node()
        if node is not None:
            tag = node.metadata.get(_TAG)
            if tag is None:
                # a graph built inside another node's backward (tiled recompute): that node's category
                return self._last_bwd
            self._last_bwd = tag
            return tag
        return self.default

    def _track(self, t: torch.Tensor, op: str = ""):
        try:
            st = t.untyped_storage()
        except Exception:
            return
        key = id(st)
        nbytes = st.nbytes()
        if key in self._seen or key in self._ignored or nbytes == 0:
            return
        where = "device" if t.device.type == self.device_type and not self.host_scope else "host"
        slot = (where, self.category())
        self._seen[key] = (slot, nbytes)
        self.live[slot] = self.live.get(slot, 0) + nbytes
        if where == "device":
            self._dev += nbytes
            # stream 0 (the compute stream: the simulation runs everything on it), label "category/op": what
            # measure/allocator.py charges stranded bytes to
            self.device_events.append(("+", key, nbytes, 0, f"{slot[1]}/{op}"))
            if self._dev > self.peak_device:
                self.peak_device = self._dev
                self.peak_breakdown = {c: self.live.get(("device", c), 0) for c in CATEGORIES}
                self.host_at_peak = self._host
        else:
            self._host += nbytes
            self.peak_host = max(self.peak_host, self._host)
        weakref.finalize(st, Accountant._free, weakref.ref(self), key)

    @staticmethod
    def _free(ref, key):
        me = ref()
        if me is None or key not in me._seen:
            return
        slot, nbytes = me._seen.pop(key)
        me.live[slot] -= nbytes
        if slot[0] == "device":
            me._dev -= nbytes
            me.device_events.append(("-", key))
        else:
            me._host -= nbytes

    def _count(self, func, args, kwargs, out):
        _flops.add_work(self.work, func, args, kwargs, out, self.in_backward, bool(self.recomputing))

    def _transient(self, func, args):
        """Memory a kernel holds only during its call (the GPU attention backward's workspace): peak only."""
        if func._overloadpacket is not _ATTN_BWD or self.device_type != "meta" or args[1].device.type != "meta":
            return
        work = backward_workspace_bytes(tuple(args[1].shape), tuple(args[2].shape), args[1].element_size())
        key = ("workspace", len(self.device_events))
        self.device_events += [("+", key, work, 0, f"{self.category()}/attention_backward workspace"), ("-", key)]
        if self._dev + work > self.peak_device:
            self.peak_device = self._dev + work
            self.peak_breakdown = {c: self.live.get(("device", c), 0) for c in CATEGORIES}
            self.peak_breakdown[self.category()] += work
            self.host_at_peak = self._host

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _PRIM_DEVICE and len(args) == 1 and type(args[0]) is FakeTensor:
            # what FakeTensor's own dispatch answers (fake_tensor.py), without the trip through the
            # mode stack: ``.device`` is queried for nearly every op (over half of all dispatches)
            return torch.device("meta") if args[0].fake_mode.in_kernel_invocation else args[0].fake_device
        kwargs = kwargs or {}
        written = _written_args(func)
        if written is not None:
            flat = tree_flatten((args, kwargs))[0]
            if all(type(t) is FakeTensor and t.constant is None for t in flat if isinstance(t, torch.Tensor)):
                # an in-place / out= op on fake tensors allocates nothing and changes no metadata: its
                # result is the mutated argument(s) (no fake constant to invalidate). Answered here
                # without FakeTensorMode's dispatch, which is most of the simulation's time (the staged
                # attention's GEMMs into send buffers and gradient accumulations are such ops).
                res = _mutated_results(func, written, args, kwargs)
                if res is not _NOT_SHORT:
                    self._count(func, args, kwargs, res)
                    return res
        out = func(*args, **kwargs)
        self._count(func, args, kwargs, out)
        if getattr(func, "is_view", False):  # a view allocates nothing (its base may predate the step)
            return out
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t, func._overloadpacket.__name__)
        self._transient(func, args)
        return out


_NOT_SHORT = object()
_ATTN_BWD = torch.ops.ds_longctx.attention_backward
_PRIM_DEVICE = torch.ops.prim.device.default
_WRITTEN: Dict[object, Optional[tuple]] = {}


def _written_args(func):
    """For an op whose every result is one of its arguments, written in place (``add_``, ``copy_``,
    ``mm.out``): per result, the (position, name) of that argument; else None. Ops that change a
    tensor's metadata or storage (``resize_``, ``set_``, ``t_``: tag ``inplace_view``) are excluded."""
    try:
        return _WRITTEN[func]
    except KeyError:
        pass
    found = None
    schema = getattr(func, "_schema", None)
    if schema is not None and schema.is_mutable and torch.Tag.inplace_view not in func.tags:
        by_set = {}
        for i, a in enumerate(schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write and len(a.alias_info.before_set) == 1:
                by_set[next(iter(a.alias_info.before_set))] = (i, a.name, a.kwarg_only)
        outs = []
        for r in schema.returns:
            ai = r.alias_info
            if ai is None or not ai.is_write or len(ai.before_set) != 1 or next(iter(ai.before_set)) not in by_set:
                outs = None
                break
            outs.append(by_set[next(iter(ai.before_set))])
        if outs:  # ops without results (``_foreach_add_``) go the normal way
            found = tuple(outs)
    _WRITTEN[func] = found
    return found


def _mutated_results(func, written, args, kwargs):
    res = []
    for i, name, kwarg_only in written:
        t = kwargs.get(name) if (kwarg_only or i >= len(args)) else args[i]
        if not isinstance(t, torch.Tensor):
            return _NOT_SHORT
        if kwarg_only and t.numel() == 0:  # an empty out= tensor gets resized to the result
            return _NOT_SHORT
        res.append(t)
    return res[0] if len(res) == 1 else tuple(res)


class _SimHostTarget(OffloadTarget):
    """Offload target for the simulation: the host copy is a fake CPU tensor made inside the modes and
    counted as host memory (the memory stack's CPU target makes real copies outside every mode, which
    under fake tensors would allocate real memory). Same shapes and lifetimes as the pinned target."""

    def __init__(self, acct: "Accountant"):
        self.acct = acct

    def to_host(self, t):
        self.acct.host_scope = True
        try:
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            host.copy_(t.detach())
        finally:
            self.acct.host_scope = False
        return host, None

    def to_device(self, host, device):
        # a restored layer input is the residual stream ("other"), whichever backward node (often the
        # MLP's, whose unpack starts the recompute) happens to be running when it is brought back
        self.acct.stack.append("other")
        try:
            out = torch.empty(host.shape, dtype=host.dtype, device=device)
            out.copy_(host)
        finally:
            self.acct.stack.pop()
        return out, None


def _grad_fns(obj):
    return [t.grad_fn for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor) and t.grad_fn is not None]


def _tag_graph(roots, tag: str, boundary: set):
    """Record ``tag`` on every autograd node reachable from ``roots`` that no earlier module claimed,
    stopping at the module's inputs."""
    stack = list(roots)
    seen = []  # keeps visited wrappers alive so their ids stay unique during the walk
    ids = set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in boundary or id(node) in ids:
            continue
        seen.append(node)
        ids.add(id(node))
        # walk through nodes an inner module already claimed: the nodes between an inner module's
        # input and this module's input (a norm before the MLP) are reachable only through them
        node.metadata.setdefault(_TAG, tag)
        stack.extend(n for n, _ in node.next_functions)


class _Tagger:
    """Module hooks that tell the Accountant which category is running and tag autograd nodes."""

    def __init__(self, acct: Accountant, model):
        self.acct = acct
        self.handles = []
        self.boundaries: List[set] = []
        decoder = model.get_decoder()
        for layer in decoder.layers:
            for name, child in layer.named_children():
                role = layer_role(name)
                if role is not None:
                    self._hook(child, role, push=True)
            # pushes too, so that a layer recomputed in backward (checkpointing) is charged to its
            # own ops, not to the node whose backward triggered the recompute
            self._hook(layer, "other", push=True)
        self._hook(decoder, "other", push=False, after="loss")
        self._hook(model, "loss", push=False, after="other")

    @contextlib.contextmanager
    def layer_run(self):
        """transformers checkpoints a layer's ``forward``, not ``__call__``: the recompute in backward runs
        without the layer's module hooks, so without this its norms and residual adds would be charged to
        whichever backward node (the MLP's) triggered the recompute. Entered around every run of a
        checkpointed layer function, forward and recompute alike (memory/checkpointing.py's
        around_checkpointed_runs seam; child attention/MLP hooks still push theirs)."""
        self.acct.stack.append("other")
        self.acct.recomputing += self.acct.in_backward
        try:
            yield
        finally:  # checkpoint's early stop raises out of the recompute
            self.acct.recomputing -= self.acct.in_backward
            self.acct.stack.pop()

    def _hook(self, module, tag, push: bool, after: Optional[str] = None):
        def pre(mod, args, kwargs):
            # keep the node objects alive until the post-hook: a node's Python wrapper (and so its
            # id) is recreated once the last reference to it dies
            nodes = _grad_fns((args, kwargs))
            self.boundaries.append(({id(n) for n in nodes}, nodes))
            if push:
                self.acct.stack.append(tag)

        def post(mod, args, kwargs, output):
            boundary, _nodes = self.boundaries.pop() if self.boundaries else (set(), None)
            _tag_graph(_grad_fns(output), tag, boundary)
            if push and self.acct.stack:
                self.acct.stack.pop()
            if after is not None:
                self.acct.default = after

        self.handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        # always_call: checkpoint recompute stops early by raising, which would leave the tag pushed
        self.handles.append(module.register_forward_hook(post, with_kwargs=True, always_call=True))

    def remove(self):
        for h in self.handles:
            h.remove()


_SIM_KERNEL = "planner_meta_flash"


class _MetaFlash(torch.autograd.Function):
    """SDPA on the meta stand-in as the GPU's flash kernel: the ds_longctx attention ops (their fakes: out + fp32
    LSE saved, K/V with their own head count under GQA; their FLOP formulas; the backward's workspace charged by
    the Accountant). Layout [b, h, s, d] in, the ops' [b, s, h, d] inside."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        out, lse = torch.ops.ds_longctx.attention_forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                          causal, scale, _SIM_KERNEL)
        ctx.causal, ctx.scale = causal, scale
        ctx.save_for_backward(q, k, v, out, lse)
        return out.transpose(1, 2)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.ops.ds_longctx.attention_backward(dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2),
                                                             v.transpose(1, 2), out, lse, ctx.causal, ctx.scale,
                                                             _SIM_KERNEL)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), None, None


def _sdpa_on_meta(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``aten::scaled_dot_product_attention`` for tensors on the meta stand-in device (its autograd kernel, so
    that the flash stand-in's own autograd node is recorded). Without a mask: what CUDA's SDPA runs, the flash
    kernel (out + fp32 LSE saved; under GQA (``enable_gqa``) K/V keep their head count, as flash takes them).
    With an explicit mask: torch's own composite (the math kernel) on meta, as before."""
    if attn_mask is None:
        sc = float(scale) if scale is not None else query.shape[-1] ** -0.5
        return _MetaFlash.apply(query, key, value, bool(is_causal), sc)
    return torch.ops.aten.scaled_dot_product_attention.default.decompose(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)


@contextlib.contextmanager
def _flash_sdpa_on_meta(device: str):
    """On the meta stand-in device, SDPA runs as the CUDA flash kernel does (out + fp32 LSE saved, GQA
    without repeating K/V), not as the math fallback (an S x S matrix) that torch picks for meta (its SDPA
    backend choice is a per-device stub with no meta entry, so registering ``aten::_fused_sdp_choice`` for
    Meta is never consulted). Done as a kernel of ``aten::scaled_dot_product_attention`` for the Meta autograd
    key (torch.library), registered for the simulation and removed after it: no function of torch or
    transformers is replaced, tensors on every real device are untouched, and every SDPA call on the stand-in
    reaches it however it is made (HF's ``F.scaled_dot_product_attention``, a direct import, checkpoint
    recomputation in backward)."""
    if device != "meta":
        yield
        return
    lib = torch.library.Library("aten", "IMPL")
    try:
        lib.impl("scaled_dot_product_attention", _sdpa_on_meta, "AutogradMeta")
        yield
    finally:
        lib._destroy()  # what torch.library._scoped_library does: the registration goes with the block


def _meta_backend_class():
    """A backend for ds_longctx.attention.kernels on the meta stand-in device, with flash-attention-2's
    memory (native GQA). Registered only while a simulation runs."""
    class MetaFlash(kernels.Backend):
        name = _SIM_KERNEL
        native_gqa = True
        device_type = "meta"
        fake_only = True  # runs as the attention ops' fakes (kernels.py), never on real tensors

        @staticmethod
        def available() -> bool:
            return True

    return MetaFlash


@contextlib.contextmanager
def _meta_kernels(device: str):
    """On the meta stand-in device every configured kernel ("auto", "sdpa", a flash kernel) means that
    kernel on the GPU: resolve them all to flash-attention-2's memory."""
    if device != "meta":
        yield
        return

    with kernels.overridden("meta", _meta_backend_class()):
        yield


# ---------------------------------------------------------------------------------------------
# the step
# ---------------------------------------------------------------------------------------------


@dataclass
class StepMemory:
    peak_device: int
    breakdown: Dict[str, int]
    host_at_peak: int
    peak_host: int
    num_layers: int
    seconds: float  # wall time of this call: the simulation's, or on a memo hit (:func:`simulate_step`) the lookup's
    notes: List[str] = field(default_factory=list)
    # (kind, phase, key) -> (flops, bytes, calls) of the step (Accountant.work; measure/flops.py)
    work: Dict[tuple, tuple] = field(default_factory=dict)
    # the step's device allocations replayed through the caching-allocator model (measure/allocator.py), per
    # allocator mode ("expandable": PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, "classic": torch's default):
    # {"allocated": replay's peak allocated (512 B rounding), "reserved": its peak reserved, "stranded": [[label,
    # bytes], ...] the requests that mapped memory while free blocks were too small, largest first, "floor": what no
    # out-of-memory retry could release at the allocated peak (measure/allocator.CachingAllocatorModel.floor)}
    allocator: Dict[str, dict] = field(default_factory=dict)

    def reserved_slack(self, mode: str, what: str = "reserved") -> int:
        """Reserved beyond the live peak under ``mode`` (``what`` "reserved": what the caching allocator holds with
        room to spare, that the step cannot use; "floor": what it holds at least, after releasing every cached block)."""
        a = self.allocator.get(mode)
        return max(0, a[what] - a["allocated"]) if a else 0


ALLOCATOR_MODES = {"expandable": True, "classic": False}


def allocator_replay(events, top: int = 6) -> Dict[str, dict]:
    """The step's device events through the caching-allocator model in each mode (StepMemory.allocator)."""
    out = {}
    for mode, expandable in ALLOCATOR_MODES.items():
        r = replay(events, expandable)
        out[mode] = {"allocated": r.peak_allocated, "reserved": r.peak_reserved, "floor": r.floor,
                     "stranded": [[str(k), v] for k, v in list(r.stranded_by_label().items())[:top]]}
    return out


def with_layers(model_config, num_layers: int):
    cfg = copy.deepcopy(model_config)
    tc = text_config(cfg)
    tc.num_hidden_layers = num_layers
    for key in ("layer_types", "mlp_only_layers"):
        val = getattr(tc, key, None)
        if isinstance(val, list) and len(val) > num_layers:
            setattr(tc, key, val[:num_layers])
    return cfg


def dtype_of(ds_config: dict) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[model_dtype(ds_config)]


def build_model(model_config, dtype: torch.dtype, device: str, mode):
    from transformers import AutoModelForCausalLM

    attn = getattr(model_config, "_attn_implementation", None)
    if attn in (None, "eager") or "flash" in str(attn):
        # flash_attention_* needs the flash_attn package; sdpa's flash path has the same memory
        attn = "sdpa"
    with mode, torch.device(device):
        model = AutoModelForCausalLM.from_config(model_config, dtype=dtype, attn_implementation=attn)
    model.train()
    return model


# ---------------------------------------------------------------------------------------------
# memo: a step is a pure function of its inputs; the planner asks for the same step many times in one process
# (max_context's full-depth re-check of a shallow model, resolve_auto's candidates, the tests' plans)
# ---------------------------------------------------------------------------------------------

_MEMO: "OrderedDict[tuple, StepMemory]" = OrderedDict()
_MEMO_SIZE = 512  # entries (a StepMemory is a few KB: its work table)
_MEMO_OFF = [0]


@contextlib.contextmanager
def no_memo():
    """Inside: every :func:`simulate_step` simulates, and stores nothing. For callers that swap a function the
    simulation runs (tests showing what a piece of the simulation changes): the memo's key holds the step's inputs,
    not the code that runs it."""
    _MEMO_OFF[0] += 1
    try:
        yield
    finally:
        _MEMO_OFF[0] -= 1


def clear_memo():
    _MEMO.clear()


def _kernel_tables() -> tuple:
    """The attention kernel tables a step on a real device type resolves its kernel from (tests register backends)."""
    return tuple(tuple(sorted((k, v if isinstance(v, tuple) else id(v)) for k, v in table.items()))
                 for table in (kernels.BACKENDS, kernels._AUTO_ORDER, kernels._OVERRIDES, kernels._BANDED))


def _memo_key(model_config, ds_config, lc, world_size, seq_len, num_layers, device, batch_size) -> Optional[tuple]:
    """Everything the step reads: the model config (every attribute, sub-configs included: pickled), the parsed
    section, the dtype (the one thing read from ``ds_config``), world, length, depth, device, batch, and the kernel
    tables. None (no memo) for inputs that do not pickle."""
    try:
        return (type(model_config), pickle.dumps(model_config), type(lc), pickle.dumps(lc), dtype_of(ds_config),
                int(world_size), int(seq_len), int(num_layers), str(device), int(batch_size), _kernel_tables())
    except Exception:
        return None


def simulate_step(model_config, ds_config: dict, lc, world_size: int, seq_len: int, num_layers: int,
                  device: str = "meta", batch_size: int = 1) -> StepMemory:
    """Peak memory of one training step (forward + backward) on rank 0 of ``world_size`` fake ranks.

    Parameter storage and final full gradients are not counted here (they are model states, sized
    by arithmetic); transient full gradients inside backward are, since they exist on the device.

    The result is a function of the inputs alone: a step already simulated in this process with the same inputs
    (:func:`_memo_key`) is answered from a memo (a copy; its ``seconds`` is then the lookup's wall time, not the
    original simulation's). :func:`no_memo` turns it off.
    """
    t0 = time.perf_counter()
    key = None if _MEMO_OFF[0] else _memo_key(model_config, ds_config, lc, world_size, seq_len, num_layers, device,
                                                batch_size)
    hit = _MEMO.get(key) if key is not None else None
    if hit is not None:
        _MEMO.move_to_end(key)  # the most recently used (eviction takes the least)
        res = copy.deepcopy(hit)
        res.seconds = time.perf_counter() - t0
        return res
    res = _simulate_step(model_config, ds_config, lc, world_size, seq_len, num_layers, device, batch_size, t0)
    if key is not None:
        _MEMO[key] = copy.deepcopy(res)
        while len(_MEMO) > _MEMO_SIZE:
            _MEMO.popitem(last=False)
    return res


def _simulate_step(model_config, ds_config: dict, lc, world_size: int, seq_len: int, num_layers: int,
                   device: str, batch_size: int, t0: float) -> StepMemory:
    from torch._subclasses.fake_tensor import FakeTensorMode

    sp = lc.sequence_parallel_size
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_world(world_size), registry.restored(), _meta_kernels(device), _flash_sdpa_on_meta(device), \
            contextlib.ExitStack() as hf_attention:
        group = dist.new_group(list(range(sp))) if sp > 1 else None
        mc = with_layers(model_config, num_layers)
        spec = build_spec(lc, mc, Layout(world=world_size, sp=sp), group, seq_len)
        if spec.ring > 1:  # Ulysses x ring: the sub-groups on the fake world (rank 0's)
            subgroups = build_ring_groups(sp, spec.ring)
            spec = spec.with_group(group, subgroups["ulysses_group"], subgroups["ring_group"])
        model = build_model(mc, dtype_of(ds_config), device, mode)
        hf_attention.enter_context(gated_delta_as_kernel(model, device))  # fla's memory, not a 16K-step loop
        for p in model.parameters():
            if p.requires_grad:
                # DeepSpeed moves each full grad into its bucket/partition as soon as it is ready;
                # the partitions are model states, counted by arithmetic.
                p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
        patched = patch_model(model, spec)
        if not hands_hf_no_mask(model, spec.owns_attention):  # else HF gets a 4-D no-mask and looks at nothing
            hf_attention.enter_context(_contiguous_positions())
        acct = Accountant(device)
        acct.ignore(list(model.parameters()) + list(model.buffers()))
        handle = patched.memory
        if handle is not None and handle.offloader is not None:
            handle.set_offload_target(_SimHostTarget(acct))
        tagger = _Tagger(acct, model)
        local = seq_len // sp
        # the batch the training loader feeds (data.shard_batch): rank 0's shard of one dense sample per row,
        # its document structure as the real (host) tensor every rank receives
        cu = torch.tensor([[0, local * sp]] * batch_size, dtype=torch.long)
        try:
            with mode, acct, around_checkpointed_runs(tagger.layer_run), representative(), simulated_step():
                ids = torch.zeros(batch_size, local, dtype=torch.long, device=device)
                pos = torch.arange(local, device=device).unsqueeze(0).expand(batch_size, -1)
                labels = torch.zeros(batch_size, local, dtype=torch.long, device=device)
                ring = {RING_KEY: torch.tensor([spec.ring])} if spec.ring > 1 else {}  # zigzag shards
                out = model(input_ids=ids, position_ids=pos, shift_labels=labels, **{BATCH_KEY: cu}, **ring)
                loss = out.loss
                del out
                acct.in_backward = True
                loss.backward()
                del loss, ids, pos, labels
        finally:
            tagger.remove()
        res = StepMemory(acct.peak_device, acct.peak_breakdown, acct.host_at_peak, acct.peak_host, num_layers,
                         time.perf_counter() - t0)
        res.work = {k: tuple(v) for k, v in acct.work.items()}
        res.allocator = allocator_replay(acct.device_events)
        patched.remove()
        del model, patched
    return res
