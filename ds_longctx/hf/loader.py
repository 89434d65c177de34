"""The SP data loader adapter for a ds_longctx engine under Accelerate / HF Trainer / TRL.

Accelerate wraps the training loader in DeepSpeed's ``UlyssesSPDataLoaderAdapter`` when
``ParallelismConfig(sp_backend="deepspeed", sp_size=N)`` is set (``accelerate.Accelerator.
_prepare_deepspeed`` and ``Accelerator.deepspeed_ulysses_dl_adapter``, which the Trainer calls).
That adapter cannot take packed padding-free rows (TRL ``packing=True, padding_free=True``): its
``refill`` all-gathers every rank's row, and rows of different lengths fail (measured, gloo:
"ProcessGroupGloo::allgather: invalid tensor size at index 1 (expected (1, 5), got (1, 31))"); it also
reads dim 1 of every tensor, which TRL's 1-D ``cu_seq_lens_q`` does not have.

:class:`SPTurnsAdapter` keeps DeepSpeed's contract (same constructor, same order: the SP group takes
turns on each rank's batch, so an SP=N world trains the samples in the one-process order, and
``len`` is ``len(dl) * N``, ``len(dl)`` once a loader is found replicated) and shards with :func:`ds_longctx.data.shard_batch`: every rank gets the
sample's ``doc_cu_seqlens``, so attention runs per document. Each turn's batch goes from its owner
to the group by broadcast (after one small all-gather of shapes), so ranks may hold rows of any
length. A row whose length is not a multiple of SP is padded at the end with one ignored document.
Written rather than reused because DeepSpeed's adapter cannot take these rows (see above).

Evaluation takes the same turns: a full-length eval batch reaching the model (the HF Trainer's eval loop,
``engine.eval()`` in a plain loop) is sharded by :func:`shard_in_turns` (called from ``sp_batch``), so an eval
step's memory is a training step's forward.

Turns are right when each rank's loader holds different samples (the HF Trainer's loader is sharded over
all ranks). A plain Accelerate loop prepared with a ``ParallelismConfig`` shards its loader over the DP
dimension only, so every rank of an SP group holds the same batch, and turns would train each sample SP
times (DeepSpeed's adapter does that: measured, examples/accelerate_loop.py). So at each step the group
compares fingerprints of its batches: all equal at the first step means a replicated loader, and each
step's one batch is sharded once; a replicated loader that later gives different batches is an error.

:func:`ds_longctx.enable` installs :class:`RoutedSPAdapter` under DeepSpeed's class name; it picks
this adapter when the engine being trained is a ds_longctx engine and DeepSpeed's otherwise.

Resume. The Trainer fast-forwards a resumed epoch with Accelerate's ``skip_first_batches(loader, n)``
(``transformers.Trainer._run_epoch``), where ``n = (global_step % steps per epoch) x gradient_accumulation_steps``
counts what the loader it holds yields: this adapter's items, SP turns (its steps per epoch come from
``len(loader) x sp``, ``Trainer.set_initial_training_values``). Accelerate's function rebuilds a DataLoader from
``loader.dataset`` and ``loader.batch_sampler``: on an adapter it fails (no ``dataset``), and had the adapter
those attributes it would return a plain loader of full sequences with ``n`` counted as loader batches (each
sample trained again at SP x the rate). While enabled, ``skip_first_batches`` is routed here
(:func:`skip_first_items`): the wrapped loader skips ``n // sp`` whole batches through Accelerate's own
function (no sample read, its sampler and RNG handling kept), and the first refill of the new adapter drops the
``n % sp`` turns of the next batch already trained (without sending them). A loader replicated over the SP
group yields one item per batch: which case it is shows only at the first batch (the fingerprints above), so
the skip takes the ``n // sp`` batches that are right in both cases and, for a replicated loader, reads and drops
the rest. DeepSpeed's adapter (HF's own ALST path, while enabled) is skipped the same way (always turns).

Passes. ``iter(adapter)`` starts a fresh pass over the wrapped loader, as ``iter`` of a DataLoader does. The Trainer
calls it at each epoch and ends an epoch at its step count, before the loader has said StopIteration; a pass kept
across ``iter`` (DeepSpeed's adapter; this one before) spends the next epoch's first step on that StopIteration
and then trains another permutation or the data shifted by one step (measured: a Trainer run over 2+ epochs at
SP=2 departed from the one-process run at the first step of epoch 2; now equal, tests/test_trainer_resume.py).
"""
from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

