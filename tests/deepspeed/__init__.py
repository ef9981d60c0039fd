"""DeepSpeed tier: Piper's DeepSpeed adapter against stock DeepSpeed-MoE, on gloo CPU processes.

:func:`deepspeed_comm` is what every rank function calls first (inside :func:`tests.gloo.run_ranks`,
whose process group already exists): it gives ``deepspeed.comm`` its backend object without building
DeepSpeed's shared-memory all-reduce op. DeepSpeed's ``TorchBackend`` compiles that op with g++ on
first use (~25 s, then cached in ~/.cache/torch_extensions); it serves only ``inference_all_reduce``,
which training never calls, so the tests skip it rather than pay the compile on a fresh machine.
"""

from __future__ import annotations


def deepspeed_comm() -> None:
    """Initialise ``deepspeed.comm`` over the existing torch.distributed group (no shm op build)."""
    from piper_deepspeed.measure import init_deepspeed_comm

    init_deepspeed_comm()


def trainer_engine(job_json: dict) -> tuple:
    """``(job, engine)``: the job of ``job_json`` and the DeepSpeed engine of the validation trainer's model
    (:func:`piper_deepspeed.measure.ds_config`), built on this rank as the trainer builds them."""
    import contextlib
    import io

    import piper_deepspeed
    from piper_core.validate.instrument import TrainJob
    from piper_deepspeed.builder import build_model
    from piper_deepspeed.measure import ds_config

    deepspeed_comm()
    job = TrainJob.from_json(job_json)
    net = build_model(job.model, job.plan, seed=job.seed, aux_loss_coeff=0.0)
    with contextlib.redirect_stdout(io.StringIO()):
        engine, _, _, _ = piper_deepspeed.initialize(model=net, model_parameters=net.parameters(),
                                                     config=ds_config(job))
    return job, engine
