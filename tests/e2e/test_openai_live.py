"""The OpenAI-compatible endpoint of a live sampler: `up` on the CPU smoke config with sampler.openai.port=0, the
real `openai` client with the run's client token, 64 requests at once while the samplers keep streaming groups and
the trainer keeps stepping; every request answered, some inside the sampler's own batches."""

import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import threading

import openai
import pytest

from tests.e2e.test_up import ROOT
from tests.support import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


class Lines:
    """`up`'s output, read on a thread; the trainer's last step seen."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.lines, self.step = proc, [], -1
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            found = re.search(r"step (\d+)/", line)
            if found:
                self.step = max(self.step, int(found.group(1)))

    def text(self) -> str:
        return "".join(self.lines)[-4000:]


# an `up` run (~85 s, stop 76); the endpoint beside the sampler's batches stays in the default lane
# (tests/integration/test_openai_endpoint.py)
@pytest.mark.heavy
def test_64_concurrent_requests_while_the_sampler_streams_groups(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "grpo_stream", "up", "--config", "configs/tiny_arith_smoke.yaml", "--run-dir",
         str(run_dir), "trainer.steps=100000", "warmstart.steps=0", "trainer.eval_before=false",
         "trainer.eval_after=false", "sampler.openai.port=0", "sampler.openai.model_name=tiny",
         "sampler.openai.max_concurrent_per_token=64",  # one token sends all 64 at once (default: half of 64)
         "logging.verbose=true"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out = Lines(proc)
    try:
        def running(step: int) -> bool:
            assert proc.poll() is None, out.text()
            return out.step >= step and (run_dir / "openai-sampler-0.json").exists()

        wait_for(lambda: running(1), 300, "trainer step 1 and sampler-0's endpoint", interval_s=0.5)
        url = json.loads((run_dir / "openai-sampler-0.json").read_text())["url"]
        client = openai.OpenAI(base_url=url, api_key=(run_dir / "auth" / "client.token").read_text().strip(),
                               max_retries=0, timeout=120)
        step_before = out.step
        with concurrent.futures.ThreadPoolExecutor(64) as pool:
            replies = list(pool.map(lambda i: client.completions.create(
                model="tiny", prompt=f"Q: Tom has {i} apples and gets 3 more. How many apples now? A:",
                max_tokens=12, logprobs=0, extra_body={"return_token_ids": True}), range(64)))
        assert all(len(r.choices[0].model_extra["token_ids"]) == len(r.choices[0].logprobs.token_logprobs) >= 1
                   for r in replies)
        # then a steady trickle (8 callers, 64 requests): requests that come while the sampler decodes its batch
        # join that batch (those that come while it waits for admission or weights are served on their own)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            trickle = list(pool.map(lambda i: client.completions.create(
                model="tiny", prompt=f"Q: Ana has {i} pens and buys 5 more. How many pens now? A:", max_tokens=12),
                range(64)))
        assert all(r.choices[0].text is not None for r in trickle)
        wait_for(lambda: running(step_before + 2), 300, "two more trainer steps", interval_s=0.5)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        proc.wait(timeout=180)
        out.thread.join(timeout=10)
    figures = json.loads((run_dir / "sampler-0.json").read_text())["openai"]
    assert figures["requests"] >= 128 and figures["sequences"] >= 128, figures
    assert figures["sequences_in_sampler_batches"] >= 1, figures  # requests rode the sampler's own batches
    assert json.loads((run_dir / "sampler-0.json").read_text())["groups"] >= 1
