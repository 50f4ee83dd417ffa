"""What one layer of the built-in Llama keeps for its backward, measured on a GPU: the memory held
after the forward (its loss computed, nothing freed yet) less what was held before it, at two depths,
so that the difference per layer leaves out the embedding, the head and the loss. Eager and under
torch.compile, in bf16 and with fp32 weights under bf16 autocast. Writes JSON beside the planner's
count (planner.models.ModelSpec.layer_activation_bytes).

    python bench/planner/activation_memory.py OUT.json
"""

import json
import platform
import sys

import torch

import shardwise.models as M
from shardwise.planner.models import ModelSpec

CASES = [  # (preset, micro-batch, sequence)
    ("8b", 2, 4096),
    ("1b", 4, 2048),
]


def held_after_forward(size, layers, batch, seq, compiled, autocast):
    torch.manual_seed(0)
    dtype = torch.float32 if autocast else torch.bfloat16
    model = M.build("llama", size, n_layer=layers, seq=seq).to("cuda", dtype)
    run = torch.compile(model) if compiled else model
    idx = torch.randint(0, model.cfg.vocab, (batch, seq), device="cuda")
    for _ in range(2):  # compile, and the allocator's pools warm
        with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
            loss = run(idx, idx)
        loss.backward()
        model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
        loss = run(idx, idx)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    loss.backward()
    del loss, model, run
    torch.cuda.empty_cache()
    return held


def main(out):
    rows = []
    for size, batch, seq in CASES:
        cfg = M.PRESETS["llama"][size]
        spec = ModelSpec(size, cfg["n_layer"], cfg["d_model"], cfg["n_head"], cfg["n_kv_head"], cfg["ffn"],
                         cfg["vocab"], seq=seq)
        planned = spec.layer_activation_bytes(seq, batch)
        for compiled in (False, True):
            for autocast in (False, True):
                two, four = (held_after_forward(size, n, batch, seq, compiled, autocast) for n in (2, 4))
                per_layer = (four - two) / 2
                row = {"model": size, "micro_batch": batch, "seq": seq, "compiled": compiled, "autocast": autocast,
                       "held_2_layers": two, "held_4_layers": four, "per_layer": per_layer,
                       "per_token_per_layer": per_layer / (batch * seq), "planned_per_layer": planned,
                       "measured_over_planned": per_layer / planned}
                print(json.dumps(row), flush=True)
                rows.append(row)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
            "command": "python bench/planner/activation_memory.py " + out}
    with open(out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
