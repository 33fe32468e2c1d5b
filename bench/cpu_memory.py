"""Faces a second through torch on this CPU, with glibc's default malloc and with `models.cpu_memory` switched on.

python -m bench.cpu_memory --out bench/results

Three workloads, each in a fresh interpreter per arm (the switch is process-wide), the arms alternated over
`--rounds` so that drift in the machine's load hits both: the teacher converted to torch embedding a batch
(`ffr pretrain --online`'s targets on a CPU), the student embedding a batch in eval mode (the benches, a
device's torch evaluation), and one distillation training step of the student (bf16 trunk where the CPU has it).
Each row gives the median throughput, and the CPU seconds, user and system, and minor page faults per batch.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from bench.common import write_results
from models.cpu_memory import OFF_ENV

WORKLOADS = {
    "teacher, torch, eval": """
from models.networks.teacher import load_teacher
from models.networks.torch_teacher import to_torch
model = to_torch(load_teacher("sface", threads=THREADS))
x = torch.rand(BATCH, 3, 112, 112) * 255
def work():
    with torch.inference_mode():
        model(x)
""",
    "student, eval": """
from models.networks.face_weights import load_face_embedder
model = load_face_embedder().eval()
x = torch.randn(BATCH, 3, 128, 128)
def work():
    with torch.inference_mode():
        model(x)
""",
    "student, training step": """
from models.networks.face_weights import load_face_embedder
from models.training.fast_step import accelerate
model = load_face_embedder()
accelerate(model, "auto", "cpu")
optimiser = torch.optim.AdamW(model.parameters(), lr=1e-6)
x = torch.randn(BATCH, 3, 128, 128)
def work():
    model.train()
    loss = model(x).float().sum()
    optimiser.zero_grad()
    loss.backward()
    optimiser.step()
""",
}

MEASURE = """
import json, resource, sys, time, torch
BATCH, BATCHES, THREADS = map(int, sys.argv[1:4])
torch.set_num_threads(THREADS)
{setup}
work()  # the first batch takes its memory from the kernel with either allocator
usage, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
for _ in range(BATCHES):
    work()
seconds, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({{"per_s": BATCHES * BATCH / seconds, "user_s": (after.ru_utime - usage.ru_utime) / BATCHES,
                  "system_s": (after.ru_stime - usage.ru_stime) / BATCHES,
                  "faults": (after.ru_minflt - usage.ru_minflt) / BATCHES, "max_rss_mb": after.ru_maxrss / 1024}}))
"""


def measure(setup: str, reuse: bool, batch: int, batches: int, threads: int) -> dict:
    env = {**os.environ, OFF_ENV: "1" if reuse else "0"}
    run = subprocess.run([sys.executable, "-c", MEASURE.format(setup=setup), str(batch), str(batches), str(threads)],
                         capture_output=True, text=True, env=env, check=False)
    if run.returncode:
        raise RuntimeError(f"the measurement failed: {run.stderr.strip().splitlines()[-1]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--batches", type=int, default=6, help="timed batches per measurement")
    parser.add_argument("--rounds", type=int, default=5, help="measurements per arm, the arms alternated")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    table = []
    for name, setup in WORKLOADS.items():
        runs: dict[bool, list[dict]] = {False: [], True: []}
        for round_ in range(args.rounds):
            for reuse in ((False, True) if round_ % 2 == 0 else (True, False)):
                runs[reuse].append(measure(setup, reuse, args.batch, args.batches, args.threads))
        base = statistics.median(r["per_s"] for r in runs[False])
        for reuse in (False, True):
            rows = runs[reuse]
            medians = {k: round(statistics.median(r[k] for r in rows), 3) for k in rows[0]}
            table.append({"workload": name, "malloc": "freed memory kept (mallopt)" if reuse else "glibc default",
                          **medians, "speed_up": round(medians["per_s"] / base, 2)})
        print(f"{name}: {base:.1f} -> {table[-1]['per_s']:.1f} per s", flush=True)
    command = "python -m bench.cpu_memory " + " ".join(argv if argv is not None else sys.argv[1:])
    write_results(args.out, "cpu_memory", {"batch": args.batch, "batches": args.batches, "rounds": args.rounds,
                                           "threads": args.threads}, table,
                  "Torch on this CPU: glibc's default malloc against freed memory kept for reuse", command.strip())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