from ..data.batch import document_structure
from ..data import shard_batch
from ..errors import BatchError, LongContextError, error_class
from ..loss import IGNORE_INDEX

# TRL's padding-free collator (trl.trainer.sft_trainer.DataCollatorForLanguageModeling) adds these
# for flash-attention varlen kernels and linear-attention layers. The same boundaries follow from
# position_ids (a document starts at position 0), which shard_batch turns into doc_cu_seqlens; they
# are checked against them and dropped (one [n+1] list cannot be cut per shard).
_VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def _varlen_checked(batch: dict) -> dict:
    """Drop TRL's varlen keys after checking they describe the documents the position_ids describe."""
    present = [k for k in _VARLEN_KEYS if k in batch]
    if not present:
        return batch
    out = {k: v for k, v in batch.items() if k not in _VARLEN_KEYS}
    ids, pos = batch["input_ids"], batch.get("position_ids")
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        cu = batch.get(key)
        if cu is None:
            continue
        if ids.shape[0] != 1 or pos is None:
            raise BatchError(f"batch.{key}", f"is given for input_ids {tuple(ids.shape)} "
                              f"{'without position_ids' if pos is None else '(more than one row)'}; "
                              "ds_longctx reads document boundaries from position_ids restarting per document",
                              "use TRL's padding-free collator as is (one flattened row with position_ids), or "
                              "drop cu_seq_lens_* and give position_ids")
        want = document_structure(ids, pos)[0][0].tolist()  # shard_batch's own reading of position_ids
        got = cu.detach().to("cpu", torch.long).flatten().tolist()
        if got != want:
            raise BatchError(f"batch.{key}", f"gives document boundaries {got[:8]}{'...' if len(got) > 8 else ''} "
                              f"but position_ids give {want[:8]}{'...' if len(want) > 8 else ''}",
                              "make position_ids restart at 0 exactly at every document start")
    return out


def _padded_to_multiple(batch: dict, sp: int) -> dict:
    """Pad a row whose length is not a multiple of SP with one ignored document at the end."""
    ids = batch["input_ids"]
    seq = ids.shape[1]
    extra = (-seq) % sp
    if extra == 0:
        return batch
    out = dict(batch)
    b = ids.shape[0]

    def cat(t, fill):
        return torch.cat([t, torch.full((b, extra), fill, dtype=t.dtype, device=t.device)], dim=1)

    mask = batch.get("attention_mask")
    if mask is None:
        mask = torch.ones_like(ids)
    out["attention_mask"] = cat(mask, 0)  # shard_batch: a right-padded tail is a document with ignored targets
    out["input_ids"] = cat(ids, 0)
    for key in ("labels", "shift_labels"):
        if key in batch:
            out[key] = cat(batch[key], IGNORE_INDEX)
    if "position_ids" in batch:
        out["position_ids"] = cat(batch["position_ids"], 0)  # replaced by shard_batch for the tail
    return out


def _checked_batch(batch, sp: int) -> dict:
    """What this rank contributes to the turns: validated, varlen keys folded in, padded to SP."""
    if not isinstance(batch, dict):
        raise BatchError("batch", f"is a {type(batch).__name__}; the SP data loader takes dict batches",
                          "collate samples into a dict with input_ids (labels, position_ids)")
    ids = batch.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise BatchError("batch.input_ids", f"expected a [batch, seq] tensor, got "
                          f"{tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__}",
                          "collate samples into a 2-D tensor")
    seq = ids.shape[1]
    for k, v in batch.items():
        if (k not in _VARLEN_KEYS and k not in ("input_ids", "labels", "shift_labels", "position_ids",
                                                 "attention_mask") and isinstance(v, torch.Tensor)
                and v.dim() >= 2 and v.shape[1] == seq):
            raise BatchError(f"batch.{k}", f"has the sequence dimension ({tuple(v.shape)}) but ds_longctx's SP "
                              "data loader only knows how to shard input_ids, labels, shift_labels, position_ids "
                              "and attention_mask", f"drop '{k}' from the collator's output if the model and loss do not "
                              "read it (a loss mask belongs in labels as -100, which the loader shards); a per-token "
                              "input the model needs has no SP path yet: train at sequence_parallel_size 1")
    batch = _padded_to_multiple(_varlen_checked(batch), sp)
    shard_batch(batch, 0, sp)  # every check shard_batch makes, here, before any collective
    return batch


