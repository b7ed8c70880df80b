"""Run by tests/test_distill_ddp.py under `torchrun --nproc_per_node 2`: a tiny distillation, then each rank dumps
its own copy of the student so the test can check that DDP kept them identical and rank 0 saved the same."""

import os
import sys

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from distill_tiny import corpus  # noqa: E402

from fastbert.distill import DistillConfig, Objectives, distill  # noqa: E402


def main() -> None:
    teacher, out = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    config = DistillConfig(
        out, num_layers=2, batch_size=4, max_steps=4, lr=1e-3, checkpoint_every=2, objectives=Objectives.distilbert()
    )
    result = distill(teacher, corpus(64), config)
    rank = int(os.environ["RANK"])
    state = {k: v.contiguous() for k, v in result.student.unique_state_dict().items()}
    save_file(state, os.path.join(out, f"rank{rank}.safetensors"))
    with open(os.path.join(out, f"rank{rank}.world"), "w") as f:
        f.write(os.environ["WORLD_SIZE"])


if __name__ == "__main__":
    main()
