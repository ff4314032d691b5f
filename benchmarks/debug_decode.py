"""Debug helper: static-cache greedy decode under mode="reduce-overhead" with a given backend (run in a subprocess)."""
import sys

import torch
from torch._dynamo.utils import counters

sys.path.insert(0, ".")
from tests.hf_models import tiny  # noqa: E402

backend, dtype = sys.argv[1], getattr(torch, sys.argv[2] if len(sys.argv) > 2 else "float32")
model = tiny("qwen3_moe").to("cuda", dtype)
prompt = torch.randint(0, 64, (2, 7), device="cuda")
gen = dict(max_new_tokens=6, do_sample=False, cache_implementation="static")
with torch.no_grad():
    expected = model.generate(prompt, **gen)
    plain = model.forward
    kw = {} if backend == "inductor" else {"backend": backend}
    model.forward = torch.compile(plain, mode="reduce-overhead", **kw)
    got = model.generate(prompt, **gen)
    print("first generate done", flush=True)
    got2 = model.generate(prompt, **gen)
print(backend, "equal:", torch.equal(got, expected), torch.equal(got2, expected), "skips:",
      counters["inductor"]["cudagraph_skips"], dict(counters["moe_inductor"]), flush=True)
