"""ds_longctx's main job (the command lives in the package, ds_longctx/train/, so that an installed ds_longctx runs it too:
``deepspeed --module ds_longctx.train ...``).

    deepspeed --num_gpus 2 train.py --deepspeed_config ds_configs/tiny-cpu.json          # CPU demo
    deepspeed train.py --deepspeed_config ds_configs/llama3-8b-5m.json --model meta-llama/Llama-3.1-8B \\
        --save ckpt/ --save-every 50 --resume auto --save-hf final/

`python train.py --help` lists every flag.
"""
from ds_longctx.dist.runtime import run
from ds_longctx.train import main

if __name__ == "__main__":
    # an error on any rank ends the whole job; every rank ends without interpreter finalization (the exit-time
    # gloo abort): see ds_longctx/dist/runtime.py
    run(main)
