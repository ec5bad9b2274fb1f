"""Run one trainer update step for real (donating, as the trainer does) on this process's CPU devices and print, as JSON, what it held: the bytes
of its input arrays (parameters, optimizer state, batch) and the growth of the process's resident memory while the
step ran (its outputs and temporaries), sampled every half millisecond. `tests/e2e/test_plan.py` compares their
sum with `grpo-stream plan`'s total for the same config. Input: the resolved config as JSON on stdin."""

from __future__ import annotations

import ctypes
import gc
import json
import os
import sys
import threading
import time

import jax
import numpy as np

from grpo_stream.common.config.schema import RunConfig
from grpo_stream.common.model.policy import build_model
from grpo_stream.common.model.sharding import make_mesh, place
from grpo_stream.trainer_service.learning.batching import TrainBatch
from grpo_stream.trainer_service.learning.packing import pack_batch, packing_layout
from grpo_stream.trainer_service.learning.rl_update import PolicyUpdater


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    cfg = RunConfig.model_validate(json.loads(sys.stdin.read()))
    t, gen, vocab = cfg.trainer, cfg.generation, cfg.model.tiny.vocab_size
    mesh = make_mesh(t.mesh.fsdp, t.mesh.tp, jax.devices(), "trainer.mesh")
    model = build_model(cfg.model, vocab, seed=0)
    params = place(model.params, mesh)
    layout = packing_layout(cfg, t.mesh.fsdp)
    updater = PolicyUpdater(model.with_remat(t.remat), params, cfg.algo, t.learning_rate, t.max_grad_norm,
                            gen.temperature, 0, layout, mesh, t.optimizer, t.steps, donate=True)
    rows, prompt, length = t.groups_per_step * gen.num_generations, gen.max_prompt_tokens, gen.max_prompt_tokens + \
        gen.max_new_tokens
    rng = np.random.default_rng(0)
    loss_mask = np.zeros((rows, length - 1), np.float32)
    loss_mask[:, prompt - 1:] = 1.0  # every sequence at full length: prompt, then a completion at the limit
    batch = TrainBatch(tokens=rng.integers(1, vocab, (rows, length)).astype(np.int32),
                       valid=np.ones((rows, length), bool), loss_mask=loss_mask,
                       behaviour_logprobs=np.full((rows, length - 1), -3.0, np.float32),
                       advantages=rng.normal(size=rows).astype(np.float32), fresh=np.ones(rows, np.float32))
    # one minibatch's update, as the trainer runs it: packed on the host, placed once
    (passes, count, norm), = updater.programs.place(pack_batch(batch, layout, 1, 0))
    batch = passes
    step = lambda: updater.programs._step(*updater.split(updater.params), updater.opt_state, passes,  # noqa: E731
                                          count, None, None, None, norm)
    # a first step compiles and warms the allocator; the second is measured
    updater.params, updater.opt_state, _ = jax.block_until_ready(step())
    gc.collect()
    # what the first step freed goes back to the system now, so the growth below is the measured step's own (glibc
    # keeps freed heap pages, and raises its mmap threshold after large frees, unless told otherwise: the test runs
    # this with a fixed MALLOC_MMAP_THRESHOLD_, so large buffers are mapped and unmapped as they come and go)
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    inputs = sum(x.nbytes for x in jax.tree.leaves((updater.params, updater.opt_state, batch)))
    base = peak = resident_bytes()
    done = threading.Event()

    def poll() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, resident_bytes())
            time.sleep(0.0005)

    watcher = threading.Thread(target=poll)
    watcher.start()
    # donates, as the trainer does with a transport that copies the weights off the devices
    jax.block_until_ready(step())
    done.set()
    watcher.join()
    print(json.dumps({"inputs_bytes": inputs, "step_growth_bytes": peak - base,
                      "devices": t.mesh.fsdp * t.mesh.tp}))


if __name__ == "__main__":
    main()
