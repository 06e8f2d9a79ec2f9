"""Negative and positive fuzzing of the HTTP API from the app's own OpenAPI schema (schemathesis):
no 5xx, responses conform to the schema, invalid input is rejected. `FUZZ_EXAMPLES` examples per
operation and mode (positive and negative; operations with few distinct inputs run fewer): the
default 150 gives over 1,000 cases, S5_FUZZ_EXAMPLES=300 over 2,000. Every case's status is counted
and printed at the end."""

import os
from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable

from schemathesis.specs.openapi.checks import positive_data_acceptance

from engine import EngineConfig
from service.settings import Settings
from tests.servers import LiveServer, free_port

FUZZ_EXAMPLES = int(os.environ.get("S5_FUZZ_EXAMPLES", "150"))


@pytest.fixture(scope="module")
def fuzz_server():
    settings_ = Settings(engine=EngineConfig(model="tiny-random", max_rows=8, kv_cache_bytes=1 << 22,
                                             max_model_len=512),
                         port=free_port(), max_queued=64)
    srv = LiveServer(settings_).start()
    yield srv
    srv.stop()


def test_api_fuzz(fuzz_server):
    """Every operation of the schema x {positive, negative} generation, FUZZ_EXAMPLES each."""
    schema = schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json")
    statuses: Counter = Counter()
    failures, no_negative = [], []
    operations = [op.ok() for op in schema.get_all_operations()]
    assert len(operations) >= 9
    for operation in operations:
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
                      derandomize=True, database=None)
            def run(case):
                if isinstance(case.body, dict):  # validation is the point, not long decodes
                    for key in ("max_tokens", "max_completion_tokens"):
                        if isinstance(case.body.get(key), int) and case.body[key] > 8:
                            case.body[key] = 8
                response = case.call(timeout=30)
                statuses[response.status_code] += 1
                try:
                    # every default check (5xx, status codes, content types, response schemas,
                    # headers, invalid data rejected) except "schema-valid data accepted": requests
                    # the schema allows can still be refused on meaning (token ids beyond the
                    # vocabulary, a prompt past the context, chat on a model without a tokenizer)
                    case.validate_response(response, excluded_checks=[positive_data_acceptance])
                except Exception as exc:  # a schema violation or a 5xx
                    failures.append(f"{operation.label} {mode.value}: {type(exc).__name__}: {str(exc)[:300]}")

            try:
                run()
            except Unsatisfiable:  # no invalid input exists (an operation without parameters or body)
                assert mode == schemathesis.GenerationMode.NEGATIVE
                no_negative.append(operation.label)
    fuzz_server.wait_idle()
    fuzz_server.check_invariants()
    cases = sum(statuses.values())
    print(f"\nfuzz: {len(operations)} operations, {cases} cases, statuses {dict(sorted(statuses.items()))}, "
          f"{len(failures)} failed checks; no invalid input exists for {no_negative}")
    assert not failures, "\n".join(failures[:10])
    assert not any(s >= 500 for s in statuses)
    assert statuses[200] > 0 and statuses[400] > 0  # both served and refused cases were generated
    assert cases >= 2 * FUZZ_EXAMPLES * 3  # at least the generation routes x both modes ran in full
    if FUZZ_EXAMPLES >= 150:
        assert cases >= 1000 * FUZZ_EXAMPLES // 150
