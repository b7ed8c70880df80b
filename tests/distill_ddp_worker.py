"""Run by tests/test_distill_ddp.py under `torchrun --nproc_per_node 2`: a tiny distillation run straight through,
then the same run crashed after step 3 and resumed from its step-2 checkpoint. Each rank dumps its copy of both
students and rank 0 the logged losses, so the test can check that DDP kept the ranks identical, rank 0 saved the
same, and the resumed run (each rank restoring its own RNG: dropout and masking differ per rank) equals the whole."""

import json
import os
import sys

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from distill_tiny import corpus  # noqa: E402

from fastbert.distill import DistillConfig, Objectives, distill  # noqa: E402


def run(teacher: str, out: str, on_step=None, **options) -> None:
    """Distil into `out`; dump this rank's student and, on rank 0, the (step, loss) history."""
    config = DistillConfig(
        out,
        num_layers=2,
        batch_size=4,
        max_steps=4,
        lr=1e-3,
        checkpoint_every=2,
        log_every=1,
        objectives=Objectives.distilbert(),
        student_overrides={"hidden_dropout_prob": 0.1},
        device="cpu",  # gloo: two processes need no GPU (and a one-GPU machine has too few for two)
        **options,
    )
    result = distill(teacher, corpus(64), config, on_step=on_step)
    rank = int(os.environ["RANK"])
    state = {k: v.contiguous() for k, v in result.student.unique_state_dict().items()}
    save_file(state, os.path.join(out, f"rank{rank}.safetensors"))
    with open(os.path.join(out, f"rank{rank}.world"), "w") as f:
        f.write(os.environ["WORLD_SIZE"])
    with open(os.path.join(out, f"rank{rank}.seed"), "w") as f:  # the stream this rank's masks and dropout came from
        f.write(str(torch.initial_seed()))
    if rank == 0:
        with open(os.path.join(out, "losses.json"), "w") as f:
            json.dump([[r["step"], r["loss"]] for r in result.history if "loss" in r], f)


def crash(step: int, record: dict) -> None:
    if step == 3:  # after the step-2 checkpoint, on every rank alike
        raise KeyboardInterrupt("simulated crash")


def main() -> None:
    teacher, out = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    run(teacher, os.path.join(out, "whole"))
    try:
        run(teacher, os.path.join(out, "resumed"), on_step=crash)
    except KeyboardInterrupt:
        pass
    run(teacher, os.path.join(out, "resumed"), resume="latest")


if __name__ == "__main__":
    main()
