#!/usr/bin/env python3
"""PyTorch peer for nccl_ep_bench: dispatch + combine with torch.distributed all_to_all_single
over NCCL, two processes (one per GPU), on the payloads nccl_ep_bench moves.

Per forward and rank, host input -> host output like moeserve's path: x [T, K] BF16 from pinned
memory to the GPU; 64 experts top-8 uniform routing, experts 0-31 on rank 0 and 32-63 on rank 1;
each token sent once per destination rank, its topk ids and weights packed into the same row
(one all_to_all_single for the payload, generous to PyTorch), counts exchanged first with an
all_to_all_single and read on the host (as all_to_all_single needs host split sizes); combine
sends one FP32 row back per record, index_add on the source rank, D2H to pinned memory.
Usage: torch_all_to_all.py OUT.csv [--quick]
"""
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TOPK, EXPERTS = 8, 64


def run(rank, world, out_csv, quick):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    dev = torch.device("cuda", rank)
    tokens = [16, 64, 1024] if quick else [16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
    rows = []
    # Floor: 16 bytes each way with all_to_all_single + synchronize.
    small = torch.zeros(2, 2, dtype=torch.float32, device=dev)
    recv_small = torch.empty_like(small)
    ts = []
    for i in range(600):
        t0 = time.perf_counter()
        dist.all_to_all_single(recv_small, small)
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e6)
    rows.append(("torch_a2a_16B_floor", 0, 0, statistics.median(ts[100:])))
    for hidden in (3072, 7168):
        for t in tokens:
            g = torch.Generator().manual_seed(1000 + t + rank)
            x_host = torch.randn(t, hidden, generator=g).to(torch.bfloat16).pin_memory()
            ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(t)])
            w = torch.softmax(torch.randn(t, TOPK, generator=g), dim=1)
            ids_d, w_d = ids.to(dev, torch.int32), w.to(dev)
            out_host = torch.empty(t, hidden, dtype=torch.float32).pin_memory()
            meta_cols = 2 * TOPK * 2  # ids + weights as 32-bit, viewed as bf16 columns
            iters = 300 if t <= 256 else (60 if t <= 1024 else 25)
            ts = []
            for i in range(iters):
                t0 = time.perf_counter()
                x = x_host.to(dev, non_blocking=True)
                dest = ids_d // (EXPERTS // world)                        # [T, topk]
                mask = torch.stack([(dest == p).any(1) for p in range(world)], 1)  # [T, world]
                order = [torch.nonzero(mask[:, p]).flatten() for p in range(world)]
                idx = torch.cat(order)
                send_counts = torch.stack([o.new_tensor(o.numel()) for o in order])
                recv_counts = torch.empty_like(send_counts)
                dist.all_to_all_single(recv_counts, send_counts)
                sc, rc = send_counts.tolist(), recv_counts.tolist()        # host sync
                meta = torch.cat([ids_d.view(torch.float32), w_d], 1)[idx]  # [n, 2*topk] 32-bit
                payload = torch.cat([x[idx], meta.view(torch.bfloat16)], 1)
                recv = torch.empty(sum(rc), hidden + meta_cols, dtype=torch.bfloat16, device=dev)
                dist.all_to_all_single(recv, payload, rc, sc)
                partial = recv[:, :hidden].float()                          # experts' partials
                back = torch.empty(sum(sc), hidden, dtype=torch.float32, device=dev)
                dist.all_to_all_single(back, partial, sc, rc)
                out = torch.zeros(t, hidden, dtype=torch.float32, device=dev)
                out.index_add_(0, idx, back)
                out_host.copy_(out, non_blocking=True)
                torch.cuda.synchronize()
                ts.append((time.perf_counter() - t0) * 1e6)
            ts = ts[iters // 5:]
            rows.append(("torch_dispatch_combine", hidden, t, statistics.median(ts)))
            if rank == 0:
                print(f"torch dispatch+combine hidden {hidden} tokens/rank {t}: "
                      f"median {statistics.median(ts):.1f} us", flush=True)
    if rank == 0:
        with open(out_csv, "w") as f:
            f.write("what,hidden,tokens_per_rank,us\n")
            for r in rows:
                f.write(",".join(str(v) for v in r) + "\n")
        print(f"torch floor (all_to_all_single 16 B + sync): {rows[0][3]:.1f} us", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    mp.spawn(run, args=(2, sys.argv[1], "--quick" in sys.argv), nprocs=2)
