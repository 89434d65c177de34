"""The data path: batches (``batch``: document structure, padding and the keys a batch may carry), the corpus and its
token cache (``corpus``), and the samplers, loaders and sharding every rank reads (``loaders``: ``shard_batch``,
``SPDataLoader``, ``SampleStream``, ``LongRangeCopy``, ``TokenFileDataset``). ``ds_longctx.data.<name>`` keeps working
for the loaders' names."""
from .loaders import *  # noqa: F401,F403
