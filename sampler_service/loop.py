"""The sampler process: prompts -> engine (JAX or vLLM) -> rewards -> rollout groups -> ingest.

One loop iteration is one generation batch. With sampler.weight_updates=
between_batches newer weights are installed only between batches, so a group
records the single version that produced all of its completions; with
in_flight the engine takes a newly installed version at its next decode-chunk
boundary, each token records its version, and a group carries its oldest. The sampler stops
after it installs a version the trainer marked final (or on SIGTERM), once
its backlog is acknowledged or a drain timeout passes.

What the sampler starts (engine, channels, sender thread, background fetches, /metrics) is set up and stopped by
lifecycle.py, also when the loop ends on an error. Errors end the loop as they are: a PermanentError (weights of
another model, a token refused) tells the entry point that restarting the sampler cannot help
(common/runtime/errors.py); a rollout sender that stopped ends the loop at the next batch or push.
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import pathlib
import threading
import time

import jax

from grpo_stream.common.config.schema import RunConfig
from grpo_stream.common.engine.evaluation import greedy_probe
from grpo_stream.common.environments.runner import EpisodeRunner, episode_runner
from grpo_stream.common.rollouts.wire import to_proto
from grpo_stream.common.runtime.console import count_and_range, detail_logger
from grpo_stream.common.runtime.device_memory import device_memory
from grpo_stream.common.runtime.process import stop_on_signals
from grpo_stream.common.weights.registry import transport_spec
from grpo_stream.common.weights.snapshot import digest
from grpo_stream.sampler_service.admission_client import AdmissionClient
from grpo_stream.sampler_service.batches import BatchBuilder, Slot
from grpo_stream.sampler_service.episode_groups import episode_groups
from grpo_stream.sampler_service.grouping import build_groups
from grpo_stream.sampler_service.lifecycle import Parts, SamplerMetrics, open_sampler, served_over_http
from grpo_stream.sampler_service.rollout_client import RolloutClient
from grpo_stream.sampler_service.verifiers_groups import verifiers_rollouts
from grpo_stream.sampler_service.weights_in_use import WeightsInUse

log = logging.getLogger(__name__)
detail = detail_logger(__name__)
INJECTED_ONLY = 2**31 - 1  # sampling-key stream of batches made of injected prompts only


class Sampler(WeightsInUse):
    def __init__(self, cfg: RunConfig, index: int, devices=None, hub=None, run_dir: pathlib.Path | None = None):
        """`devices`: this sampler's devices (default: the process's local ones); `hub`: the in-process weight
        hub of weights.transport=local; `run_dir`: where sampler-<index>.json goes (none when None)."""
        if not 0 <= index < cfg.sampler.replicas:
            raise ValueError(f"--index {index} outside 0..sampler.replicas-1 ({cfg.sampler.replicas - 1})")
        if transport_spec(cfg.weights.transport).in_process and hub is None:
            raise ValueError(f"weights.transport={cfg.weights.transport} runs the samplers inside the trainer's "
                             "process: start the run with `grpo-stream up` (or `grpo-stream colocated`), or choose "
                             "another weights.transport")
        super().__init__(cfg, f"sampler-{index}", threading.Event())
        self.index, self.devices, self.hub, self.run_dir = index, devices, hub, run_dir
        self.groups_generated = 0  # groups for training generated, sent or not (the run's waste is counted from these)
        self.groups_sent = 0
        self.admission: AdmissionClient | None = None
        self.tokens_generated = 0  # completion tokens of the groups generated
        self.generate_seconds = 0.0  # time inside the engine's generate calls
        self.ingest_stub = None
        self.batches: BatchBuilder | None = None
        self._rate: collections.deque = collections.deque(maxlen=4096)  # (time, tokens) per group sent
        self._batches, self._last_report, self._last_line = 0, 0.0, time.monotonic()
        self._run_started: float | None = None  # until the first group is sent (start-up time is logged then)
        self._rng = None
        self.episodes: EpisodeRunner | None = None  # environment.name: multi-turn episodes
        self.environment_seconds = 0.0  # environment steps (tool calls), run beside decoding
        self.verifiers = None  # task.name=verifiers: the environment's rollouts (verifiers_groups.py)

    def run(self) -> dict:
        """Set up, generate until the final version (or a stop), drain, tear down; the run's summary."""
        self._run_started = time.monotonic()
        with open_sampler(self.cfg, self.index, self.sampler_id, self.stop_event, self.devices, self.hub) as parts, \
                served_over_http(self.cfg, self.index, self.sampler_id, parts, self._installed,
                                 self.run_dir) as endpoint:
            self._attach(parts, endpoint)
            self._await_first_weights(parts.health)
            started = time.monotonic()
            try:
                self._generate_until_done(parts)
            finally:
                for driver in (self.episodes, self.verifiers):
                    if driver is not None:
                        driver.close()
            # after the final version the trainer consumes no more: do not wait long for acks
            drained = parts.client.drain(timeout_s=2.0 if self.final else 10.0)
            parts.client.check()  # a sender that died while draining lost groups: the run does not end cleanly
            parts.sync.report()
            verified = self._verify(parts) if self.cfg.weights.verify_prompts and self.final else None
        return self._summary(parts, started, drained, verified, endpoint)

    def _installed(self) -> tuple:
        """The weights the endpoint's idle serves use: the installed (params, version)."""
        return self.installed

    def _attach(self, parts: Parts, endpoint) -> None:
        """Take the parts the loop uses; the data stream resumes at `parts.start`."""
        self.sync, self.client, self.metrics, self.admission = parts.sync, parts.client, parts.metrics, parts.admission
        self.ingest_stub = parts.ingest_stub
        # data position p = the p-th prompt of this sampler's stream; it names the group and seeds its sampling,
        # so a restarted sampler continues the same sequence after its last accepted group
        prompts = zip(itertools.count(parts.start),
                      parts.task.train_stream(self.index, self.cfg.sampler.replicas, parts.start))
        self.batches = BatchBuilder(self.cfg, self.sampler_id, parts.tokenizer, prompts, parts.rewards)
        self.batches.ingest_stub = parts.ingest_stub
        self._rng = jax.random.key(self.cfg.run.seed * 1000 + self.index + 1)
        self.episodes = episode_runner(self.cfg, parts.task, parts.tokenizer)
        self.verifiers = verifiers_rollouts(self.cfg, parts.task, endpoint)

    def _generate_until_done(self, parts: Parts) -> None:
        """The batch loop: until the final version is installed or a stop is asked for. Raises what stopped the
        rollout sender, and what a weight check cannot retry."""
        while not self.stop_event.is_set() and not self.final:
            parts.client.check()
            # a finished background fetch is installed at once (before the next batch), not a poll interval later
            if self._poll_due():
                self._poll_weights()
                if self.final:
                    break
            if self.sync.too_stale():  # the trainer would drop what we make now: wait for newer weights
                self._await_fresh_weights()
                continue
            wanted = self._groups_wanted()
            if wanted == 0:  # waited for a newer version (synchronous mode): check again
                continue
            admitted = self.admission.admit(wanted, self.version, parts.client.unacked)
            if admitted == 0:  # nothing trainable now: check for weights (or the final version) and ask again
                continue
            self._generate_batch(parts, self.batches.next_batch(admitted, self.version), wanted)
            self._report_throughput(self.groups_sent)
            parts.metrics.backlog.set(parts.client.unacked)

    def _groups_wanted(self) -> int:
        """Groups to ask admission for: sampler.prompts_per_batch, or in synchronous mode what is left of
        sampler.max_groups_per_version (0 after waiting for a newer version when nothing is left)."""
        wanted, cap = self.cfg.sampler.prompts_per_batch, self.cfg.sampler.max_groups_per_version
        if cap is not None:
            wanted = min(wanted, cap - self.groups_at_version)
            if wanted <= 0:
                self._await_newer_version(started_wait=time.monotonic())
                return 0
        return wanted

    def _generate_batch(self, parts: Parts, batch: list[Slot], full: int) -> None:
        """Generate one batch and hand its groups to the sender. `full`: the groups the batch was sized for (a
        fixed-shape engine keeps that shape when fewer were admitted)."""
        if self.verifiers is not None:  # the environment's rows run its rollouts; injected prompts the engine's way
            self._generate_verifiers(parts, [slot for slot in batch if hasattr(slot.problem, "row")])
            batch = [slot for slot in batch if not hasattr(slot.problem, "row")]
            if not batch:
                return
        gen, engine = self.cfg.generation, parts.engine
        # one program shape per run: rows injected prompts leave unused are padding (the first prompt again);
        # vLLM takes any batch size, so it gets no padding rows
        flat = [slot.ids for slot in batch for _ in range(slot.rows)]
        if engine.fixed_shape:
            flat += [batch[0].ids] * (full * gen.num_generations - len(flat))
        version = self.version
        # the key follows the first data position (as before injection existed); a batch of injected prompts
        # only draws from a stream of its own
        seed = next((slot.position for slot in batch if slot.position is not None), None)
        key = jax.random.fold_in(self._rng, seed) if seed is not None else jax.random.fold_in(
            jax.random.fold_in(self._rng, INJECTED_ONLY), self._batches)
        self._batches += 1
        generating = time.monotonic()
        if self.episodes is not None:
            self._generate_episodes(parts, batch, key, version)
            return
        if self.cfg.sampler.weight_updates == "in_flight":  # newer weights take over live sequences mid-batch
            out = engine.generate(self.params, flat, key, refresh=self._refresh_in_flight, version=version)
        else:
            out = engine.generate(self.params, flat, key)
        self.generate_seconds += time.monotonic() - generating
        groups = build_groups([(slot.problem, slot.ids) for slot in batch], out, gen.num_generations,
                              parts.tokenizer, parts.rewards, version, self.sampler_id,
                              [slot.group_id for slot in batch], [slot.position for slot in batch],
                              sizes=[slot.rows for slot in batch], reward_sets=[slot.rewards for slot in batch],
                              injected=[slot.position is None for slot in batch])
        self.groups_generated += sum(slot.train for slot in batch)
        self.sync.groups_generated = self.groups_generated
        self._send(parts.client, parts.metrics, groups, version)

    def _generate_episodes(self, parts: Parts, batch: list[Slot], key, version: int) -> None:
        """A batch of multi-turn episodes (environment.name): slot k's rows are its group's episodes."""
        generating = time.monotonic()
        refresh = self._refresh_in_flight if self.cfg.sampler.weight_updates == "in_flight" else None
        problems = [slot.problem for slot in batch for _ in range(slot.rows)]
        prompts = [slot.ids for slot in batch for _ in range(slot.rows)]
        results, figures = self.episodes.run(parts.engine, self.params, problems, prompts, key, refresh=refresh,
                                             version=version)
        self.generate_seconds += time.monotonic() - generating
        self.environment_seconds += figures.get("environment_seconds", 0.0)
        self.groups_generated += sum(slot.train for slot in batch)
        self.sync.groups_generated = self.groups_generated
        self._send(parts.client, parts.metrics, episode_groups(batch, results, version, self.sampler_id,
                                                               self.cfg.environment.turn_reward_weight), version)

    def _generate_verifiers(self, parts: Parts, batch: list[Slot]) -> None:
        """A batch of a verifiers environment's rollouts (task.name=verifiers), run against this sampler's endpoint;
        the sampler's weights stay as they are until the batch ends."""
        generating = time.monotonic()
        groups = self.verifiers.run(batch, self.version, self.sampler_id)
        self.generate_seconds += time.monotonic() - generating
        self.groups_generated += sum(slot.train for slot in batch)
        self.sync.groups_generated = self.groups_generated
        self._send(parts.client, parts.metrics, groups, self.version)

    def _send(self, client: RolloutClient, metrics: SamplerMetrics, groups, version: int) -> None:
        """Hand a batch's groups to the sender (a generator: each group is scored as it is taken)."""
        for group in groups:
            tokens = sum(len(c.token_ids) for c in group.completions)
            self.tokens_generated += tokens
            if not self._push(client, to_proto(group)):
                break
            self.groups_sent += 1
            if version == self.version:  # a newer version installed mid-push starts its own count at 0
                self.groups_at_version += 1
            metrics.groups.inc()
            metrics.tokens.inc(tokens)
            self._rate.append((time.monotonic(), tokens))
        if self.groups_sent and self._run_started is not None:  # start-up is over (bench/startup.py waits for it)
            log.info("%s first group generated %.2fs after the sampler started", self.sampler_id,
                     time.monotonic() - self._run_started)
            self._run_started = None

    def _summary(self, parts: Parts, started: float, drained: bool, verified: dict | None, endpoint) -> dict:
        """The run's figures: logged, returned, and written to RUN_DIR/sampler-<index>.json."""
        elapsed, client = time.monotonic() - started, parts.client
        log.info("%s stopping: %d groups generated (%.2f groups/s), stream stats %s, backlog drained: %s, "
                 "versions installed %s, %.1fs waiting for weights", self.sampler_id, self.groups_sent,
                 self.groups_sent / max(elapsed, 1e-9), dict(client.stats), drained,
                 count_and_range(self.installed_versions), self.waited_for_weights_s)
        result = {"sampler_id": self.sampler_id, "groups": self.groups_sent, "groups_generated": self.groups_generated,
                  "injected_groups": self.batches.injected_done,
                  "waited_for_admission_s": round(self.admission.waited_s, 3),
                  "versions": self.installed_versions,
                  "waited_for_weights_s": round(self.waited_for_weights_s, 3), "fetch_seconds": self.fetch_seconds,
                  "fetch_bytes": self.fetch_bytes, "publish_to_install_seconds": self.publish_to_install_s,
                  "final_weights": verified,
                  # completion tokens generated, the time spent generating them, and the time since the first weights
                  "tokens_generated": self.tokens_generated, "generate_seconds": round(self.generate_seconds, 3),
                  "environment_seconds": round(self.environment_seconds, 3),
                  "sampling_seconds": round(elapsed, 3),
                  "device_memory": device_memory(self.devices[0] if self.devices else None),
                  # the JAX engine's compiled shapes (slots, windows, prompt buckets): each costs a compilation
                  "engine_programs": sorted(map(list, getattr(parts.engine, "programs", ()))),
                  "openai": endpoint.figures() if endpoint is not None else None}
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

    def _verify(self, parts: Parts) -> dict:
        """Digest of the installed (final) parameters and greedy completions, to compare with the trainer's."""
        problems = parts.task.heldout(self.cfg.weights.verify_prompts)
        return {"version": self.version, "sha256": digest(parts.model.to_named_numpy(self.params)),
                "greedy": greedy_probe(parts.engine, self.params, parts.tokenizer, problems, self.cfg.eval.batch_size)}


def run_sampler(cfg: RunConfig, index: int, run_dir: pathlib.Path | None = None) -> dict:
    sampler = Sampler(cfg, index, run_dir=run_dir)
    stop_on_signals(sampler.stop_event, "generation batch")
    return sampler.run()
