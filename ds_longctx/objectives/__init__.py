"""Objectives beyond next-token (RL, preference, distillation), on sequence shards: the per-token log-probabilities of
given tokens over row tiles through the lm_head (``logprobs.token_logprobs``, exported as ``ds_longctx.token_logprobs``)
and reductions over the SP group that give one process's numbers (sums and counts summed over the group before any
division). ``pack``: a full batch (left and right padding, one document per row) as one packed row; ``replicated``:
what the patched forward does with a full batch every rank of the group holds (the TRL routes of hf/rl.py reach it
through the model call); ``reduce``: the differentiable gathers and sums. (Nothing is imported here: the patched
forward imports ``replicated`` below the patch layer, ``logprobs`` sits above it.)"""
