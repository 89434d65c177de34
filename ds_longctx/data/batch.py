"""A batch's document structure, derived from the full (unsharded) batch: the data layer's side of packed
documents. ``data.shard_batch`` and the HF Trainer adapter (hf_loader) describe each sample's documents here;
attention reads the result (``doc_cu_seqlens``) through ``attention.documents.Documents``.

The contract (HF's and TRL's packed convention): a sample's ``position_ids`` restart at 0 (more precisely:
do not continue by +1) at each document start; optionally a per-sample list of document lengths
(``doc_lens``) is given instead. A right-padded tail (``attention_mask`` zeros) is one more document whose
targets are ignored.
"""
from __future__ import annotations

from typing import List

import torch

from ..errors import BatchError
from ..loss import IGNORE_INDEX

BATCH_KEY = "doc_cu_seqlens"         # batch key of the global structure (written by shard_batch)
LENS_KEY = "doc_lens"                # optional user-given per-sample document lengths
REAL_KEY = "doc_real_tokens"         # per sample, its tokens before a right-padded tail (shard_batch, where one is)
RING_KEY = "doc_shard_ring"          # the ring degree a batch was cut for (shard_batch, where it is > 1: zigzag order)


def custom_mask_error(mask) -> BatchError:
    """The one refusal of a custom (not [batch, seq] padding) attention mask. Never "drop the mask": a
    prefix-LM or other custom pattern would then silently train causal-only."""
    shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
    return BatchError("batch.attention_mask", f"is a custom attention mask ({shape}); custom 4-D masks are not "
                       "supported under sequence parallelism, nor by ds_longctx's batch sharding (attention there "
                       "is causal, per document)",
                       "for document masking, pack the documents and mark them with position_ids restarting at 0 "
                       f"per document (or '{LENS_KEY}', or '{BATCH_KEY}' from ds_longctx.data.shard_batch); a mask of "
                       "another pattern (prefix-LM, ...) has no SP path yet: at sequence_parallel_size 1 with "
                       "long_context.attention.implementation 'none', call the model (engine(**batch)) with the "
                       "full batch and its mask, which transformers applies exactly")


def _right_padding_lengths(mask: torch.Tensor) -> List[int]:
    """Number of real tokens per sample of a [b, S] 0/1 mask; only right padding is accepted."""
    if mask.dim() != 2:
        raise custom_mask_error(mask)
    m = mask.bool()
    n_real = m.sum(1)
    ar = torch.arange(m.shape[1], device=m.device)
    bad = ~(m == (ar.unsqueeze(0) < n_real.unsqueeze(1))).all(1)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise BatchError("batch.attention_mask", f"sample {i} is not right-padded (zeros before ones)",
                          "pad on the right (tokenizer padding_side='right'); the padded tail becomes an ignored "
                          "document")
    return n_real.tolist()


def document_structure(input_ids: torch.Tensor, position_ids=None, attention_mask=None, doc_lens=None):
    """Documents of a FULL batch: returns (cu [b, n+1] long, position_ids [b, S] long, n_real list).

    Boundaries come from ``doc_lens`` when given, else from ``position_ids`` (a document starts where
    a position is not its predecessor + 1: HF's ``find_packed_sequence_indices`` rule), else one
    document. A right-padded tail is one more document (positions restart at 0 there); the caller
    ignores its targets. Position ids of real tokens are kept as given (RoPE needs them).
    """
    bsz, seq = input_ids.shape
    n_real = [seq] * bsz if attention_mask is None else _right_padding_lengths(attention_mask)
    if position_ids is not None:
        if tuple(position_ids.shape) != (bsz, seq):
            raise BatchError("batch.position_ids", f"shape {tuple(position_ids.shape)} differs from input_ids "
                              f"{(bsz, seq)}", "give one position per token")
        pos = position_ids.detach().to("cpu", torch.long).clone()
    else:
        pos = None
    if doc_lens is not None:
        rows = doc_lens.tolist() if isinstance(doc_lens, torch.Tensor) else [list(r) for r in doc_lens]
        if len(rows) != bsz:
            raise BatchError(f"batch.{LENS_KEY}", f"has {len(rows)} rows for {bsz} samples", "one list per sample")
    cus, out_pos = [], torch.empty(bsz, seq, dtype=torch.long)
    for i in range(bsz):
        n = n_real[i]
        if doc_lens is not None:
            lens = [int(x) for x in rows[i] if int(x) != 0]
            if any(x < 0 for x in lens) or sum(lens) != n:
                raise BatchError(f"batch.{LENS_KEY}", f"sample {i}: document lengths {lens} must be positive and "
                                  f"sum to its {n} real tokens", "give the lengths of the documents packed in it")
            starts, acc = [], 0
            for x in lens:
                starts.append(acc)
                acc += x
            if pos is not None:  # given positions must not contradict the given documents
                p = pos[i, :n]
                inside = torch.ones(n, dtype=torch.bool)
                inside[starts] = False
                if n > 1 and not bool(((p[1:] - p[:-1]) == 1)[inside[1:]].all()):
                    raise BatchError(f"batch.{LENS_KEY}", f"sample {i}: position_ids are not contiguous inside the "
                                      "given documents", "drop position_ids (they are built restarting per "
                                      "document) or make them restart at the document starts")
            else:
                out_pos[i, :n] = torch.cat([torch.arange(x) for x in lens]) if lens else out_pos[i, :0]
        elif pos is not None and n > 0:
            p = pos[i, :n]
            starts = [0] + ((p[1:] - p[:-1]) != 1).nonzero().flatten().add(1).tolist()
        else:
            starts = [0] if n > 0 else []
            if pos is None:
                out_pos[i, :n] = torch.arange(n)
        if pos is not None:
            out_pos[i, :n] = pos[i, :n]
        out_pos[i, n:] = torch.arange(seq - n)  # the padded tail: its own document
        cus.append(starts + [n] + ([seq] if n < seq else []))
    width = max(len(c) for c in cus)
    cu = torch.tensor([c + [seq] * (width - len(c)) for c in cus], dtype=torch.long)
    if cu[:, 0].ne(0).any():  # a fully padded sample starts at its pad document
        cu[:, 0] = 0
    return cu, out_pos, n_real


def mask_padding_targets(shift_labels: torch.Tensor, n_real: List[int]) -> torch.Tensor:
    """Ignore every target that is a pad token (incl. the last real token's): a copy."""
    seq = shift_labels.shape[1]
    if all(n == seq for n in n_real):
        return shift_labels
    out = shift_labels.clone()
    for i, n in enumerate(n_real):
        if n < seq:
            out[i, max(n - 1, 0):] = IGNORE_INDEX
    return out


def token_input(input_ids, position_ids, kwargs):
    """The first [batch, tokens, ...] tensor of a forward's token inputs (input_ids, inputs_embeds,
    position_ids), or None."""
    for t in (input_ids, kwargs.get("inputs_embeds"), position_ids):
        if isinstance(t, torch.Tensor) and t.dim() >= 2:
            return t
    return None


__all__ = ["token_input", "BATCH_KEY", "LENS_KEY", "REAL_KEY", "RING_KEY", "custom_mask_error", "document_structure", "mask_padding_targets"]
