"""Which collectives gloo runs on CUDA tensors, for two processes of one GPU (tools/gpu_check.py,
under torchrun --nproc-per-node 2). Each is checked against its closed form; rank 0 prints one
JSON line: {collective: "ok" | "wrong result ..." | "<error>"}. What fl-megatron calls them for:
FSDP2 all_gather_into_tensor and reduce_scatter_tensor; the fp32 sync all_reduce; the int8/int4
sync all_to_all_single and all_gather_into_tensor; gossip send/recv; the vote broadcast."""

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist


def probes(rank: int, world: int, device: torch.device) -> dict:
    """name -> a function that runs the collective and returns its result's error ('' when right)."""
    n = 1024

    def all_reduce():
        t = torch.full((n,), float(rank + 1), device=device)
        dist.all_reduce(t)
        return "" if torch.all(t == world * (world + 1) / 2) else f"got {t[0].item()}"

    def broadcast():
        t = torch.full((n,), float(rank), device=device)
        dist.broadcast(t, src=0)
        return "" if torch.all(t == 0) else f"got {t[0].item()}"

    def all_gather():
        out = [torch.empty(n, device=device) for _ in range(world)]
        dist.all_gather(out, torch.full((n,), float(rank), device=device))
        return "" if all(torch.all(o == r) for r, o in enumerate(out)) else "wrong pieces"

    def all_gather_into_tensor():
        out = torch.empty(world * n, device=device)
        dist.all_gather_into_tensor(out, torch.full((n,), float(rank), device=device))
        want = torch.arange(world, device=device, dtype=torch.float32).repeat_interleave(n)
        return "" if torch.equal(out, want) else "wrong pieces"

    def reduce_scatter_tensor():
        inp = torch.arange(world * n, device=device, dtype=torch.float32) + rank
        out = torch.empty(n, device=device)
        dist.reduce_scatter_tensor(out, inp)
        want = world * torch.arange(rank * n, (rank + 1) * n, device=device, dtype=torch.float32) + sum(range(world))
        return "" if torch.equal(out, want) else "wrong sums"

    def all_to_all_single():
        inp = torch.full((world * n,), float(rank), device=device)
        out = torch.empty(world * n, device=device)
        dist.all_to_all_single(out, inp)
        want = torch.arange(world, device=device, dtype=torch.float32).repeat_interleave(n)
        return "" if torch.equal(out, want) else "wrong pieces"

    def send_recv():
        t = torch.full((n,), float(rank), device=device)
        if rank == 0:
            dist.send(t, dst=1)
            return ""
        dist.recv(t, src=0)
        return "" if torch.all(t == 0) else f"got {t[0].item()}"

    return {f.__name__: f for f in (all_reduce, broadcast, all_gather, all_gather_into_tensor,
                                    reduce_scatter_tensor, all_to_all_single, send_recv)}


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if sys.argv[1:] == ["--device", "cpu"]:  # the tests: the closed forms checked on CPU tensors
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    results = {}
    for name, probe in probes(rank, world, device).items():
        try:
            wrong = probe()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            results[name] = "ok" if not wrong else f"wrong result: {wrong}"
        except Exception as e:  # an unsupported collective raises on both ranks alike
            results[name] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160] if str(e).strip() else ''}"
        dist.barrier()
    if rank == 0:
        print(json.dumps(results), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
