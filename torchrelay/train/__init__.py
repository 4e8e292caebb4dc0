"""The training library used inside worker processes.

One script runs unchanged under plain ``python``, under ``torchrun`` and as a torchrelay job;
the job spec's strategy decides how ``prepare`` distributes it::

    import torchrelay.train as rt

    ctx = rt.init()                                    # process group from torchrun's env
    model, opt = rt.prepare(model, opt)                # DDP, local SGD, DiLoCo, PS … per the spec
    loader = rt.shard(dataset, batch_size=64)          # this rank's share; set_epoch each epoch
    for step, (x, y) in enumerate(loader, 1):
        ...
        rt.report(step, loss=loss.item())              # reaches the server, batched
        if rt.checkpoint_due(step):
            rt.save_checkpoint({"model": model.state_dict()}, step)   # on every rank
    rt.finish()                                        # replicas agree (final averaging …)
    full = rt.full_state_dict(model)                   # the whole model on rank 0 (fsdp gathers it)
    if ctx.is_main:
        rt.save_artifact("model.pt", full)
    rt.shutdown()

Imports nothing from ``torchrelay.server``. See docs/training-library.md.
"""
from torchrelay.train.artifacts import artifact_url, job_store, save_artifact
from torchrelay.train.checkpoint import (checkpoint_due, load_checkpoint, save_checkpoint, wait_for_checkpoint,
                                         wait_for_staging)
from torchrelay.train.checkpoint_state import TrainState
from torchrelay.train.context import (Context, LocalModule, current_context, finish, full_state_dict, init, prepare,
                                      shutdown, unwrap)
from torchrelay.train.data import data_share, shard, shard_indices
from torchrelay.train.stream_data import StreamLoader, kafka_loader, rabbitmq_stream_loader
from torchrelay.train.preempt import should_stop
from torchrelay.train.report import flush as flush_metrics
from torchrelay.train.report import report
from torchrelay.train.resumable import ResumableStream
from torchrelay.train.stream import ShardStream, stream

__all__ = [
    "Context", "LocalModule", "ResumableStream", "ShardStream", "TrainState", "artifact_url", "checkpoint_due",
    "current_context", "data_share", "finish", "flush_metrics", "full_state_dict", "init", "job_store",
    "load_checkpoint", "prepare", "report", "save_artifact", "save_checkpoint", "shard", "shard_indices",
    "should_stop", "shutdown", "stream", "unwrap", "wait_for_checkpoint", "wait_for_staging",
    "StreamLoader", "kafka_loader", "rabbitmq_stream_loader",
]
