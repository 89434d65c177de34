"""``python -m ds_longctx.train`` / ``deepspeed --module ds_longctx.train``: an error on any rank ends the whole job;
every rank ends without interpreter finalization (the exit-time gloo abort): see ds_longctx/dist/runtime.py."""
from ds_longctx.dist.runtime import run
from ds_longctx.train.loop import main

run(main)
