"""The Hugging Face routes: ``enable()``/``disable()`` (``integration``: deepspeed.initialize routed through
ds_longctx for the HF Trainer, TRL and Accelerate, over one table of undoable patches, ``patches``) and the SP loader
adapter those trainers get (``loader``)."""
