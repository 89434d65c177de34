"""README's HF Trainer recipe, run as written (launched: ``deepspeed --num_gpus 2 tests/readme_recipe.py``, or one
process: ``python tests/readme_recipe.py``).

The python block under README's "## HF Trainer / TRL / Accelerate" is executed with only its ``...`` filled in
(the TrainingArguments a test needs; no ``use_cpu``: on a CPU box Accelerate then starts deepspeed.comm itself) and
the names it uses defined here: ``model``, ``ds``, ``N`` (the launch's world size), ``Trainer``,
``TrainingArguments``, and ``ds_config.json`` in the working directory (examples/hf_trainer.py's config: untied
attention + the memory stack). Nothing of examples/_common.prepare_launched_process runs.

The block runs twice in one process (a second Trainer: same SP layout), the first time without its last line
(``ds_longctx.shutdown()`` ends the process). Both models are built first: a model built while a ZeRO-3
TrainingArguments is alive is constructed partitioned by transformers (zero.Init), with another random init.
Rank 0 prints ``{"readme_losses": [[first Trainer's step losses], [second's]]}``; the settings are
examples/hf_trainer.train's defaults, so the losses compare with ``hf_trainer.py --sp 1 --hf-alst``.
"""
import json
import os
import re
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "examples"))


def readme_block() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    section = text.split("## HF Trainer / TRL / Accelerate", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert block.count("...,") == 1, block  # the one place a user fills in their own arguments
    return block.replace("...,", "**FILL,")


def main():
    import hf_trainer
    from _common import RandomTokens, tiny_model
    from transformers import Trainer as HFTrainer
    from transformers import TrainingArguments

    n = int(os.environ.get("WORLD_SIZE", "1"))
    work = tempfile.mkdtemp(prefix="ds_longctx_readme_")
    os.chdir(work)
    with open("ds_config.json", "w") as f:
        json.dump(hf_trainer.ds_config(n), f)
    trainers = []

    class Trainer(hf_trainer.StepLossTrainer, HFTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.step_losses, self.step_inputs = [], []
            trainers.append(self)

    models = [tiny_model(seed=0), tiny_model(seed=0)]
    fill = dict(output_dir=os.path.join(work, "out"), per_device_train_batch_size=1, max_steps=3, learning_rate=0.05,
                optim="sgd", lr_scheduler_type="constant", max_grad_norm=0.0, logging_steps=1, save_strategy="no",
                report_to=[], seed=0, data_seed=0, dataloader_num_workers=0)
    block = readme_block()
    last = block.rstrip("\n").rsplit("\n", 1)
    assert last[1] == "ds_longctx.shutdown()", last
    report = "if int(os.environ.get('RANK', '0')) == 0:\n" \
             "    print(json.dumps({'readme_losses': [t.step_losses for t in trainers]}), flush=True)\n"
    # the second time: both Trainers' losses printed before the block's last line ends the process
    for i, code in enumerate((last[0] + "\n", last[0] + "\n" + report + last[1] + "\n")):
        scope = dict(model=models[i], ds=RandomTokens(8, 32, models[i].config.vocab_size, seed=0), N=n,
                     Trainer=Trainer, TrainingArguments=TrainingArguments, FILL=fill, os=os, json=json,
                     trainers=trainers)
        exec(compile(code, "README.md (HF Trainer / TRL / Accelerate)", "exec"), scope)


if __name__ == "__main__":
    main()
