"""CPU measurements of the K3 model (plain PyTorch reference ops)."""
import os
import time

import torch

from k3rl.model import K3Config, K3ForCausalLM
from k3rl.model.quantile_balance import quantile_balance

torch.manual_seed(0)
torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))

def timed(fn, reps=3):
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps

print("threads", torch.get_num_threads(), "load", os.getloadavg())
t = time.perf_counter()
with torch.device("meta"):
    K3ForCausalLM(K3Config.preset("k3"))
print(f"k3 on meta: build {time.perf_counter() - t:.2f} s")

for preset, T, reps in (("k3-tiny", 512, 3), ("k3-small", 128, 1)):
    model = K3ForCausalLM(K3Config.preset(preset)).eval()
    ids = torch.randint(0, 256, (1, T))
    with torch.no_grad():
        s = timed(lambda m=model, x=ids: m(x), reps)
        print(f"{preset}: prefill B=1 T={T}: {s * 1e3:.0f} ms ({T / s:.0f} tok/s)")
        for B in (1, 8):
            cache = model.new_cache(B)
            model(torch.randint(0, 256, (B, 64)), cache=cache)
            step = torch.randint(0, 256, (B, 1))
            s = timed(lambda m=model, x=step, c=cache: m(x, cache=c), 5)
            print(f"{preset}: decode step B={B} after 64 tokens: {s * 1e3:.1f} ms ({B / s:.0f} tok/s)")
    model.train()
    ids = torch.randint(0, 256, (1, T))
    def fwd_bwd(model=model, ids=ids):
        model.zero_grad(set_to_none=True)
        model(ids).float().square().mean().backward()
    s = timed(fwd_bwd, reps)
    print(f"{preset}: train fwd+bwd B=1 T={T}: {s * 1e3:.0f} ms")

m, n, k = 3584, 896, 16
g = torch.Generator().manual_seed(0)
pop = torch.linspace(-2.0, 2.0, n)[torch.randperm(n, generator=g)]
scores = torch.sigmoid(torch.randn(m, n, generator=g) + pop)
bias = torch.zeros(n)
q = m * k / n
def viol(b):
    load = torch.bincount(torch.topk(scores + b, k, -1).indices.reshape(-1), minlength=n).float()
    return (load - q).abs().max().item() / q * 100, (load - q).abs().mean().item() / q * 100
print(f"QB exact, n=896 k=16 m={m} (q={q:.0f}), skewed scores: step 0 max/mean |load-q| = %.1f%% / %.1f%%" % viol(bias))
for step in range(1, 9):
    t = time.perf_counter()
    bias = quantile_balance(scores, bias, k)
    dt = time.perf_counter() - t
    print(f"  step {step}: max {viol(bias)[0]:.1f}%  mean {viol(bias)[1]:.2f}%  ({dt * 1e3:.0f} ms)")
