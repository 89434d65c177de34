"""Issue 37, item 3: chunked attention (Llama 4's 'chunked_attention' layers) at a chunk shorter than the sample runs
under 'ulysses' and 'untied_ulysses' (function level) through the packed-documents machinery (documents cut again at
every chunk: attention.documents.chunk_documents) and equals one process, plain and packed, with the NoPE full-
attention layer causal over the whole sample; Llama 4's attention hands its function no position_ids, which
'ulysses' now supplies (the shard's global indices)."""
import math

import pytest
import torch

from arch_cases import max_delta_error
from chunked_cases import batch, build_llama4, reference, sp_step
from dist_utils import result_or_raise, runs_per_degree

ULYSSES = {"attention": {"implementation": "ulysses"}}
UNTIED = {"attention": {"implementation": "untied_ulysses", "heads_per_chunk": 1, "fuse_projections": False}}
# shards of 8 (SP=2) and 4 (SP=4) tokens against chunks of 4: chunk and document boundaries inside and on shard edges
CASES = {2: [(impl, kind) for impl in ("ulysses", "untied") for kind in ("plain", "packed")],
         4: [("ulysses", "packed"), ("untied", "packed")]}


def test_chunk_documents_cut_every_document_at_its_chunks():
    from ds_longctx.attention.documents import Documents, chunk_documents

    assert chunk_documents(None, 2, 10, 4).bounds == [[(0, 4), (4, 8), (8, 10)]] * 2
    docs = Documents(torch.tensor([[0, 5, 12, 16], [0, 16, 16, 16]]))
    # chunks counted from each document's start, as transformers' mask remaps packed positions
    assert chunk_documents(docs, 2, 16, 4).bounds == [[(0, 4), (4, 5), (5, 9), (9, 12), (12, 16)],
                                                      [(0, 4), (4, 8), (8, 12), (12, 16)]]


def test_chunks_change_the_one_process_loss():
    """The test can fail: 4-token chunks give another loss than one chunk covering the sample."""
    for kind in ("plain", "packed"):
        assert abs(reference(batch(kind), 4)[0] - reference(batch(kind), 16)[0]) > 1e-3


def _worker(rank, world, cases):
    return {(impl, kind): sp_step(ULYSSES if impl == "ulysses" else UNTIED, batch(kind), world)
            for impl, kind in cases}


@pytest.fixture(scope="module")
def sp_results():
    return runs_per_degree(_worker, CASES)


@pytest.mark.distributed
@pytest.mark.parametrize("sp", sorted(CASES))
def test_chunked_attention_under_sp_equals_one_process(sp, sp_results):
    results = result_or_raise(sp_results[sp])
    refs = {kind: reference(batch(kind)) for kind in ("plain", "packed")}
    for impl, kind in CASES[sp]:
        ref_loss, ref_deltas, params = refs[kind]
        for rank, r in enumerate(results):
            loss, deltas = r[impl, kind]
            err, where = max_delta_error(ref_deltas, deltas, params)
            print(sp, rank, impl, kind, ref_loss, loss, err, where)
            assert math.isclose(loss, ref_loss, rel_tol=1e-5), (impl, kind, loss, ref_loss)
            assert err < 1e-5, (impl, kind, err, where)
