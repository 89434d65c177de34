"""Evaluation under SP, equal to one process: held-out loss and perplexity (``evaluate``) and passkey retrieval by
length x depth (``needle``; its command line ``needle_cli``: ``ds-longctx needle``)."""
