"""A tiny HF Mixtral on one GPU in bf16 (torch's grouped_mm kernel, traced as it is) and in fp32 (traced
through shardwise's reference of plain products): both train under zero3, and say which op the graph holds.
Usage: python bench/hf_moe_cuda.py"""

import torch
import transformers as tf

import shardwise as sw
from shardwise.capture import capture_step

if __name__ == "__main__":
    for dtype in (torch.bfloat16, torch.float32):
        torch.manual_seed(0)
        cfg = tf.MixtralConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                               num_local_experts=8, num_experts_per_tok=2)
        model = tf.MixtralForCausalLM(cfg).cuda().to(dtype)
        ids = torch.randint(0, 256, (4, 128), device="cuda")
        batch = {"input_ids": ids, "labels": ids}
        cap = capture_step(model, batch, device=torch.device("cuda"))
        ops = {str(n.target) for n in cap.gm.graph.nodes if n.op == "call_function"}
        job = sw.compile(model, strategy="zero3", mesh=sw.mesh(dp=1, device="cuda"),
                         optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
        losses = [float(job.step(batch)) for _ in range(10)]
        print(f"{dtype}: grouped_mm kernel in graph: {'aten._grouped_mm.default' in ops}; "
              f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