def _fingerprint(batch: dict) -> str:
    """A digest of a batch's tensors and values: equal across ranks iff they hold the same batch."""
    import hashlib

    h = hashlib.blake2b(digest_size=16)
    for k in sorted(batch):
        v = batch[k]
        h.update(k.encode())
        if isinstance(v, torch.Tensor):
            h.update(str((tuple(v.shape), v.dtype)).encode())
            h.update(v.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(v).encode())
    return h.hexdigest()


def _describe(batch: dict) -> dict:
    return {k: (("tensor", tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else ("object", v))
            for k, v in batch.items()}


class SPTurnsAdapter:
    """DeepSpeed's ``UlyssesSPDataLoaderAdapter`` contract, sharded with ``shard_batch`` (module doc)."""

    def __init__(self, dl, sp_rank: int, sp_group, sp_world_size: int, device, replicated=None,
                 skipped: tuple = (0, 0)):
        self.dl = dl
        self.sp_rank, self.sp_group, self.sp_world_size = sp_rank, sp_group, sp_world_size
        self.device = device
        self.iter = None  # made at the first batch, after the Trainer's set_epoch
        self.micro_batches: deque = deque()
        self.replicated = replicated  # decided at the first batch (module doc) unless known
        # (items skipped, whole batches of dl's loader skipped for them): dl starts after the batches; the
        # first refill drops the rest of the items (skip_first_items)
        self.skipped, self._skip_pending = skipped, skipped[0] > 0

    def __len__(self):
        items, batches = self.skipped
        if self.replicated:
            return len(self.dl) - (items - batches)
        return len(self.dl) * self.sp_world_size - (items - batches * self.sp_world_size)

    def skip_first_batches(self, num_batches: int, skip_loader):
        """This adapter without its first ``num_batches`` items (SP turns: what a Trainer step counts), as a new
        adapter; ``skip_loader(loader, k)`` skips k batches of the wrapped loader (Accelerate's function)."""
        items, sp = int(num_batches), self.sp_world_size
        if items < 0:
            raise ValueError(f"skip_first_batches: num_batches is {items}; give a count >= 0")
        if self.skipped[0]:
            raise ValueError("skip_first_batches: this SP loader is already a skipped one; skip the loader the "
                             "Trainer / Accelerator prepared")
        batches = items if self.replicated else items // sp  # safe in both cases while undecided (module doc)
        dl = skip_loader(self.dl, batches) if batches else self.dl
        return SPTurnsAdapter(dl, self.sp_rank, self.sp_group, sp, self.device, replicated=self.replicated,
                              skipped=(items, batches))

    def __iter__(self):
        """A fresh pass over the wrapped loader, as a DataLoader's ``iter`` starts one: the Trainer calls it at each
        epoch and stops an epoch at its step count, which can leave the loader's last batch unread; kept, that pass
        would go on into the next epoch (its first step lost, the data shifted). A skipped adapter skips again."""
        self.iter = None
        self.micro_batches.clear()
        self._skip_pending = self.skipped[0] > 0
        return self

    def __getattr__(self, name):
        if name in _LOADER_ONLY:
            raise AttributeError(_no_loader_attribute(name))
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def set_epoch(self, epoch: int):
        if hasattr(self.dl, "set_epoch"):
            self.dl.set_epoch(epoch)

    def __next__(self):
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.popleft()

    def refill(self):
        sp = self.sp_world_size
        if self.iter is None:
            self.iter = iter(self.dl)
        try:
            batch = next(self.iter)
        except StopIteration:
            self.iter = None
            batch = None
        batch, gathered = _exchange_descriptions(batch, sp, self.sp_group)
        descs = [d for d, _ in gathered]
        if all(d is None for d in descs):
            raise StopIteration
        if any(d is None for d in descs):
            ended = [r for r, d in enumerate(descs) if d is None]
            raise BatchError("train data loader", f"ran out on SP ranks {ended} while the other ranks of the SP "
                              "group still had batches (the group takes turns on each rank's batch)",
                              "give every rank the same number of batches (Accelerate's even_batches=True, "
                              "drop_last=True)")
        same = len({fp for _, fp in gathered}) == 1
        if self.replicated is None:
            self.replicated = same
        elif self.replicated and not same:
            raise BatchError("train data loader", "gave every rank of the SP group the same batches at first "
                              "(a loader sharded over data-parallel ranks only, each sample trained once) and "
                              "now different ones", "give the SP ranks of a group either always the same "
                              "batches or always different ones")
        drop = 0
        if self._skip_pending:  # the first batch after skipped whole batches (skip_first_batches)
            self._skip_pending = False
            items, batches = self.skipped
            if self.replicated and items > batches:  # one item per batch: this is batch `batches`, the first
                for _ in range(items - batches - 1):  # unseen one is batch `items`
                    if next(self.iter, None) is None:
                        self.iter = iter(())  # ran out while skipping: the next refill ends the pass
                        break
                self.refill()
                return
            if not self.replicated:
                drop = items - batches * sp  # this batch's turns already trained
        if self.replicated:  # every rank holds this very batch: shard it, nothing to send
            local = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            self.micro_batches.append(shard_batch(local, self.sp_rank, sp))
            return
        self.micro_batches.extend(_turn_shards(batch, descs, self.sp_rank, self.sp_group, sp, self.device,
                                               first=drop))


def _exchange_descriptions(batch, sp: int, group):
    """Check this rank's batch (None: out of batches) and all-gather (description, fingerprint) over the
    SP group; a bad batch on any rank is the same BatchError on every rank, raised after the exchange."""
    desc = None
    if batch is not None:
        try:
            batch = _checked_batch(batch, sp)
            desc = _describe(batch)
        except LongContextError as e:  # raised below on every rank of the group, before the broadcasts
            desc = ("error", e.key, e.problem, e.fix, type(e).__name__)
    gathered = [None] * sp
    dist.all_gather_object(gathered, (desc, _fingerprint(batch) if isinstance(desc, dict) else None), group=group)
    for r, (d, _) in enumerate(gathered):
        if isinstance(d, tuple):
            _, key, problem, fix, kind = d
            raise error_class(kind)(key, f"(SP rank {r}'s batch) {problem}", fix)
    return batch, gathered


def _turn_shards(batch, descs, sp_rank: int, group, sp: int, device, first: int = 0) -> list:
    """Every rank's batch in turn from rank ``first`` on, sent by its owner to the group: this rank's shard of
    each."""
    out = []
    for r, d in enumerate(descs):
        if r < first:
            continue
        src = dist.get_global_rank(group, r)
        full = {}
        for k, (kind, *spec) in d.items():
            if kind == "object":
                full[k] = spec[0]
                continue
            shape, dtype = spec
            if r == sp_rank:
                t = batch[k].to(device).contiguous()
            else:
                t = torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(t, src=src, group=group)
            full[k] = t
        out.append(shard_batch(full, sp_rank, sp))
    return out


def shard_in_turns(batch: dict, sp_rank: int, group, sp: int, device):
    """Full-length batches, one per rank of the SP group (evaluation: each rank's loader gave its own), as
    sequence shards: returns (this rank's shard of every turn's batch, the index of this rank's own batch).
    A batch every rank holds (replicated) is one turn. Same checks and errors as the training adapter."""
    batch, gathered = _exchange_descriptions(batch, sp, group)
    if len({fp for _, fp in gathered}) == 1:
        local = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        return [shard_batch(local, sp_rank, sp)], 0
    return _turn_shards(batch, [d for d, _ in gathered], sp_rank, group, sp, device), sp_rank


class RoutedSPAdapter:
    """Installed under DeepSpeed's ``UlyssesSPDataLoaderAdapter`` name by ``enable()``.

    Accelerate builds the adapter before ``deepspeed.initialize`` in ``_prepare_deepspeed``, so the
    choice is made at the first batch: ours when the last ``deepspeed.initialize`` went through
    ds_longctx, DeepSpeed's otherwise (HF's own ALST path while enabled)."""

    def __init__(self, dl, sp_rank, sp_group, sp_world_size, device, _deepspeed_cls=None, _is_ours=None):
        self.dl = dl
        self._args = (dl, sp_rank, sp_group, sp_world_size, device)
        self._deepspeed_cls, self._is_ours = _deepspeed_cls, _is_ours
        self._impl = None

    def _resolve(self):
        if self._impl is None:
            cls = SPTurnsAdapter if self._is_ours() else self._deepspeed_cls
            self._impl = cls(*self._args)
        return self._impl

    def __len__(self):
        return len(self._impl) if self._impl is not None else len(self.dl) * self._args[3]

    def __iter__(self):
        """A fresh pass (SPTurnsAdapter.__iter__); DeepSpeed's adapter keeps its place across ``iter``, so a new
        one is made (_DeepSpeedPasses)."""
        impl = self._resolve()
        if isinstance(impl, SPTurnsAdapter):
            iter(impl)
        else:
            self._impl = self._deepspeed_cls(*self._args)
        return self

    def __next__(self):
        return next(self._resolve())

    def set_epoch(self, epoch: int):
        """Ours forwards it to the wrapped loader; for DeepSpeed's (which has none) it is done here
        (_DeepSpeedPasses.set_epoch)."""
        impl = self._resolve()
        if isinstance(impl, SPTurnsAdapter):
            impl.set_epoch(epoch)
        elif hasattr(self.dl, "set_epoch"):
            self.dl.set_epoch(epoch)

    def skip_first_batches(self, num_batches: int, skip_loader):
        """The adapter this one resolves to, without its first ``num_batches`` items (:func:`skip_first_items`)."""
        impl = self._resolve()
        if isinstance(impl, SPTurnsAdapter):
            return impl.skip_first_batches(num_batches, skip_loader)
        return _DeepSpeedPasses(self._deepspeed_cls, self._args).skip_first_batches(num_batches, skip_loader)

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        if name in _LOADER_ONLY:
            raise AttributeError(_no_loader_attribute(name))
        return getattr(self._resolve(), name)


# what Accelerate's skip_first_batches reads to rebuild a DataLoader (module doc: it must not get them)
_LOADER_ONLY = ("dataset", "batch_sampler", "sampler")


def _no_loader_attribute(name: str) -> str:
    return (f"the SP data loader adapter has no '{name}' (it is not a DataLoader: its items are SP turns). To skip "
            "batches on resume use the Trainer's resume_from_checkpoint, or accelerator.skip_first_batches after "
            "ds_longctx.enable(): both skip in SP turns")


class _DeepSpeedPasses:
    """DeepSpeed's adapter (class ``cls``, constructor ``args``), made afresh at each pass: its ``__iter__`` returns
    itself and keeps its place, so a pass started by the Trainer's next epoch would first finish the last one (see
    SPTurnsAdapter.__iter__). ``drop``: items dropped at the start of each pass (a skip's turn remainder; every rank
    of the group drops the same number, so its refills' collectives stay matched)."""

    def __init__(self, cls, args, drop: int = 0):
        self._cls, self._args, self._drop_each = cls, tuple(args), drop
        self._adapter, self._drop = None, drop

    def __len__(self):
        return len(self._args[0]) * self._args[3] - self._drop_each

    def __iter__(self):
        self._adapter, self._drop = self._cls(*self._args), self._drop_each
        return self

    def set_epoch(self, epoch: int):
        """To the wrapped loader (DeepSpeed's adapter has none; an Accelerate loader's pass abandoned at a step
        count never advances its own epoch counter, so the Trainer's set_epoch must reach it)."""
        if hasattr(self._args[0], "set_epoch"):
            self._args[0].set_epoch(epoch)

    def __next__(self):
        if self._adapter is None:
            iter(self)
        while self._drop:
            self._drop -= 1
            next(self._adapter)
        return next(self._adapter)

    def skip_first_batches(self, num_batches: int, skip_loader):
        """Without its first ``num_batches`` items: DeepSpeed's adapter yields ``sp`` turns per batch, always."""
        if self._drop_each:
            raise ValueError("skip_first_batches: this SP loader is already a skipped one; skip the loader the "
                             "Trainer / Accelerator prepared")
        dl, sp = self._args[0], self._args[3]
        batches, drop = divmod(int(num_batches), sp)
        return _DeepSpeedPasses(self._cls, (skip_loader(dl, batches) if batches else dl, *self._args[1:]), drop)

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        if name in _LOADER_ONLY:
            raise AttributeError(_no_loader_attribute(name))
        if self._adapter is None:
            iter(self)
        return getattr(self._adapter, name)


def is_sp_adapter(loader, deepspeed_cls=None) -> bool:
    """An SP data loader adapter whose items are SP turns (ours, the routed one, DeepSpeed's)."""
    kinds = (SPTurnsAdapter, RoutedSPAdapter, _DeepSpeedPasses) + ((deepspeed_cls,) if deepspeed_cls else ())
    return isinstance(loader, kinds)


def skip_first_items(loader, num_batches: int, skip_loader):
    """``skip_first_batches`` for an SP adapter (module doc): a new adapter without its first ``num_batches``
    items. ``skip_loader``: Accelerate's ``skip_first_batches``, applied to the wrapped loader."""
    if isinstance(loader, (SPTurnsAdapter, RoutedSPAdapter, _DeepSpeedPasses)):
        return loader.skip_first_batches(num_batches, skip_loader)
    a = loader  # DeepSpeed's own adapter, built without enable(): skipped from its loader's start
    args = (a.dl, a.sp_rank, a.sp_group, a.sp_world_size, a.device)
    return _DeepSpeedPasses(type(a), args).skip_first_batches(num_batches, skip_loader)
