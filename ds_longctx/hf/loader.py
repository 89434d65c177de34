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

import torch
from collections import deque

from ..data import shard_batch
from ..errors import BatchError
from ..data.turns import exchange_descriptions, turn_shards


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
        batch, gathered = exchange_descriptions(batch, sp, self.sp_group)
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
        self.micro_batches.extend(turn_shards(batch, descs, self.sp_rank, self.sp_group, sp, self.device,
                                               first=drop))


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
