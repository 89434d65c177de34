#!/usr/bin/env python
# usage: python bench/planner_slope.py CONFIG OUT.json SEQ   (e.g. ds_configs/llama3-8b-5m.json slope.json 1048576)
"""Activation bytes per token at the step's peak (the recomputed layer's backward): the planner's step at 1M tokens with the
vocabulary cut to 1024 (so the loss moment, ~5.9 GiB of S-independent logit tiles, cannot be the peak),
2 and 3 layers extrapolated to 32 as the CLI does; model states from the real config."""
import json, sys, time
from ds_longctx.planner import Planner, load_model_config
cfg, out, S = sys.argv[1], sys.argv[2], int(sys.argv[3])
mc = load_model_config("ds_configs/models/llama3-8b.json")
real = Planner(cfg, mc, 8, "h100")
small = load_model_config({**json.load(open("ds_configs/models/llama3-8b.json")), "vocab_size": 1024})
p = Planner(cfg, small, 8, "h100")
t = time.time()
r = p.run(S)
act = r.activation_peak_bytes - r.breakdown["model_states"]
usable = real.budget - real.reserve
states = max(real.states.device_total, real.step_peak)
res = {"config": cfg, "S": S, "secs": round(time.time() - t, 1), "activation_bytes": act, "bytes_per_token": act / S,
       "breakdown": r.breakdown, "states_real": real.states.device, "step_peak_real": real.step_peak,
       "usable": usable, "max_context_linear": int((usable - real.states.device_total) / (act / S))}
json.dump(res, open(out, "w"), indent=1)
print(res)
