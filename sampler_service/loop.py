"""The sampler process: prompts -> a rollout stream on the engine (JAX or vLLM) -> rewards -> groups -> ingest.

There is no generation batch. The engine runs one `serve` over the sampler's rollout stream (common/episodes/
stream.py) on a thread of its own, from the first weights to the last; this thread (the feeder) starts groups
whenever the stream has room (at most sampler.rows_in_flight episodes in flight, and fewer turns wanting the engine
than it has slots) and the ingest's admission grants them
(groups trainable within trainer.max_staleness): injected prompts first, then the sampler's data stream. A group's
rows enter the engine at its next scheduling point, beside whatever else decodes (the endpoint's requests included),
and when its last episode ends it is scored and sent at once (group_sink.py), whatever the other groups in flight
are doing. Every kind of rollout (single turn, an environment's episodes, a verifiers environment's) runs on the same
stream and goes through the same group builder (common/episodes/registry.py, groups.py).

Weights (the sampler's `weights`, weights_in_use.py): this thread polls for newer versions; the engine takes one at
its next scheduling point (sampler.weight_updates=in_flight; each token records its version and a group counts as its
oldest token's), or once the groups in flight have ended (drain: no group starts meanwhile). The sampler stops after
it installs a version the trainer marked final (what is in flight then is abandoned: the trainer trains nothing
more), or on SIGTERM, once its backlog is acknowledged or a drain timeout passes.

What the sampler starts (engine, channels, sender thread, background fetches, /metrics) is set up and stopped by
lifecycle.py, also when the loop ends on an error. Errors end the loop as they are: a PermanentError (weights of
another model, a token refused) tells the entry point that restarting the sampler cannot help
(common/runtime/errors.py); a rollout sender, group sink or engine that stopped ends the loop at once.
"""

from __future__ import annotations

import collections
import logging
import pathlib
import threading
import time

import jax

from grpo_stream.common.config.schema import RunConfig
from grpo_stream.common.engine.base import FirstWeights, rows_decoding_mean, tokens_decoded
from grpo_stream.common.episodes.evaluation import greedy_probe
from grpo_stream.common.episodes.registry import build_rollouts, injected_kind, rollout_kind
from grpo_stream.common.episodes.stream import RolloutStream
from grpo_stream.common.runtime.console import count_and_range, detail_logger
from grpo_stream.common.runtime.device_memory import device_memory, host_memory
from grpo_stream.common.runtime.files import to_json, write_atomic
from grpo_stream.common.runtime.heartbeat import Heartbeat
from grpo_stream.common.runtime.process import stop_on_signals
from grpo_stream.common.registry.transports import transport_spec
from grpo_stream.common.weights.snapshot import digest
from grpo_stream.sampler_service.engine_thread import EngineThread
from grpo_stream.common.tasks.reward_workers import RewardWorker
from grpo_stream.sampler_service.group_sink import GroupSink
from grpo_stream.sampler_service.group_source import GroupSource, resumed_prompts
from grpo_stream.sampler_service.lifecycle import Parts, open_sampler, served_over_http
from grpo_stream.sampler_service.weights_in_use import WeightsInUse

log = logging.getLogger(__name__)
detail = detail_logger(__name__)
FEED_WAIT_S = 0.05  # the feeder's longest sleep between looks at the stream (a group ending wakes it sooner)


