"""The trained pair's target in float32 on the CPU, as the reference for two GPU differences.

Run with the exported pair joined into PAIR (`ci/gpu/pair-parts.sh`, then `join.py`), this
checkout on the path, and an interpreter with torch and transformers (the probe interpreter):

    python fp32_check.py PAIR REPORT_DIR

1. The fuzz finding `finding-lossless-1-1.json` (workload 9, request 1, a one-token prompt):
   the target's greedy tokens and top-2 margins.
2. `patched-k15-budget`'s difference under load (prompt 0 at 87): the margins along plain's
   own output, from REPORT_DIR's `plain.in.json` and `plain.out.json`.
"""

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from tooling.fuzzing.gpu_case import GpuReq, prompt_ids

pair, reports = Path(sys.argv[1]), Path(sys.argv[2])
model = AutoModelForCausalLM.from_pretrained(pair / "target", dtype=torch.float32).eval()
here = Path(__file__).parent


def margins(ids: list[int], start: int) -> list[tuple[list[int], float]]:
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    top = [torch.topk(logprobs[p], 2) for p in range(start - 1, len(ids) - 1)]
    return [(t.indices.tolist(), round(float(t.values[0] - t.values[1]), 4)) for t in top]


case = json.loads((here / "finding-lossless-1-1.json").read_text())["case"]
prompt = prompt_ids(9, 1, GpuReq(**case["requests"][1]), 8192)
out = model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False)
print("one-token prompt", prompt, "greedy", out[0, len(prompt):].tolist())
print("margins", margins(out[0].tolist(), len(prompt)))

prompt = json.loads((reports / "plain.in.json").read_text())["acceptance_prompts"][0]
plain = json.loads((reports / "plain.out.json").read_text())["acceptance"]["16"]["outputs"][0]
for position, (top2, margin) in enumerate(margins(prompt + plain[:95], len(prompt))):
    if position >= 80:
        print(position, "plain", plain[position], "fp32 top-2", top2, "margin", margin)
