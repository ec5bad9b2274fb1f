"""The sampler process: prompts -> engine (JAX or vLLM) -> rewards -> rollout groups -> ingest.

One loop iteration is one generation batch. With sampler.weight_updates=
between_batches newer weights are installed only between batches, so a group
records the single version that produced all of its completions; with
in_flight the engine takes a newly installed version at its next decode-chunk
boundary, each token records its version, and a group carries its oldest. The sampler stops
after it installs a version the trainer marked final (or on SIGTERM), once
its backlog is acknowledged or a drain timeout passes.
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import pathlib
import threading
import time

import grpc
import jax
from grpc_health.v1 import health_pb2_grpc

from grpo_stream.common.runtime.console import count_and_range, detail_logger
from grpo_stream.common.runtime.device_memory import device_memory
from grpo_stream.common.config.schema import RunConfig
from grpo_stream.common.engine.evaluation import greedy_probe
from grpo_stream.common.rpc.grpc_util import ClientSecurity, open_channel
from grpo_stream.common.runtime.prometheus import ServiceMetrics
from grpo_stream.common.tasks.rewards import RewardSet
from grpo_stream.common.runtime.process import build_policy, build_task_and_tokenizer, stop_on_signals
from grpo_stream.common.model.sharding import make_mesh
from grpo_stream.common.weights.snapshot import digest
from grpo_stream.common.rollouts.wire import to_proto
from grpo_stream.protos import rollout_pb2_grpc
from grpo_stream.sampler_service.admission_client import AdmissionClient
from grpo_stream.sampler_service.batches import BatchBuilder
from grpo_stream.sampler_service.connect import resume_position, trainer_serving, wait_for_trainer
from grpo_stream.sampler_service.grouping import build_groups
from grpo_stream.sampler_service.rollout_client import RolloutClient
from grpo_stream.common.engine.registry import build_engine, engine_spec
from grpo_stream.common.weights.registry import transport_spec, weight_source
from grpo_stream.common.weights.transport import SourceContext
from grpo_stream.sampler_service.weight_sync import WeightSync

log = logging.getLogger(__name__)
detail = detail_logger(__name__)
INJECTED_ONLY = 2**31 - 1  # sampling-key stream of batches made of injected prompts only


class Sampler:
    def __init__(self, cfg: RunConfig, index: int, devices=None, hub=None, run_dir: pathlib.Path | None = None):
        """`devices`: this sampler's devices (default: the process's local ones); `hub`: the in-process weight
        hub of weights.transport=local; `run_dir`: where sampler-<index>.json goes (none when None)."""
        if not 0 <= index < cfg.sampler.replicas:
            raise ValueError(f"--index {index} outside 0..sampler.replicas-1 ({cfg.sampler.replicas - 1})")
        if transport_spec(cfg.weights.transport).in_process and hub is None:
            raise ValueError(f"weights.transport={cfg.weights.transport} runs the samplers inside the trainer's "
                             "process: start the run with `grpo-stream up` (or `grpo-stream colocated`), or choose "
                             "another weights.transport")
        self.cfg, self.index = cfg, index
        self.devices, self.hub, self.run_dir = devices, hub, run_dir
        self.sampler_id = f"sampler-{index}"
        self.stop_event = threading.Event()
        self.installed_versions: list[int] = []
        self.params, self.version, self.final, self.last_poll = None, -1, False, 0.0
        self.groups_at_version = 0  # groups generated with the installed version
        self.waited_for_weights_s = 0.0
        self.groups_generated = 0  # groups for training generated, sent or not (the run's waste is counted from these)
        self.admission: AdmissionClient | None = None
        self.fetch_seconds: list[float] = []
        self.fetch_bytes: list[int] = []  # per installed version (with LoRA: the adapters, and the base when fetched)
        self.publish_to_install_s: list[float] = []  # per installed version: trainer's publication -> installed here
        self.tokens_generated = 0  # completion tokens of the groups generated
        self.generate_seconds = 0.0  # time inside the engine's generate calls
        self.sync: WeightSync | None = None
        self.client: RolloutClient | None = None
        self.ingest_stub = None
        self.batches: BatchBuilder | None = None
        self._rate: collections.deque = collections.deque(maxlen=4096)  # (time, tokens) per group sent
        self._batches, self._last_report, self._last_line = 0, 0.0, time.monotonic()

    def _await_first_weights(self, stub: health_pb2_grpc.HealthStub) -> None:
        """Install the trainer's first version before generating. A trainer that is up but has not published yet
        (warm start, eval_before, loading a large checkpoint: minutes to hours) is waited for as long as it
        answers; one silent for sampler.connect_timeout_s ends the sampler."""
        timeout = self.cfg.sampler.connect_timeout_s
        started = heard = last_log = last_check = time.monotonic()
        while self.params is None and not self.stop_event.is_set():
            self._poll_weights()
            if self.params is not None:
                return
            now = time.monotonic()
            if now - last_check >= 1.0:
                last_check = now
                try:
                    if trainer_serving(stub):
                        heard = now
                except grpc.RpcError:
                    pass
                if now - heard > timeout:
                    raise ConnectionError(
                        f"sampler.trainer_address={self.cfg.trainer_address()}: the trainer stopped answering for "
                        f"{timeout:.0f}s (sampler.connect_timeout_s) before it published any weights")
            if now - last_log >= 30:
                last_log = now
                log.info("%s waiting for the trainer's first weights (%.0fs so far; the trainer is up, e.g. in its "
                         "warm start or eval_before)", self.sampler_id, now - started)
            time.sleep(0.05 if self.cfg.weights.background_fetch else 0.5)

    def run(self) -> dict:
        run_started = time.monotonic()
        cfg, gen = self.cfg, self.cfg.generation
        task, tokenizer = build_task_and_tokenizer(cfg)
        model = build_policy(cfg, tokenizer.vocab_size, seed=None, dtype=cfg.sampler_dtype())
        engine = build_engine(cfg, model, tokenizer, self.index)
        rewards = RewardSet(cfg.task.rewards)
        prom = ServiceMetrics(self.sampler_id)
        self.version_gauge = prom.gauge("sampler_weight_version", "weight version this sampler generates with")
        self.lag_gauge = prom.gauge("sampler_weight_lag", "newest version seen minus the installed one")
        self.failures_gauge = prom.gauge("sampler_weight_fetch_failures", "failed fetches since the last install")
        groups_total = prom.counter("sampler_groups", "rollout groups generated")
        tokens_total = prom.counter("sampler_tokens", "completion tokens generated")
        backlog = prom.gauge("sampler_backlog", "groups generated but not yet acknowledged by the ingest")
        metrics_port = None if cfg.sampler.metrics_port is None else (
            cfg.sampler.metrics_port + self.index if cfg.sampler.metrics_port else 0)
        prom.start(cfg.sampler.metrics_host, metrics_port)
        self.security = ClientSecurity.from_config(cfg)
        channel = open_channel(cfg.trainer_address(), self.security)
        health = health_pb2_grpc.HealthStub(channel)
        wait_for_trainer(cfg, health, self.stop_event)
        # an engine that places the weights itself (vLLM) gets them on one host device and takes them from there
        mesh = (make_mesh(1, cfg.sampler.mesh.tp, self.devices or jax.local_devices(), "sampler.mesh.tp")
                if engine_spec(cfg.sampler.engine).jax_mesh else make_mesh(1, 1, jax.devices("cpu")[:1],
                                                                           "sampler.mesh.tp"))
        log.info("%s mesh %s on %s", self.sampler_id, dict(mesh.shape), [d.id for d in mesh.devices.flat])
        sync = WeightSync(self._fetcher(channel), model, mesh, self.sampler_id, cfg.weights.retry_initial_s,
                          cfg.weights.retry_max_s, cfg.trainer.max_staleness, channel,
                          background=cfg.weights.background_fetch)
        # rollouts go to the ingest, which is the trainer's server unless it runs on its own (ingest.standalone)
        ingest_channel = (channel if cfg.ingest_address() == cfg.trainer_address() else
                          open_channel(cfg.ingest_address(), self.security))
        self.ingest_stub = rollout_pb2_grpc.RolloutIngestStub(ingest_channel)
        start = resume_position(cfg, self.sampler_id, self.ingest_stub, self.stop_event)
        client = self.client = RolloutClient(ingest_channel, cfg.sampler.backlog_max_groups,
                                             cfg.sampler.max_groups_per_message).start()
        log.info("%s connected to %s, rollouts to %s (tokenizer %s), data position %d", self.sampler_id,
                 cfg.trainer_address(), cfg.ingest_address(), tokenizer.fingerprint(), start)

        self.sync = sync
        self.admission = AdmissionClient(self.ingest_stub, self.sampler_id, cfg.sampler.admission, self.stop_event)
        self._await_first_weights(health)

        # data position p = the p-th prompt of this sampler's stream; it names the group and seeds its sampling,
        # so a restarted sampler continues the same sequence after its last accepted group
        prompts = zip(itertools.count(start), task.train_stream(self.index, cfg.sampler.replicas, start))
        self.batches = BatchBuilder(cfg, self.sampler_id, tokenizer, prompts, rewards)
        self.batches.ingest_stub = self.ingest_stub
        rng = jax.random.key(cfg.run.seed * 1000 + self.index + 1)
        groups_sent = 0
        cap = cfg.sampler.max_groups_per_version
        started = time.monotonic()
        while not self.stop_event.is_set() and not self.final:
            # a finished background fetch is installed at once (before the next batch), not a poll interval later
            if self._poll_due():
                self._poll_weights()
                if self.final:
                    break
            if self.sync.too_stale():  # the trainer would drop what we make now: wait for newer weights
                log.warning("%s: version %d is %d behind the newest (trainer.max_staleness %d); waiting for weights",
                            self.sampler_id, self.version, self.sync.lag(), cfg.trainer.max_staleness)
                while self.sync.too_stale() and not self.stop_event.is_set() and not self.final:
                    self.stop_event.wait(cfg.sampler.weight_poll_s)
                    self._poll_weights()
                continue
            wanted = cfg.sampler.prompts_per_batch
            if cap is not None:  # synchronous mode: at most `cap` groups per weight version
                wanted = min(wanted, cap - self.groups_at_version)
                if wanted <= 0:
                    self._await_newer_version(started_wait=time.monotonic())
                    continue
            full = wanted  # a fixed-shape engine keeps this batch shape when fewer groups are admitted
            wanted = self.admission.admit(wanted, self.version, client.unacked)
            if wanted == 0:  # nothing trainable now: check for weights (or the final version) and ask again
                continue
            batch = self.batches.next_batch(wanted, self.version)
            # one program shape per run: rows injected prompts leave unused are padding (the first prompt again);
            # vLLM takes any batch size, so it gets no padding rows
            flat = [slot.ids for slot in batch for _ in range(slot.rows)]
            if engine.fixed_shape:
                flat += [batch[0].ids] * (full * gen.num_generations - len(flat))
            version = self.version
            # the key follows the first data position (as before injection existed); a batch of injected prompts
            # only draws from a stream of its own
            seed = next((slot.position for slot in batch if slot.position is not None), None)
            key = jax.random.fold_in(rng, seed) if seed is not None else jax.random.fold_in(
                jax.random.fold_in(rng, INJECTED_ONLY), self._batches)
            self._batches += 1
            generating = time.monotonic()
            if cfg.sampler.weight_updates == "in_flight":  # newer weights take over live sequences mid-batch
                out = engine.generate(self.params, flat, key, refresh=self._refresh_in_flight, version=version)
            else:
                out = engine.generate(self.params, flat, key)
            self.generate_seconds += time.monotonic() - generating
            groups = build_groups([(slot.problem, slot.ids) for slot in batch], out, gen.num_generations, tokenizer,
                                  rewards, version, self.sampler_id, [slot.group_id for slot in batch],
                                  [slot.position for slot in batch], sizes=[slot.rows for slot in batch],
                                  reward_sets=[slot.rewards for slot in batch],
                                  injected=[slot.position is None for slot in batch])
            self.groups_generated += sum(slot.train for slot in batch)
            self.sync.groups_generated = self.groups_generated
            for group in groups:  # (a generator: each group is scored as it is taken)
                self.tokens_generated += sum(len(c.token_ids) for c in group.completions)
                if not self._push(client, to_proto(group)):
                    break
                groups_sent += 1
                if version == self.version:  # a newer version installed mid-push starts its own count at 0
                    self.groups_at_version += 1
                groups_total.inc()
                tokens_total.inc(sum(len(c.token_ids) for c in group.completions))
                self._rate.append((time.monotonic(), sum(len(c.token_ids) for c in group.completions)))
            if groups_sent and run_started is not None:  # start-up is over (bench/startup.py waits for this line)
                log.info("%s first group generated %.2fs after the sampler started", self.sampler_id,
                         time.monotonic() - run_started)
                run_started = None
            self._report_throughput(groups_sent)
            backlog.set(client.unacked)
        # after the final version the trainer consumes no more: do not wait long for acks
        drained = client.drain(timeout_s=2.0 if self.final else 10.0)
        client.close()
        if ingest_channel is not channel:
            ingest_channel.close()
        sync.close()
        sync.report()
        verified = self._verify(engine, model, task, tokenizer) if cfg.weights.verify_prompts and self.final else None
        channel.close()
        prom.stop()
        elapsed = time.monotonic() - started
        log.info("%s stopping: %d groups generated (%.2f groups/s), stream stats %s, backlog drained: %s, "
                 "versions installed %s, %.1fs waiting for weights", self.sampler_id, groups_sent,
                 groups_sent / max(elapsed, 1e-9), dict(client.stats), drained, count_and_range(self.installed_versions),
                 self.waited_for_weights_s)
        result = {"sampler_id": self.sampler_id, "groups": groups_sent, "groups_generated": self.groups_generated,
                  "injected_groups": self.batches.injected_done,
                  "waited_for_admission_s": round(self.admission.waited_s, 3),
                  "versions": self.installed_versions,
                  "waited_for_weights_s": round(self.waited_for_weights_s, 3), "fetch_seconds": self.fetch_seconds,
                  "fetch_bytes": self.fetch_bytes, "publish_to_install_seconds": self.publish_to_install_s,
                  "final_weights": verified,
                  # completion tokens generated, the time spent generating them, and the time since the first weights
                  "tokens_generated": self.tokens_generated, "generate_seconds": round(self.generate_seconds, 3),
                  "sampling_seconds": round(time.monotonic() - started, 3),
                  "device_memory": device_memory(self.devices[0] if self.devices else None),
                  # the JAX engine's compiled shapes (slots, windows, prompt buckets): each costs a compilation
                  "engine_programs": sorted(map(list, getattr(engine, "programs", ())))}
        if self.run_dir is not None:
            (self.run_dir / f"{self.sampler_id}.json").write_text(json.dumps(result, indent=2))
        return result

    def _report_throughput(self, groups_sent: int) -> None:
        """Every few seconds: groups/s and tokens/s over the last minute, reported to the trainer with the installed
        version; every logging.summary_every_s, the same as one console line."""
        now = time.monotonic()
        if self.sync is None or now - self._last_report < 5.0:
            return
        self._last_report = now
        recent = [(t, n) for t, n in self._rate if now - t <= 60.0]
        span = max(now - recent[0][0], 1.0) if recent else 1.0
        self.sync.throughput = (len(recent) / span, sum(n for _, n in recent) / span)
        self.sync.report()
        if now - self._last_line >= self.cfg.logging.summary_every_s and not self.cfg.logging.verbose:
            self._last_line = now
            log.info("%s: version %d (lag %d), %.2f groups/s, %.0f tokens/s over the last minute; %d groups sent, "
                     "%d versions installed", self.sampler_id, self.version, self.sync.lag(), *self.sync.throughput,
                     groups_sent, len(self.installed_versions))

    def _fetcher(self, channel: grpc.Channel):
        host = self.cfg.trainer_address().rsplit(":", 1)[0].strip("[]")
        return weight_source(self.cfg.weights.transport, SourceContext(
            self.cfg.weights, self.sampler_id, self.cfg.sampler.rpc_timeout_s, channel=channel, trainer_host=host,
            security=self.security, hub=self.hub))

    def _verify(self, engine, model, task, tokenizer) -> dict:
        """Digest of the installed (final) parameters and greedy completions, to compare with the trainer's."""
        problems = task.heldout(self.cfg.weights.verify_prompts)
        return {"version": self.version, "sha256": digest(model.to_named_numpy(self.params)),
                "greedy": greedy_probe(engine, self.params, tokenizer, problems, self.cfg.eval.batch_size)}

    def _poll_weights(self) -> None:
        """Install a newer published version if there is one (only ever between generation batches)."""
        self.last_poll = time.monotonic()
        got = self.sync.poll()
        self.lag_gauge.set(self.sync.lag())
        self.failures_gauge.set(self.sync.failures)
        if got is None:
            return
        if got.params is not None:
            self.params, self.version, self.groups_at_version = got.params, got.version, 0
            self.sync.mark_installed(got)
            if self.client is not None:  # queued groups the trainer would now drop as stale are not sent
                self.client.min_version = max(0, got.version - self.cfg.trainer.max_staleness)
            self.installed_versions.append(got.version)
            self.fetch_seconds.append(round(got.fetch_seconds, 4))
            self.fetch_bytes.append(got.nbytes)
            if got.published_unix:
                self.publish_to_install_s.append(round(time.time() - got.published_unix, 4))
            self.version_gauge.set(got.version)
            detail.info("%s installed weight version %d (%.1f MB, fetch %.2fs)%s", self.sampler_id, got.version,
                        got.nbytes / 1e6, got.fetch_seconds, " [final]" if got.final else "")
        self.final = got.final

    def _poll_due(self) -> bool:
        """A weight check is due: the poll interval passed, or a background fetch finished (installed at once)."""
        return time.monotonic() - self.last_poll >= self.cfg.sampler.weight_poll_s or self.sync.has_result()

    def _refresh_in_flight(self):
        """sampler.weight_updates=in_flight: the engine asks between decode chunks; a newly installed version is
        returned as (params, version) and continues every live sequence."""
        if not self._poll_due():
            return None
        before = self.version
        self._poll_weights()
        return (self.params, self.version) if self.version != before else None

    def _await_newer_version(self, started_wait: float) -> None:
        """Synchronous mode: poll until a newer (or final) version is installed, or a stop is asked for."""
        version = self.version
        while self.version == version and not self.final and not self.stop_event.is_set():
            pause = self.cfg.sampler.weight_poll_s - (time.monotonic() - self.last_poll)
            if pause > 0:
                self.stop_event.wait(pause)
            self._poll_weights()
        self.waited_for_weights_s += time.monotonic() - started_wait

    def _push(self, client: RolloutClient, group) -> bool:
        """Hand a group to the sender; while its backlog is full keep checking for new (or final) weights.

        False when the sampler must stop instead (signal or final version).
        """
        while not client.put(group, timeout_s=0.5):
            if self.stop_event.is_set():
                return False
            if time.monotonic() - self.last_poll >= self.cfg.sampler.weight_poll_s:
                self._poll_weights()
                if self.final:
                    return False
        return True


def run_sampler(cfg: RunConfig, index: int, run_dir: pathlib.Path | None = None) -> dict:
    sampler = Sampler(cfg, index, run_dir=run_dir)
    stop_on_signals(sampler.stop_event, "generation batch")
    return sampler.run()
