"""How heads split over SP ranks and head chunks: the one check of ``sequence_parallel_size`` against the
head counts and of ``heads_per_chunk`` (config.check_against and the untied install both call these)."""
from __future__ import annotations

from ..errors import ConfigError

HPC_KEY = "long_context.attention.heads_per_chunk"


def check_sp_heads(heads: int, kv_heads: int, sp: int) -> None:
    """Ulysses scatters query heads over the SP ranks; KV heads are scattered or replicated."""
    if heads % sp != 0:
        raise ConfigError("sequence_parallel_size", f"{sp} does not divide the {heads} attention heads",
                          f"pick a degree that divides {heads}")
    if kv_heads % sp != 0 and sp % kv_heads != 0:
        raise ConfigError("sequence_parallel_size",
                          f"{sp} neither divides nor is divided by the {kv_heads} key/value heads",
                          f"pick a degree that divides {kv_heads} or is a multiple of it")


def check_heads_per_chunk(hpc, heads: int, kv_heads: int, sp: int) -> None:
    """``hpc`` query heads per stage must be a positive integer dividing the heads per rank."""
    if not isinstance(hpc, int) or isinstance(hpc, bool) or hpc < 1:
        raise ConfigError(HPC_KEY, f"must be a positive integer here, got {hpc!r}",
                          "use 1 for the most memory saving (ds_longctx.initialize resolves 'auto' first)")
    check_sp_heads(heads, kv_heads, sp)
    local = heads // sp
    if local % hpc != 0:
        valid = [d for d in range(1, local + 1) if local % d == 0]
        raise ConfigError(HPC_KEY, f"{hpc} does not divide the {local} query heads per rank ({heads} heads / SP {sp})",
                          f"use one of {valid}")


__all__ = ["check_sp_heads", "check_heads_per_chunk", "HPC_KEY"]
