"""The trainer's Prometheus endpoint stays bounded (issue 41, finding 9): a sampler token may speak for any
`<name>-<k>`, so sampler ids are invented at will, and each became a `sampler_weight_lag` series kept for the whole
run. Real trainer server with auth (ReportVersion over gRPC), the step reporter's real /metrics endpoint."""

import re
import urllib.request

import pytest

from grpo_stream.protos import weights_pb2, weights_pb2_grpc
from grpo_stream.trainer_service.publication import samplers as samplers_module
from grpo_stream.trainer_service.reports.metrics import MetricsWriter
from grpo_stream.trainer_service.reports.step_report import MAX_LAG_SERIES, StepReporter
from tests.support import serve, with_run_name

pytestmark = pytest.mark.redis
SERIES = re.compile(r'^grpo_stream_sampler_weight_lag\{sampler="([^"]*)"\} (\S+)$', re.M)


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return {label: float(value) for label, value in SERIES.findall(reply.read().decode())}


def test_invented_sampler_ids_do_not_grow_the_lag_series(tiny_parts, shared_redis, run_name, tmp_path, monkeypatch):
    cfg, task, tokenizer, _ = tiny_parts
    cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"metrics_port": 0})})
    with serve(with_run_name(cfg, run_name), shared_redis.url, tmp_path / "auth", task, tokenizer) as stack:
        reporter = StepReporter(stack.cfg, MetricsWriter(tmp_path / "run", "trainer"), stack.buffer,
                                stack.publisher, held=lambda: 0)
        try:
            weights = weights_pb2_grpc.WeightServiceStub(stack.channel("sampler"))
            epoch = stack.publisher.epoch
            for k in range(3 * MAX_LAG_SERIES):  # one sampler token reporting under ids it makes up
                weights.ReportVersion(weights_pb2.VersionReport(sampler_id=f"sampler-{k}", installed_version=0,
                                                                trainer_epoch=epoch))
            reporter.export_sampler_lags()
            series = scrape(reporter.prom.port)
            assert len(series) == MAX_LAG_SERIES + 1, len(series)
            assert {f"sampler-{k}" for k in range(MAX_LAG_SERIES)} | {"(other)"} == set(series)
            # samplers the publisher forgets (silent past its expiry) lose their series
            monkeypatch.setattr(samplers_module, "SAMPLER_EXPIRY_S", 0.0)
            stack.publisher.samplers._next_sweep = 0.0
            weights.ReportVersion(weights_pb2.VersionReport(sampler_id="sampler-4095", installed_version=0,
                                                            trainer_epoch=epoch))
            reporter.export_sampler_lags()
            assert set(scrape(reporter.prom.port)) == {"sampler-4095"}
        finally:
            reporter.close()


def test_the_trainers_metrics_bind_where_told_not_where_grpc_listens(tiny_parts, shared_redis, run_name, tmp_path):
    """/metrics followed trainer.host: a trainer serving gRPC on every interface served its metrics there too, with
    no way to keep them on the host."""
    cfg, task, tokenizer, _ = tiny_parts
    with serve(with_run_name(cfg, run_name), shared_redis.url, tmp_path / "auth", task, tokenizer) as stack:
        for host, metrics_host, bound in (("0.0.0.0", "127.0.0.1", "127.0.0.1"), ("127.0.0.1", None, "127.0.0.1"),
                                          ("0.0.0.0", None, "0.0.0.0")):
            told = stack.cfg.model_copy(update={"trainer": stack.cfg.trainer.model_copy(
                update={"metrics_port": 0, "host": host, "metrics_host": metrics_host})})
            reporter = StepReporter(told, MetricsWriter(tmp_path / "run", "trainer"), stack.buffer, stack.publisher,
                                    held=lambda: 0)
            try:
                assert reporter.prom._server.server_address[0] == bound
                assert scrape(reporter.prom.port) is not None
            finally:
                reporter.close()
