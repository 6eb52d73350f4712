"""Schema fuzzing: schemathesis generates requests from the server's own /openapi.json (valid
and invalid bodies alike) and checks that none gets a server error, that every answer has a documented content type
(JSON, or server-sent events for streams) and that every JSON answer matches its schema. Bounded for CI (FUZZ_EXAMPLES per operation, a 64-token
context so every generation is short); docs/serving.md gives the longer operator run.
"""

from __future__ import annotations

import os

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from prometheus_client.parser import text_string_to_metric_families
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
)
from serve_fixtures import API_KEY, ThreadedServer, save_serve_checkpoint

FUZZ_EXAMPLES = int(os.environ.get("TORCH_RUNNER_FUZZ_EXAMPLES", "100"))
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path, _ = save_serve_checkpoint(tmp_path_factory.mktemp("fuzz") / "tiny")
    threaded = ThreadedServer(
        path, max_model_len=64, max_num_seqs=8, max_waiting=256, max_total_tokens=2048
    )
    yield threaded
    threaded.stop()


def _operations(base_url: str):
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


def test_no_server_error_and_documented_responses(server):
    """Every operation of /openapi.json (driven through hypothesis directly: schemathesis'
    pytest plugin does not run on this pytest)."""
    operations = _operations(server.base_url)
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions"}
    for operation in operations:

        @settings(
            max_examples=FUZZ_EXAMPLES,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,
            database=None,
        )
        @given(case=operation.as_strategy())
        def fuzz(case):
            response = case.call(headers=AUTH, timeout=60)
            case.validate_response(
                response,
                checks=[not_a_server_error, content_type_conformance, response_schema_conformance],
            )

        fuzz()


def test_server_still_healthy_after_fuzzing(server):
    """Healthy, no 500 counted, and the fuzzer reached generation (some 200s), not only 400s."""
    assert httpx.get(f"{server.base_url}/health").json()["status"] == "ok"
    statuses: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{server.base_url}/metrics").text):
        for sample in family.samples:
            if sample.name == "torch_runner_requests_total":
                key = (sample.labels["endpoint"], sample.labels["status"])
                statuses[key] = statuses.get(key, 0.0) + sample.value
    assert not any(status.startswith("5") for _, status in statuses)
    assert statuses.get(("/v1/completions", "200"), 0) > 0
    assert statuses.get(("/v1/chat/completions", "200"), 0) > 0