class Sampler:
    """One sampler: its feeder loop over the rollout stream; the weights it generates with are `weights`'
    (weights_in_use.py)."""

    def __init__(self, cfg: RunConfig, index: int, devices=None, hub=None, run_dir: pathlib.Path | None = None):
        """`devices`: this sampler's devices (default: the process's local ones); `hub`: the in-process weight
        hub of weights.transport=local; `run_dir`: where sampler-<index>.json goes (none when None)."""
        if not 0 <= index < cfg.sampler.replicas:
            raise ValueError(f"--index {index} outside 0..sampler.replicas-1 ({cfg.sampler.replicas - 1})")
        if transport_spec(cfg.weights.transport).in_process and hub is None:
            raise ValueError(f"weights.transport={cfg.weights.transport} runs the samplers inside the trainer's "
                             "process: start the run with `grpo-stream up` (or `grpo-stream colocated`), or choose "
                             "another weights.transport")
        self.cfg, self.sampler_id, self.stop_event = cfg, f"sampler-{index}", threading.Event()
        self.weights = WeightsInUse(cfg, self.sampler_id, self.stop_event)
        self.index, self.devices, self.hub, self.run_dir = index, devices, hub, run_dir
        self.rows_in_flight, self.slots = cfg.rows_in_flight(), cfg.engine_slots()[1]
        self.admission = self.source = self.sink = self.rollouts = self.injected_rollouts = None
        self.ingest_stub = self.sync = self.client = self.stream = None
        self.serve_seconds = self.engine_idle_seconds = self.compile_seconds = 0.0
        self.groups_started = 0
        # groups the sink left out (failed), by the version installed when they started: they count toward
        # sampler.max_groups_per_version no more (the trainer's step never gets them; another must start instead)
        self.left_out_at_version: collections.Counter[int] = collections.Counter()
        self._left_out_lock = threading.Lock()
        self.waited_for_weights_s = 0.0
        self._held_since: float | None = None  # since when no group may start for want of weights
        self._last_report, self._last_line = 0.0, time.monotonic()
        self._run_started: float | None = None  # until the first group is sent (start-up time is logged then)
        self._stream_started = time.monotonic()  # the rollout stream's start: the throughput window begins there

    def run(self) -> dict:
        """Set up, generate until the final version (or a stop), drain, tear down; the run's summary."""
        self._run_started = time.monotonic()
        with open_sampler(self.cfg, self.index, self.sampler_id, self.stop_event, self.devices, self.hub) as parts, \
                served_over_http(self.cfg, self.index, self.sampler_id, parts, self.weights.installed,
                                 self.run_dir) as endpoint:
            try:
                self._attach(parts, endpoint)
                # beats while the trainer answers: its warm start or eval_before is no stall (up.sampler_stall_s)
                self.weights.await_first(parts.health, Heartbeat(self.run_dir, self.sampler_id))
                started = time.monotonic()
                self._stream_until_done(parts)
            finally:
                self._close_kinds_and_sink()
            # after the final version the trainer consumes no more: do not wait long for acks
            drained = parts.client.drain(timeout_s=2.0 if self.weights.final else 10.0)
            parts.client.check()  # a sender that died while draining lost groups: the run does not end cleanly
            parts.sync.report()
            verified = self._verify(parts) if self.cfg.weights.verify_prompts and self.weights.final else None
        return self._summary(parts, started, drained, verified, endpoint)

    def _close_kinds_and_sink(self) -> None:
        """Stop the rollout kinds' threads and the group sink's (its thread and reward worker), however far the run
        got: a stop or an error while waiting for the first weights left the sink's thread (and a verifiers kind's
        event loop) running in a process that goes on (a sampler inside `up`'s or a test's process)."""
        for rollouts in {id(r): r for r in (self.rollouts, self.injected_rollouts) if r is not None}.values():
            rollouts.close()
        if self.sink is not None:
            self.sink.close()

    def _attach(self, parts: Parts, endpoint) -> None:
        """Take the parts the loop uses; the data stream resumes at `parts.resume` (its unanswered positions
        first)."""
        self.sync, self.client, self.admission = parts.sync, parts.client, parts.admission
        self.weights.attach(parts.sync, parts.client, parts.metrics)
        self.ingest_stub = parts.ingest_stub
        # data position p = the p-th prompt of this sampler's stream; it names the group and seeds its sampling,
        # so a restarted sampler generates again what it had not delivered, then continues the same sequence
        prompts = resumed_prompts(parts.task, self.index, self.cfg.sampler.replicas, parts.resume.start,
                                  parts.resume.unanswered)
        key = jax.random.key(self.cfg.run.seed * 1000 + self.index + 1)
        self.source = GroupSource(self.cfg, self.sampler_id, parts.tokenizer, prompts, parts.rewards, key)
        self.source.ingest_stub = parts.ingest_stub
        routes = endpoint.routes if endpoint is not None else None
        self.rollouts = build_rollouts(self.cfg, parts.task, parts.tokenizer, routes)
        self.injected_rollouts = (self.rollouts if injected_kind(self.cfg) == rollout_kind(self.cfg) else
                                  build_rollouts(self.cfg, parts.task, parts.tokenizer, routes,
                                                 kind=injected_kind(self.cfg)))
        self.sink = GroupSink(parts.client, parts.metrics, parts.tokenizer, self.sampler_id,
                              self.cfg.environment.turn_reward_weight,
                              # the final version fetched is enough: the trainer trains nothing more, and it is
                              # installed only after the sink closed (a full backlog would hold that close)
                              abandon=lambda: self.stop_event.is_set() or self.weights.final_reached(),
                              rewards=RewardWorker(self.source.rewards.allowed, self.cfg.task.reward_timeout_s,
                                                   self.cfg.task.reward_memory_mb),
                              left_out=self._left_out)
        parts.client.lost = self._lost_at_version  # a group the ingest refused never reaches the trainer either

    def _stream_until_done(self, parts: Parts) -> None:
        """Feed the stream until the final version is fetched or a stop is asked for; then install the final
        version. Raises what stopped the rollout sender, the group sink or the engine, and what a weight check
        cannot retry."""
        weights = self.weights
        if self.stop_event.is_set() or weights.final:
            return
        self.stream = RolloutStream(parts.engine.request_keys, self.sink.put)
        weights.stream_started(self.stream, parts.engine.side)
        progress = EngineProgress(weights.staged.refresh, Heartbeat(self.run_dir, self.sampler_id))
        params, version = weights.installed()
        # handed over, not kept: the serve alone holds the first version, until a newer one replaces it
        engine = EngineThread(parts.engine, FirstWeights(params), self.stream, progress.refresh, version,
                              f"{self.sampler_id}-engine")
        del params
        started = self._stream_started = time.monotonic()
        try:
            while not self.stop_event.is_set():
                progress.beat_if_alive(not self.stream.in_flight())
                parts.client.check()
                self.sink.check()
                engine.check()
                if weights.poll_due():
                    weights.poll()
                weights.report_installed()
                if weights.final_reached():
                    break
                self._feed(parts)
                self._report_throughput()
                parts.metrics.backlog.set(parts.client.unacked)
                self.stream.wait_change(FEED_WAIT_S)
        except Exception as exc:
            if engine.error is None:
                raise
            # the engine failed meanwhile (while the feeder waited in Admit, say), and the stream it cancelled refused
            # the next group: the engine's error, raised below, is the sampler's (a PermanentError stays one)
            log.debug("%s: the feeder's %r followed the engine's failure", self.sampler_id, exc)
        finally:
            self.stream.cancel()
            engine.join()
            self.sink.close()
            self.serve_seconds, self.engine_idle_seconds = time.monotonic() - started, self.stream.idle_seconds
            self.compile_seconds = engine.compile_seconds
            self.stream = None
            weights.stream_started(None, None)
        if engine.error is not None:
            raise engine.error
        self.sink.check()  # what the sink met while it finished the groups handed over (close() keeps it there)
        weights.install_final()

    def _feed(self, parts: Parts) -> None:
        """Start the groups the stream has room for and admission grants: injected prompts first."""
        gen, stream = self.cfg.generation, self.stream
        room = stream.room(self.rows_in_flight, self.slots)
        waiting = self.source.injected_rows_waiting()
        if waiting > room:  # rows are kept free for the injected prompt next in line: they free as episodes end
            return
        wanted = max(room // gen.num_generations, 1 if waiting else 0)
        if wanted <= 0:
            return
        if self._held_back():
            self.weights.feeder_passed()
            return
        wanted = min(wanted, self._version_allows())  # a cap's remainder, not one more feed's worth past it
        # never below 0: the ingest refuses a negative count for good (INVALID_ARGUMENT), which would stop the sampler.
        # Read upstream first (stream, sink, sender), as groups move that way on other threads and each is counted
        # downstream before it leaves upstream: one moving meanwhile counts twice (a smaller grant), never 0 times
        in_stream = len(stream.in_flight())
        in_sink = self.sink.pending()
        holding = max(0, in_stream + in_sink + parts.client.unacked)
        version, epoch = self.weights.version, self.weights.epoch
        granted = self.admission.admit(wanted, version, holding)
        if granted == 0:
            self.weights.feeder_passed()
            return
        for work in self.source.next_groups(granted, room, version):
            work.epoch = epoch  # no other epoch's version is installed while it runs (StagedWeights drains for one)
            stream.start(work, self.injected_rollouts if work.injected else self.rollouts, version)
            self.groups_started += 1
            if work.train:  # an evaluation-only answer is never trained: it takes none of the step's places
                self.weights.group_started()

    def _held_back(self) -> bool:
        """No group may start now: the backlog is full (groups ended and not yet acknowledged, those still being
        scored included: a reward slower than generation would pile them up without bound), the weights are too
        stale for the trainer to use what is made now, synchronous mode's count for this version is reached, or a
        drain for a new version is on."""
        in_sink = self.sink.pending()  # before the sender's count: a group sent between the two reads counts twice
        if in_sink + self.client.unacked >= self.cfg.sampler.backlog_max_groups:
            return True
        held = self.sync.too_stale() or self._version_allows() <= 0 or self.weights.staged.waiting()
        now = time.monotonic()
        if held and self._held_since is None:
            self._held_since = now
            if self.sync.too_stale():
                log.warning("%s: version %d is %d behind the newest (trainer.max_staleness %d); waiting for weights",
                            self.sampler_id, self.weights.version, self.sync.lag(), self.cfg.trainer.max_staleness)
        elif not held and self._held_since is not None:
            self.waited_for_weights_s += now - self._held_since
            self._held_since = None
        return held

    def _left_out(self, run) -> None:
        """The sink left a group out (the sink's thread): see left_out_at_version (an evaluation-only one never
        counted toward the cap)."""
        if run.work.train:
            self._lost_at_version(run.version_at_start)

    def _lost_at_version(self, version: int) -> None:
        """A training group started at `version` that the trainer never gets (the sink's or the sender's thread)."""
        with self._left_out_lock:
            self.left_out_at_version[version] += 1

    def _version_allows(self) -> int:
        """Groups sampler.max_groups_per_version still lets start with the installed version (those started with it,
        less those left out: a failed group counted against it held the sampler for a version the trainer could
        never make, as it waits for the step's groups: a hang of synchronous GRPO). Without a cap, any number."""
        cap = self.cfg.sampler.max_groups_per_version
        if cap is None:
            return 2**31 - 1
        version, left_out = self.weights.version, self.left_out_at_version
        with self._left_out_lock:
            for old in [v for v in list(left_out) if v < version]:  # versions no longer installed count nothing
                del left_out[old]
            return cap - (self.weights.groups_at_version - left_out[version])

    def _summary(self, parts: Parts, started: float, drained: bool, verified: dict | None, endpoint) -> dict:
        """The run's figures: logged, returned, and written to RUN_DIR/sampler-<index>.json."""
        elapsed, client, sink, weights = time.monotonic() - started, parts.client, self.sink, self.weights
        if self._held_since is not None:  # still held when the stream ended (the final version came while waiting)
            self.waited_for_weights_s += time.monotonic() - self._held_since
            self._held_since = None
        log.info("%s stopping: %d groups generated (%.2f groups/s), stream stats %s, backlog drained: %s, "
                 "versions installed %s, %.1fs waiting for weights", self.sampler_id, sink.groups_sent,
                 sink.groups_sent / max(elapsed, 1e-9), dict(client.stats), drained,
                 count_and_range(weights.installed_versions), self.waited_for_weights_s)
        # what became of the groups handed to the stream: the ingest's acknowledgements (accepted: in the buffer, a
        # duplicate's second copy included; rejected_invalid), and those never sent (too stale by then, of another
        # trainer epoch, larger than a message, or still unacknowledged when the drain ended)
        stream = {name: int(client.stats.get(name, 0)) for name in (
            "accepted", "rejected_invalid", "dropped_stale", "dropped_epoch", "rejected_too_large", "retried",
            "reconnects")}
        stream["unsent"] = client.unacked  # after the drain: what the sender's close abandons
        result = {"sampler_id": self.sampler_id, "groups": sink.groups_sent, "groups_generated": sink.groups_generated,
                  "groups_accepted": stream["accepted"], "stream": stream,
                  "groups_started": self.groups_started, "groups_failed": sink.groups_failed,
                  "episodes_errored": sink.episodes_errored,
                  "injected_groups": self.source.injected_done, "rows_in_flight": self.rows_in_flight,
                  "waited_for_admission_s": round(self.admission.waited_s, 3),
                  "versions": weights.installed_versions,
                  "waited_for_weights_s": round(self.waited_for_weights_s, 3),
                  "fetch_seconds": weights.fetch_seconds, "fetch_bytes": weights.fetch_bytes,
                  "publish_to_install_seconds": weights.publish_to_install_s,
                  "final_weights": verified,
                  # the tokens the model sampled in the groups sent (not an environment's observations); the time
                  # the engine had work (its serve's time less the time it waited with nothing to decode), and the
                  # time since the first weights
                  "tokens_generated": sink.tokens_generated,
                  "generate_seconds": round(self.serve_seconds - self.engine_idle_seconds, 3),
                  "engine_idle_seconds": round(self.engine_idle_seconds, 3),
                  # the part of generate_seconds the engine's thread spent making programs (a new shape's, the
                  # weights' relayout), not decoding: the engine alone is timed without it (bench/gpu.py)
                  "compile_seconds": round(self.compile_seconds, 3),
                  "environment_seconds": round(self.rollouts.environment_seconds, 3),
                  "sampling_seconds": round(elapsed, 3),
                  "device_memory": device_memory(self.devices[0] if self.devices else None),
                  "host_memory": host_memory(),
                  # the JAX engine's compiled shapes (slots, windows, prompt buckets): each costs a compilation
                  "engine_programs": sorted(map(list, getattr(parts.engine, "programs", ()))),
                  "engine_rows_decoding_mean": rows_decoding_mean(parts.engine),
                  # every token the engine made in generate_seconds, rows cancelled at the end included (null: vLLM)
                  "engine_tokens_decoded": tokens_decoded(parts.engine),
                  "openai": endpoint.figures() if endpoint is not None else None}
        if self.run_dir is not None:
            # whole or not at all: `up` stops a sampler still running after the trainer finished, and one stopped
            # mid-write left a file the run's summary could not read. Made here too: `grpo-stream sampler --run-dir D`
            # made D only with its first heartbeat, and one stopped before that failed here (exit 1 after a clean stop)
            self.run_dir.mkdir(parents=True, exist_ok=True)
            write_atomic(self.run_dir / f"{self.sampler_id}.json", to_json(result, indent=2))
        return result

    def _report_throughput(self) -> None:
        """Every few seconds: groups/s and tokens/s over the last minute, reported to the trainer with the installed
        version; every logging.summary_every_s, the same as one console line."""
        now, sink = time.monotonic(), self.sink
        if sink.first_sent is not None and self._run_started is not None:  # start-up is over (bench/startup.py)
            log.info("%s first group generated %.2fs after the sampler started", self.sampler_id,
                     sink.first_sent - self._run_started)
            self._run_started = None
        if now - self._last_report < 5.0:
            return
        self._last_report = now
        groups_s, tokens_s, span = sink.rate.rates(now, self._stream_started)
        self.sync.throughput = (groups_s, tokens_s)
        self.sync.groups_generated = sink.groups_generated
        self.sync.report()
        if now - self._last_line >= self.cfg.logging.summary_every_s and not self.cfg.logging.verbose:
            self._last_line = now
            log.info("%s: version %d (lag %d), %.2f groups/s, %.0f tokens/s over the last %.0f s; %d groups sent, "
                     "%d in flight, %d versions installed", self.sampler_id, self.weights.version, self.sync.lag(),
                     groups_s, tokens_s, span, sink.groups_sent, self.stream.groups_started - self.stream.groups_done,
                     len(self.weights.installed_versions))

    def _verify(self, parts: Parts) -> dict:
        """Digest of the installed (final) parameters and greedy completions, to compare with the trainer's."""
        problems = parts.task.heldout(self.cfg.weights.verify_prompts)
        params, version = self.weights.installed()
        return {"version": version, "sha256": digest(parts.model.to_named_numpy(params)),
                "greedy": greedy_probe(parts.engine, params, parts.tokenizer, problems, self.cfg.eval.batch_size)}


class EngineProgress:
    """The sampler's heartbeat (RUN_DIR/heartbeats/<sampler id>, `up`'s stall watch: up.sampler_stall_s): beaten from
    the feeder's loop while the engine reaches its scheduling points (`refresh`, which it calls between chunks) or
    has nothing to do. A hung engine, or a loop that stopped, leaves it to age."""

    def __init__(self, refresh, heartbeat: Heartbeat):
        self._refresh, self.heartbeat = refresh, heartbeat
        self.points = self._seen = 0

    def refresh(self):
        self.points += 1
        return self._refresh()

    def beat_if_alive(self, idle: bool) -> None:
        if idle or self.points != self._seen:
            self._seen = self.points
            self.heartbeat()


def run_sampler(cfg: RunConfig, index: int, run_dir: pathlib.Path | None = None) -> dict:
    sampler = Sampler(cfg, index, run_dir=run_dir)
    stop_on_signals(sampler.stop_event, "rollout stream")
    return sampler.run()
